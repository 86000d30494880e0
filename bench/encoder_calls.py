"""The encoder as a notebook uses it: a fresh process, `Encoder(model)` with no warm-up, then the same texts encoded
call after call. Is any call slower than the one before (a background compile or helper start taking the GIL), and
how soon does a call reach the CLI's steady rate?

    python bench/encoder_calls.py MODEL_DIR [--device cuda] [--n 20000] [--calls 5] [--texts world|reviews]

A line a call on stdout: texts/s, seconds, the compile's state after it; the constructor's seconds first.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    t0 = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--texts", default="world", choices=("world", "reviews"))
    a = ap.parse_args()
    from embedfleet import Encoder
    from embedfleet.synth import review_texts, world_texts

    texts = (world_texts if a.texts == "world" else review_texts)(a.n, seed=3)
    t1 = time.perf_counter()
    enc = Encoder(a.model, device=a.device)
    t2 = time.perf_counter()
    print(f"construct {t2 - t1:.2f} s ({t2 - t0:.2f} s with imports)", flush=True)
    for i in range(a.calls):
        t = time.perf_counter()
        enc.encode(texts)
        dt = time.perf_counter() - t
        print(f"call {i + 1}: {len(texts) / dt:.0f} texts/s ({dt:.2f} s) compile={enc.describe()['compile']}", flush=True)


if __name__ == "__main__":
    main()
