"""One encoder's start-up, step by step, in a fresh process (GPU or CPU).

    python bench/encoder_startup.py [MODEL_DIR] [--device auto|cpu|cuda] [--helpers N] [--first N] [--json]

Times what every ingest worker (and a user's first call) pays before its first vectors: the
interpreter, torch's import, CUDA's first use, `Encoder(...)` — split, from a profile of the
constructor, into reading the config, the safetensors load, the tokenizer, building the packed model
on the device and the batch-token probe — then the first small encode (eager), the tokenizer's helper
processes (N of them, the Encoder's default unless given) and the background compile (CUDA; cold on a machine's first run,
from `$EMBEDFLEET_HOME/cache` after). Prints the steps, then the constructor's 18 costliest calls.
Run it twice: the second run shows the cached compile (the issue's "second run on the machine").

`--first N`: the first encode is a call of N reviews instead of one query — what `embedfleet bench`
times as the first call — profiled: where its wall time went (waiting for the device's results, for
the tokenizer's chunks, starting the helpers), then its 18 costliest calls.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time

import harness

_FIRST = {  # where a first big call waits (profile entries, cumulative wall time of the main thread)
    "launch": ("encode/encoder.py", "_launch"),
    "device_results": ("encode/encoder.py", "result"),
    "tokenized_chunks": ("concurrent/futures/_base.py", "result"),
    "helpers_start": ("encode/tokenize.py", "_start_pool"),
}

_STEPS = {  # profile entries (file suffix, function) whose cumulative time is one step of Encoder(...)
    "read_spec": ("encode/models.py", "read_spec"),
    "safetensors_load": ("encode/packed/__init__.py", "load_state"),
    "tokenizer": ("encode/tokenize.py", "build"),
    "packed_build": ("encode/packed/__init__.py", "build"),
    "batch_probe": ("encode/budget.py", "probe_batch_tokens"),
}


def _process_age() -> float | None:
    try:
        import psutil

        return time.time() - psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - only a figure
        return None


def main() -> None:
    interpreter = _process_age()
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None, help="model directory (default: the bundled MiniLM)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--helpers", type=int, default=None,
                    help="tokenizer helper processes (0: none; default: the Encoder's)")
    ap.add_argument("--first", type=int, default=0, help="the first encode: N reviews, profiled (0: one query)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    steps: dict[str, float | None] = {"interpreter": interpreter}
    t0 = time.perf_counter()
    import torch

    steps["torch_import"] = time.perf_counter() - t0
    cuda = a.device.startswith("cuda") or (a.device == "auto" and torch.cuda.is_available())
    if cuda:
        t0 = time.perf_counter()
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        steps["cuda_init"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    from embedfleet.encode.encoder import Encoder

    steps["encoder_import"] = time.perf_counter() - t0
    profile = cProfile.Profile()
    t0 = time.perf_counter()
    profile.enable()
    enc = Encoder(a.model, device=a.device, tokenizer_workers=a.helpers)
    if cuda:
        torch.cuda.synchronize()
    profile.disable()
    steps["encoder"] = time.perf_counter() - t0
    stats = pstats.Stats(profile)
    for name, (suffix, func) in _STEPS.items():
        steps[f"  {name}"] = sum(v[3] for k, v in stats.stats.items() if k[0].endswith(suffix) and k[2] == func)
    first = None
    if a.first:
        from embedfleet.synth import review_texts

        texts = review_texts(a.first, seed=0)
        first = cProfile.Profile()
        t0 = time.perf_counter()
        first.enable()
        enc.encode(texts)
        first.disable()
        steps[f"first_call_{a.first}"] = time.perf_counter() - t0
        fs = pstats.Stats(first)
        for name, (suffix, func) in _FIRST.items():
            steps[f"  {name}"] = sum(v[3] for k, v in fs.stats.items() if k[0].endswith(suffix) and k[2] == func)
    else:
        t0 = time.perf_counter()
        enc.encode(["one query, eagerly"])
        steps["first_query"] = time.perf_counter() - t0
    if a.helpers is None or a.helpers:
        t0 = time.perf_counter()
        enc._tok.start()
        steps["helpers"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    enc.warmup()  # CUDA: libraries' first use, then waits for the background compile
    if cuda:
        torch.cuda.synchronize()
    steps["warmup"] = time.perf_counter() - t0
    compile_ = getattr(enc, "_compile", None)
    steps["  compile"] = getattr(compile_, "seconds", None)
    info = {"device": enc.device, "model": enc.name, "compile": enc.describe().get("compile"),
            "compiled_before_s": getattr(compile_, "cached_seconds", None),
            "cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"), "torch": torch.__version__,
            "steps_s": {k: (round(v, 3) if v is not None else None) for k, v in steps.items()}}
    if a.json:
        print(json.dumps(harness.stamp(info)))
        return
    print({k: v for k, v in info.items() if k != "steps_s"})
    for k, v in info["steps_s"].items():
        print(f"  {k:<22} {'-' if v is None else f'{v:8.3f} s'}")
    for prof in (profile, first):
        if prof is not None:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(18)
            print(out.getvalue()[-3500:])
    enc.close()


if __name__ == "__main__":
    main()
