"""How fast the take kernel (train/take_kernel.py) reads a step's rows from pinned host memory across
PCIe (the ram tier) and from device memory (the gpu tier), by program shape: alone, and beside a
stand-in for a step's compute on another stream (as TrainLoop runs it, one step ahead). Each figure
is a CUDA graph of --reps takes replayed (no launch costs); the copy engine's rate for the same bytes
beside it.

    python3 bench/take_pcie.py [--rows 4000000] [--dim 384] [--batch 4096] [--out FILE.json]

Shapes: (elements a tile, warps, programs; None: a program a tile). Random rows (the order's). CUDA only."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import harness

SHAPES = [(8192, 4, None), (1024, 1, None), (2048, 2, None), (8192, 4, 16), (8192, 4, 32), (8192, 4, 64),
          (8192, 8, 32), (16384, 8, 16), (16384, 8, 32), (4096, 4, 32), (4096, 4, 64), (2048, 2, 64)]


def _graph_us(body, reps: int, replays: int = 20) -> float:
    """Microseconds per rep of `body(i)` for i < reps, captured as one graph and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (Triton's compile, cuBLAS's workspace) off the capture
        for i in range(2):
            body(i)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            body(i)
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        g.replay()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t0) / replays / reps * 1e6, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out")
    a = ap.parse_args()
    from embedfleet.train.take_kernel import take_rows

    dev = torch.device("cuda")
    host = torch.empty((a.rows, a.dim), dtype=torch.bfloat16).pin_memory()
    host.view(torch.int16).random_(-1000, 1000)
    table = {"pinned": host, "device": host.to(dev)}
    rows = torch.randperm(a.rows, generator=torch.Generator().manual_seed(0)).to(dev)
    x = torch.empty((a.batch, a.dim), dtype=torch.bfloat16, device=dev)
    y = torch.empty(a.batch, dtype=torch.int64, device=dev)
    labels = torch.zeros(a.rows, dtype=torch.int64, device=dev)
    step_no, base = torch.zeros(1, dtype=torch.int64, device=dev), torch.zeros(1, dtype=torch.int64, device=dev)
    nbytes = a.batch * a.dim * 2
    # a stand-in for a linear head's step: two dozen small bf16 kernels on a batch, ~70 µs on an H100
    h = torch.randn(a.batch, a.dim, device=dev, dtype=torch.bfloat16)
    w = torch.randn(a.dim, a.dim, device=dev, dtype=torch.bfloat16) / a.dim ** 0.5

    def compute(_):
        z = h
        for _ in range(8):
            z = torch.nn.functional.gelu(z @ w) + h
        return z

    out = harness.stamp({"gpu": torch.cuda.get_device_name(), "rows": a.rows, "dim": a.dim, "batch": a.batch, "batch_bytes": nbytes})
    staging = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    out["copy_engine_us"] = _graph_us(lambda i: dst.copy_(staging, non_blocking=True), a.reps)
    out["copy_engine_gb_s"] = round(nbytes / out["copy_engine_us"] / 1e3, 2)
    out["compute_us"] = _graph_us(compute, a.reps)
    span = a.rows // a.batch - 1
    results = []
    for where, src in table.items():
        for shape in SHAPES:
            def take(i, shape=shape, src=src):
                take_rows(src, rows, rows, labels, x, y, step_no, base, (i % span) * a.batch, 0, 0, a.batch,
                          shape=shape)

            def both(i, take=take):
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    take(i)
                compute(i)
                main.wait_stream(side)

            side = torch.cuda.Stream()
            alone = _graph_us(take, a.reps)
            together = _graph_us(both, a.reps)
            r = {"src": where, "shape": list(shape), "take_us": alone, "gb_s": round(nbytes / alone / 1e3, 2),
                 "with_compute_us": together, "over_compute": round(together / out["compute_us"], 3)}
            results.append(r)
            print(r, file=sys.stderr)
    out["results"] = results
    out["best_beside_compute"] = {w: min((r for r in results if r["src"] == w), key=lambda r: r["with_compute_us"])
                                  for w in table}
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        open(a.out, "w").write(text)


if __name__ == "__main__":
    main()
