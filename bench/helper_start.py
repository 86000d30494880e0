"""How long a UnitPool of N helpers takes to construct and to have every helper ready (amazon-reviews preset,
the bundled MiniLM tokenizer). python3 bench/helper_start.py N"""
import time, sys
from embedfleet.encode.tokenize import tokenizer_spec
from embedfleet.runtime.units import UnitContext, UnitPool
n = int(sys.argv[1])
ctx = UnitContext("amazon-reviews", None, None, None, tokenizer_spec(None))
t0 = time.perf_counter(); pool = UnitPool(ctx, n); t1 = time.perf_counter()
pool.start(); t2 = time.perf_counter()
print(f"{n} helpers: constructor {t1-t0:.3f} s, then ready after {t2-t1:.3f} s more")
pool.close()
