"""Why helpers hand units back through /dev/shm: a result through a process pool's pipe vs a file,
with 0, 1 or 3 busy Python threads in the receiving process, at two GIL switch intervals.

    python bench/gil_convoy.py [--mb 4.4]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor


def _make(n: int) -> bytes:
    return b"x" * n


def _make_file(n: int, directory: str) -> str:
    fd, path = tempfile.mkstemp(dir=directory)
    with os.fdopen(fd, "wb") as f:
        f.write(b"x" * n)
    return path


def _busy(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=4.4)
    ap.add_argument("--n", type=int, default=20)
    a = ap.parse_args()
    size = int(a.mb * 1e6)
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    pool = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"))
    pool.submit(_make, 1).result()
    for interval in (0.005, 0.0005):
        sys.setswitchinterval(interval)
        for via in ("pipe", "file"):
            for threads in (0, 1, 3):
                stop = threading.Event()
                busy = [threading.Thread(target=_busy, args=(stop,)) for _ in range(threads)]
                for t in busy:
                    t.start()
                t0 = time.perf_counter()
                for _ in range(a.n):
                    if via == "pipe":
                        pool.submit(_make, size).result()
                    else:
                        path = pool.submit(_make_file, size, shm).result()
                        with open(path, "rb") as f:
                            f.read()
                        os.unlink(path)
                dt = (time.perf_counter() - t0) / a.n
                stop.set()
                for t in busy:
                    t.join()
                print(f"switch {interval * 1e3:.1f} ms, via {via}, {threads} busy threads: {dt * 1e3:7.1f} ms per result")
    pool.shutdown()


if __name__ == "__main__":
    main()
