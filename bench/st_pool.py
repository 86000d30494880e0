"""The peer for several GPUs: sentence-transformers' own multi-process pool on the same texts.

    python bench/st_pool.py --model DIR [--gpus 1,2,4,8] [--n 400000] [--batch 256]

For each GPU count: a pool of one process per GPU (`start_multi_process_pool`), bf16 on CUDA, the same
review texts `bench/ingest.py` embeds (`synth.long_tail_texts`), timed over the whole encode after a
warm-up call; texts/s and the scaling against the smallest count. One JSON document on stdout.
"""

from __future__ import annotations

import argparse
import sys
import time

import orjson

import harness


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--gpus", default="1,2")
    ap.add_argument("--n", type=int, default=400_000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--cpu", action="store_true", help="processes on the CPU instead (a dry run without a GPU)")
    a = ap.parse_args()
    import torch
    from sentence_transformers import SentenceTransformer

    from embedfleet.synth import long_tail_texts

    texts = long_tail_texts(a.n, seed=7)
    model = SentenceTransformer(a.model, device="cpu")
    runs = []
    for count in (int(g) for g in a.gpus.split(",")):
        devices = ["cpu"] * count if a.cpu else [f"cuda:{i}" for i in range(count)]
        if not a.cpu:
            model = model.to(torch.bfloat16)  # its best setting on a GPU, as in `embedfleet bench`
        t_pool = time.perf_counter()
        pool = model.start_multi_process_pool(target_devices=devices)
        # each step as it ends: a run cut short by a timeout says where it was (run 75's 4-GPU pool left nothing)
        print(f"[st_pool] {count} GPU(s): pool started in {time.perf_counter() - t_pool:.1f} s", file=sys.stderr, flush=True)
        try:
            def run(t):
                try:  # sentence-transformers ≥ 5 takes the pool in encode()
                    return model.encode(t, pool=pool, batch_size=a.batch)
                except TypeError:
                    return model.encode_multi_process(t, pool, batch_size=a.batch)
            run(texts[: 20 * a.batch * count])  # warm-up: every process's model and kernels
            print(f"[st_pool] {count} GPU(s): warmed up at {time.perf_counter() - t_pool:.1f} s", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            out = run(texts)
            seconds = time.perf_counter() - t0
        finally:
            model.stop_multi_process_pool(pool)
        runs.append({"gpus": count, "texts": len(out), "seconds": round(seconds, 2), "texts_per_s": round(a.n / seconds, 1),
                     "pool_start_and_warmup_s": round(t0 - t_pool, 2)})
        print(f"[st_pool] {runs[-1]}", file=sys.stderr, flush=True)  # each count as measured: a run cut short keeps it
    one = min(runs, key=lambda r: r["gpus"])  # counts may come in any order (the largest first, under a timeout)
    base = one["texts_per_s"] / one["gpus"]
    for r in runs:
        r["scaling"] = round(r["texts_per_s"] / (base * r["gpus"]), 3)
    print(orjson.dumps(harness.stamp({"model": a.model, "n": a.n, "batch": a.batch, "runs": runs}),
                      option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
