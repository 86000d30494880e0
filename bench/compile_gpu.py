"""Where a worker's compile goes on a GPU host (issue 17): one from the cache took 10.7 s on an H100
host (bench/NOTES.md, run 79) while dynamo's timed phases summed to 1.6 s.

    EMBEDFLEET_HOME=/tmp/efhome python bench/compile_gpu.py MODEL [--profile 30] [--threads N] [--preimport]

Loads an Encoder on CUDA as a worker does, then runs its BackgroundCompile's work on this thread,
optionally under cProfile (`--profile K`: the K functions with the most cumulative time). `--threads`
sets Inductor's compile threads (its worker processes) before torch is imported. Run it once cold,
then again: the second run is what a machine's second ingest meets. `--preimport` imports what the
compile needs (torch._dynamo, Inductor) on a thread of its own from `import torch` on, beside the
model's load, and reports how long the compile then took.
"""

from __future__ import annotations

import argparse
import json
import os
import time

T0 = time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--preimport", action="store_true")
    a = ap.parse_args()
    if a.threads is not None:
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = str(a.threads)
    steps = {}
    t = time.perf_counter()
    import torch

    steps["import_torch_s"] = time.perf_counter() - t
    pre = None
    if a.preimport:
        import threading

        def imports():
            import torch._dynamo  # noqa: F401
            import torch._inductor.compile_fx  # noqa: F401

        pre = threading.Thread(target=imports)
        pre.start()
    from embedfleet.encode.encoder import Encoder

    t = time.perf_counter()
    enc = Encoder(a.model, device="cuda", tokenizer_workers=0)
    enc.encode(["warm up"] * 8 + ["warm up " * 200] * 2)  # as Encoder.warmup: cuBLAS, attention first calls
    torch.cuda.synchronize()
    steps["encoder_s"] = time.perf_counter() - t
    job = enc._compile
    if pre is not None:
        t = time.perf_counter()
        pre.join()
        steps["preimport_wait_s"] = time.perf_counter() - t
    t = time.perf_counter()
    if a.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        job._run()
        prof.disable()
    else:
        job._run()
    steps["compile_s"] = time.perf_counter() - t
    steps["process_s"] = time.perf_counter() - T0
    print(json.dumps({"threads": a.threads, "steps": {k: round(v, 3) for k, v in steps.items()},
                      "report": job.report()}))
    if a.profile:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(a.profile)


if __name__ == "__main__":
    main()
