"""One encoder's start-up on a GPU, step by step, with a profile of the model load.

    python bench/encoder_startup.py MODEL_DIR

Times torch's import, CUDA's first use, `Encoder(...)` (weights, packed model, custom ops) and
`warmup()` (torch.compile) in a fresh process — what every ingest worker pays before its first unit —
then prints the 18 most expensive calls of `Encoder(...)` by cumulative time.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time


def main() -> None:
    t0 = time.perf_counter()
    import torch

    t1 = time.perf_counter()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    from embedfleet.encode.encoder import Encoder

    t3 = time.perf_counter()
    profile = cProfile.Profile()
    profile.enable()
    enc = Encoder(sys.argv[1], device="cuda", tokenizer_workers=0)
    torch.cuda.synchronize()
    profile.disable()
    t4 = time.perf_counter()
    enc.warmup()
    torch.cuda.synchronize()
    t5 = time.perf_counter()
    steps = dict(torch=t1 - t0, cuda_init=t2 - t1, encoder_import=t3 - t2, encoder=t4 - t3, warmup=t5 - t4)
    print({k: round(v, 3) for k, v in steps.items()})
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(18)
    print(out.getvalue()[-3500:])


if __name__ == "__main__":
    main()
