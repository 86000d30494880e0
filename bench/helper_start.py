"""How long a worker's helper pool takes to construct, then to have every helper ready.

    python3 bench/helper_start.py [N ...]     (default: 2 8)

UnitPool of N helpers for the amazon-reviews preset and the bundled MiniLM tokenizer (its JSON travels to
each helper as part of its setup). No GPU, no database.
"""

from __future__ import annotations

import sys
import time

from embedfleet.encode.tokenize import tokenizer_spec
from embedfleet.runtime.units import UnitContext, UnitPool


def main() -> None:
    ctx = UnitContext("amazon-reviews", None, None, None, tokenizer_spec(None))
    for n in [int(v) for v in sys.argv[1:]] or [2, 8]:
        t0 = time.perf_counter()
        pool = UnitPool(ctx, n)
        t1 = time.perf_counter()
        pool.start()
        t2 = time.perf_counter()
        pool.close()
        print(f"{n} helpers: constructor {t1 - t0:.3f} s, then ready after {t2 - t1:.3f} s more", flush=True)


if __name__ == "__main__":
    main()
