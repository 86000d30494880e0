"""Where a forward pass's GPU time goes: texts tokenized first (on the helpers), then `embed()` timed twice in a
fresh process (the first pass, then again), and a third pass under torch.profiler, its kernels summed by name.

    python bench/forward_profile.py MODEL_DIR [--texts reviews|world] [--n 20000] [--top 15]

One JSON document on stdout: the constructor's seconds, the two passes' seconds, the GPU's total milliseconds
and the costliest kernels (name, ms, calls). CUDA only. A model with Triton glue kernels (ModernBERT, Gemma3)
waits for them first; EMBEDFLEET_TRITON=0 profiles the torch glue instead.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--texts", default="reviews", choices=("reviews", "world"))
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    import torch

    from embedfleet import Encoder
    from embedfleet.synth import review_texts, world_texts

    texts = (world_texts if a.texts == "world" else review_texts)(a.n, seed=3)
    t0 = time.perf_counter()
    enc = Encoder(a.model, device="cuda")
    out: dict = {"model": a.model, "texts": a.texts, "n": a.n, "construct_s": time.perf_counter() - t0}
    enc.warmup(compile=False)  # the helpers up and any kernels loaded: the passes below time the forward alone
    tok = enc.tokenize(texts)
    for name in ("first_embed_s", "second_embed_s"):
        t = time.perf_counter()
        enc.embed(tok)
        torch.cuda.synchronize()
        out[name] = time.perf_counter() - t
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        enc.embed(tok)
        torch.cuda.synchronize()
    kernels = prof.key_averages()
    out["gpu_ms"] = round(sum(k.device_time_total for k in kernels) / 1e3, 1)
    out["top_kernels"] = [{"name": k.key[:100], "ms": round(k.device_time_total / 1e3, 1), "calls": k.count}
                          for k in sorted(kernels, key=lambda k: -k.device_time_total)[: a.top]]
    out["describe"] = enc.describe()
    enc.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
