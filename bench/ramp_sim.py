"""How long a GPU waits for its first units, by how a worker's first stream tasks grow (issue 20).

    python bench/ramp_sim.py [--helpers 14] [--helper-us-per-byte 0.36] [--gpu-us-per-byte 0.038]

A model of run 77 (bench/NOTES.md): the records thread reads tasks one after another (`--read-us-per-byte`),
`--helpers` prepare them, each free helper taking the next, and the GPU embeds the units in order, each as
soon as it is prepared (a hungry loop is handed a ready unit at once). For each growth schedule of
`units.task_sizes`: the wait for the first unit and the GPU's idle time after it, over `--mb` of input.
"""

from __future__ import annotations

import argparse
import itertools


def simulate(sizes, helpers: int, helper_s: float, gpu_s: float, read_s: float, window: int,
             total: float, unit: int, first_call_s: float) -> tuple[float, float, int]:
    """(seconds to the first unit, GPU idle seconds after it, units), all per byte costs in seconds."""
    tasks = []
    for size in sizes:
        if sum(tasks) >= total:
            break
        tasks.append(min(unit, size))
    read_done = list(itertools.accumulate(read_s * s for s in tasks))
    free = [0.0] * helpers  # when each helper is next free
    started_before = [False] * helpers
    gpu_free, idle, first, gpu_start = 0.0, 0.0, 0.0, []
    for i, size in enumerate(tasks):
        submitted = read_done[i] if i < window else max(read_done[i], gpu_start[i - window])
        h = min(range(helpers), key=free.__getitem__)
        begin = max(submitted, free[h])
        free[h] = begin + helper_s * size + (0.0 if started_before[h] else first_call_s)
        started_before[h] = True
        start = max(gpu_free, free[h])
        if i == 0:
            first = start
        else:
            idle += start - gpu_free
        gpu_start.append(start)
        gpu_free = start + gpu_s * size
    return first, idle, len(tasks)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--helpers", type=int, default=14)
    ap.add_argument("--helper-us-per-byte", type=float, default=0.36)  # run 77: 260 µs a passage, ~720 bytes
    ap.add_argument("--gpu-us-per-byte", type=float, default=0.038)  # run 77: 36,777 passages/s
    ap.add_argument("--read-us-per-byte", type=float, default=0.016)  # run 77: the records thread, 74 µs an article
    ap.add_argument("--first-call-s", type=float, default=0.1)  # a helper's first unit (bench/first_unit.py)
    ap.add_argument("--window", type=int, default=30)
    ap.add_argument("--mb", type=float, default=180)
    a = ap.parse_args()
    from embedfleet.runtime.units import task_sizes

    unit = 2 << 20
    for name, sizes in (("doubling from 256 kB", task_sizes(unit, 256 << 10, 2.0)),
                        ("doubling from 64 kB", task_sizes(unit, 64 << 10, 2.0)),
                        ("x1.25 from 64 kB", task_sizes(unit, 64 << 10, 1.25)),
                        ("x1.1 from 64 kB", task_sizes(unit, 64 << 10, 1.1)),
                        ("x1.05 from 64 kB (the default)", task_sizes(unit))):
        first, idle, n = simulate(sizes, a.helpers, a.helper_us_per_byte * 1e-6, a.gpu_us_per_byte * 1e-6,
                                  a.read_us_per_byte * 1e-6, a.window, a.mb * 1e6, unit, a.first_call_s)
        print(f"{name:32s} first unit {first:.3f} s, GPU idle after it {idle:.3f} s, {n} units")


if __name__ == "__main__":
    main()
