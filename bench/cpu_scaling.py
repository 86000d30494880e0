"""Does this host's CPU scale? The same pure-Python work on 1, 8, 16, … processes at once.

    python bench/cpu_scaling.py [--procs 1,8,16,24,32] [--seconds 3]

Each process runs a fixed loop (string splitting and dict lookups, like a helper's tokenizer) and
reports its time. If a process takes longer when more run beside it, the host gives less CPU per
process under load (shared physical cores, frequency, memory), and anything CPU-bound — preparing
rows for a small model on two GPUs — cannot scale linearly there, whatever the code does.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

_TEXT = " ".join(f"word{i % 997} the product works great{i % 13}" for i in range(200))


_START = None  # a barrier shared by a pool's processes


def _init(barrier) -> None:
    global _START
    _START = barrier


def _work(rounds: int) -> float:
    vocab = {w: i for i, w in enumerate(set(_TEXT.split()))}
    if _START is not None:  # every process starts timing together, so all of them really overlap
        _START.wait()
    t0 = time.perf_counter()
    total = 0
    for _ in range(rounds):
        total += sum(vocab.get(w, 0) for w in _TEXT.lower().split())
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", default="1,8,16,24,32")
    ap.add_argument("--seconds", type=float, default=3.0, help="about how long one process runs alone")
    a = ap.parse_args()
    rounds = max(1, int(a.seconds / _work(20) * 20))
    alone = None
    print(f"cores: {len(os.sched_getaffinity(0))}")
    for p in map(int, a.procs.split(",")):
        ctx = mp.get_context("spawn")
        with ctx.Pool(p, initializer=_init, initargs=(ctx.Barrier(p),)) as pool:
            times = pool.map(_work, [rounds] * p, chunksize=1)
        mean = sum(times) / len(times)
        alone = alone or mean
        print(f"{p:3d} processes: {mean:6.2f} s each ({alone / mean:.2f}× the speed of one alone), "
              f"throughput {p * alone / mean:5.1f}× one process", flush=True)


if __name__ == "__main__":
    main()
