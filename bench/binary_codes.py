"""Which binary code of a model's vectors keeps the exact top 10 among its nearest candidates by Hamming distance:
the bound the binary index's graph can only approach (no PostgreSQL, no graph; exact rankings on one device).

    python bench/binary_codes.py --model DIR [--n 1000000] [--queries 200] [--texts reviews,world]
                                 [--candidates 100,200,400] [--device cuda] [--out FILE]

--n texts of each set are embedded by the model, and --queries texts of another seed. For each code, each query's
nearest --candidates rows by Hamming distance are compared with its exact top 10 by cosine: recall@10 after a
rescore by the full vectors is the share of the exact top 10 among them. Codes: the sign (`binary_quantize`),
the sign of the centred vector, a random rotation of it, SimHash of 3 × D random planes, and T thresholds a
dimension at its quantiles (`pg.binary_code`, thermometer coded) for T = 1, 2, 3 and 7. One JSON document on
stdout and --out.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

import harness


def say(*parts) -> None:
    print("[binary_codes]", *parts, file=sys.stderr, flush=True)


def codes(x_sample: torch.Tensor, seed: int = 0) -> dict:
    """name → a function from vectors [N, D] to bits [N, B] (bool)."""
    from embedfleet.pg.binary_code import quantiles

    dim, dev = x_sample.shape[1], x_sample.device
    mean = x_sample.mean(0)
    gen = torch.Generator(device=dev).manual_seed(seed)
    planes = torch.randn(dim, 3 * dim, device=dev, generator=gen)
    rotation = torch.linalg.qr(torch.randn(dim, dim, device=dev, generator=gen))[0]
    sample = x_sample.cpu().numpy()

    def levels(count: int):
        t = torch.from_numpy(quantiles(sample, count)).to(dev)
        return lambda v: torch.cat([v > row for row in t], dim=1)

    return {"sign": lambda v: v > 0, "sign_centred": lambda v: v > mean,
            "rotation_centred": lambda v: (v - mean) @ rotation > 0,
            f"simhash_{3 * dim}": lambda v: (v - mean) @ planes > 0,
            **{f"levels_{t}": levels(t) for t in (1, 2, 3, 7)}}


def recall(bits_x: torch.Tensor, bits_q: torch.Tensor, truth: torch.Tensor, candidates: list[int]) -> dict:
    dtype = torch.float16 if bits_x.is_cuda else torch.float32
    sim = (bits_q.to(dtype) * 2 - 1) @ (bits_x.to(dtype) * 2 - 1).T  # bits − 2 · Hamming distance
    out = {}
    for c in candidates:
        near = sim.float().topk(c, dim=1).indices
        out[str(c)] = round(float(np.mean([len(set(truth[i].tolist()) & set(near[i].tolist())) / truth.shape[1]
                                           for i in range(len(truth))])), 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--texts", default="reviews,world")
    ap.add_argument("--candidates", default="100,200,400")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from embedfleet import Encoder
    from embedfleet.synth import review_texts, world_texts

    enc = Encoder(a.model, device=a.device)
    candidates = [int(c) for c in a.candidates.split(",")]
    doc: dict = {"n": a.n, "queries": a.queries, "candidates": candidates}
    for name in a.texts.split(","):
        make = {"reviews": review_texts, "world": world_texts}[name]
        t0 = time.perf_counter()
        x = torch.nn.functional.normalize(torch.from_numpy(enc.encode(make(a.n, seed=0))).to(a.device).float(), dim=1)
        q = torch.nn.functional.normalize(torch.from_numpy(enc.encode(make(a.queries, seed=4242))).to(a.device).float(),
                                          dim=1)
        say(name, f"embedded in {time.perf_counter() - t0:.1f} s")
        truth = (q @ x.T).topk(10, dim=1).indices
        sample = x[torch.randperm(len(x), device=x.device, generator=torch.Generator(device=x.device).manual_seed(0))
                   [:min(len(x), 10_000)]]
        rows = {}
        for code, f in codes(sample).items():
            bits_x = f(x)
            rows[code] = {"bits": bits_x.shape[1], "recall_at_10": recall(bits_x, f(q), truth, candidates)}
            say(name, code, rows[code])
            del bits_x
        doc[name] = rows
        del x
    sys.stdout.write(harness.record(doc, a.out) + "\n")


if __name__ == "__main__":
    main()
