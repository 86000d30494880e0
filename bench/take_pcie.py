"""How fast the take kernel (train/take_kernel.py) reads a step's rows, from device memory and from
pinned host memory across PCIe, by program shape; beside the copy engine's rate for the same bytes.

    python3 bench/take_pcie.py [--rows 4000000] [--dim 384] [--batch 4096] [--out FILE.json]

Random rows (the order's) and rows in runs of 256 (a block's), bf16 storage and output. CUDA only."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _rate(fn, nbytes: int, reps: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return round(nbytes * reps / (time.perf_counter() - t0) / 1e9, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--out")
    a = ap.parse_args()
    from embedfleet.train.take_kernel import take_rows

    dev = torch.device("cuda")
    host = torch.empty((a.rows, a.dim), dtype=torch.bfloat16).pin_memory()
    host.view(torch.int16).random_(-1000, 1000)
    table = {"pinned": host, "device": host.to(dev)}
    g = torch.Generator().manual_seed(0)
    orders = {"random": torch.randperm(a.rows, generator=g),
              "runs_of_256": (torch.randperm(a.rows // 256, generator=g)[:, None] * 256 + torch.arange(256)).flatten()}
    x = torch.empty((a.batch, a.dim), dtype=torch.bfloat16, device=dev)
    y = torch.empty(a.batch, dtype=torch.int64, device=dev)
    labels = torch.zeros(a.rows, dtype=torch.int64, device=dev)
    step_no, base = torch.zeros(1, dtype=torch.int64, device=dev), torch.zeros(1, dtype=torch.int64, device=dev)
    nbytes = a.batch * a.dim * 2
    out = {"gpu": torch.cuda.get_device_name(), "rows": a.rows, "dim": a.dim, "batch": a.batch, "batch_bytes": nbytes}
    staging = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    out["copy_engine_gb_s"] = _rate(lambda: dst.copy_(staging, non_blocking=True), nbytes)
    results = []
    for where, src in table.items():
        for name, order in orders.items():
            rows = order.to(dev)
            for elements in (512, 1024, 2048, 4096, 8192, 16384):
                for warps in (1, 2, 4, 8):
                    at = [0]

                    def run():  # a new stretch of the order each time: no caching of the rows read
                        take_rows(src, rows, rows, labels, x, y, step_no, base, at[0], 0, 0, a.batch,
                                  elements=elements, warps=warps)
                        at[0] = (at[0] + a.batch) % (a.rows - a.batch)

                    r = {"src": where, "order": name, "elements": elements, "warps": warps,
                         "gb_s": _rate(run, nbytes)}
                    results.append(r)
                    print(r, file=sys.stderr)
    out["results"] = results
    best = {}
    for r in results:
        k = f"{r['src']}/{r['order']}"
        if k not in best or r["gb_s"] > best[k]["gb_s"]:
            best[k] = r
    out["best"] = best
    out["current"] = {f"{r['src']}/{r['order']}": r["gb_s"] for r in results if r["elements"] == 8192 and r["warps"] == 4}
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        open(a.out, "w").write(text)


if __name__ == "__main__":
    main()
