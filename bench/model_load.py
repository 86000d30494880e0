"""Why a worker's model load grows with the workers on the host: N processes at once, one GPU each, time
each phase of an Encoder's start on its own: CUDA's start, reading the safetensors, building the packed
model from the CPU state dict (the Encoder's path: since run 129 each tensor moves to the GPU as it is
read, `packed.OnDevice`), and the same built from tensors all moved to the GPU first.

    python bench/model_load.py --model DIR [--counts 1,2,4] [--threads default,16] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def child(model: str) -> dict:
    t = {}
    t0 = time.perf_counter()
    import torch

    from embedfleet.encode import packed
    from embedfleet.encode.models import read_spec, resolve_model

    t["imports"] = time.perf_counter() - t0
    spec = read_spec(resolve_model(model))
    dev = torch.device("cuda:0")
    s = time.perf_counter()
    torch.empty(1, device=dev)
    torch.cuda.synchronize()
    t["cuda_start"] = time.perf_counter() - s
    s = time.perf_counter()
    state = packed.load_state(spec.hf_dir)
    t["read"] = time.perf_counter() - s
    s = time.perf_counter()
    m = packed.build(spec, dev, torch.bfloat16, state)
    torch.cuda.synchronize()
    t["build_from_cpu"] = time.perf_counter() - s
    del m
    s = time.perf_counter()
    on_gpu = {k: v.to(dev) for k, v in state.items()}
    torch.cuda.synchronize()
    t["to_gpu"] = time.perf_counter() - s
    s = time.perf_counter()
    m = packed.build(spec, dev, torch.bfloat16, on_gpu)
    torch.cuda.synchronize()
    t["build_on_gpu"] = time.perf_counter() - s
    t["torch_threads"] = torch.get_num_threads()
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in t.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--counts", default="1,2,4")
    ap.add_argument("--threads", default="default,16")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.model)))
        return
    results = []
    for threads in args.threads.split(","):
        for n in map(int, args.counts.split(",")):
            procs = []
            for i in range(n):
                env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(i))
                if threads != "default":
                    env["OMP_NUM_THREADS"] = threads
                procs.append(subprocess.Popen([sys.executable, __file__, "--child", "--model", args.model],
                                              stdout=subprocess.PIPE, env=env, text=True))
            runs = [json.loads(p.communicate()[0]) for p in procs]
            results.append({"workers": n, "threads": threads, "runs": runs})
            print(json.dumps(results[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
