"""Throughput of this Encoder against sentence-transformers, on the same texts, in one process.

Both sides are timed end to end from a list of strings to normalised vectors on the host
(tokenisation included). MFU counts the matmul and attention FLOPs of real tokens only, against
the bf16 matmul peak measured on the same GPU.
"""

from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from embedfleet.encode.encoder import Encoder, _device
from embedfleet.encode.shapes import SHAPES, build_random_model
from embedfleet.synth import review_texts


def matmul_peak_tflops(device: torch.device, size: int = 8192, iters: int = 10) -> float | None:
    """bf16 dense matmul rate of this GPU, TFLOP/s (CUDA events, after warm-up)."""
    if device.type != "cuda":
        return None
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    end.synchronize()
    return 2 * size**3 * iters / (start.elapsed_time(end) / 1e3) / 1e12


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bench_one(label: str, path: Path, texts: list[str], device: torch.device, st: bool, st_batch: int,
               batch_tokens, peak: float | None) -> dict:
    enc = Encoder(str(path), device=str(device), batch_tokens=batch_tokens)
    enc.encode(texts[: min(len(texts), 4096)])  # warm-up: kernels, allocator, tokenizer pool
    tok = enc.tokenize(texts)
    lengths = tok.lengths.astype(np.float64)
    t0 = time.perf_counter()
    enc.tokenize(texts)
    t_tok = time.perf_counter() - t0
    _sync(device)
    t0 = time.perf_counter()
    ours = enc.encode(texts)
    t_ours = time.perf_counter() - t0
    eff_len = float((lengths**2).sum() / lengths.sum())  # attention cost per token grows with length
    flops = enc.model.flops_per_token(eff_len) * tok.num_tokens
    row = {"label": label, **enc.describe(), "n": len(texts), "tokens": tok.num_tokens,
           "mean_tokens": float(lengths.mean()), "tokenize_texts_s": len(texts) / t_tok,
           "seconds": t_ours, "texts_s": len(texts) / t_ours, "tokens_s": tok.num_tokens / t_ours,
           "tflops": flops / t_ours / 1e12, "mfu": flops / t_ours / 1e12 / peak if peak else None}
    enc.close()
    del enc
    if st:
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(str(path), device=str(device))
        if device.type == "cuda":
            model.to(torch.bfloat16)  # its best setting on a GPU
        model.encode(texts[:1024], batch_size=st_batch)
        _sync(device)
        t0 = time.perf_counter()
        ref = model.encode(texts, batch_size=st_batch, normalize_embeddings=True, convert_to_numpy=True)
        t_st = time.perf_counter() - t0
        ref = ref.astype(np.float32)
        ref /= np.linalg.norm(ref, axis=1, keepdims=True)
        cos = (ours * ref[:, : ours.shape[1]]).sum(1)
        row.update(st_seconds=t_st, st_texts_s=len(texts) / t_st, speedup=t_st / t_ours,
                   cosine_min=float(cos.min()), cosine_mean=float(cos.mean()))
        del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def run_bench(shapes: list[str] | None = None, model: str | None = None, n: int = 20000, device="auto",
              st: bool = True, st_batch: int = 256, batch_tokens="auto", seed: int = 0,
              texts: list[str] | None = None) -> dict:
    """`texts` replaces the generated review-length texts (e.g. an ingest corpus's own contents)."""
    dev = _device(device)
    texts = review_texts(n, seed) if texts is None else list(texts)
    n = len(texts)
    peak = matmul_peak_tflops(dev)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    rows = []
    with tempfile.TemporaryDirectory(prefix="embedfleet-bench-") as tmp:
        targets = [(Path(model).name, Path(model))] if model else []
        for shape in shapes or ([] if model else list(SHAPES)):
            targets.append((shape, build_random_model(shape, Path(tmp) / shape, seed=seed)))
        for label, path in targets:
            rows.append(_bench_one(label, path, texts, dev, st, st_batch, batch_tokens, peak))
    return {"device": str(dev), "gpu": gpu, "torch": torch.__version__, "peak_bf16_tflops": peak, "n": n,
            "seed": seed, "st_batch": st_batch, "results": rows}


def format_bench(result: dict) -> str:
    cols = [("model", "label", "{}"), ("path", "path", "{}"), ("texts/s", "texts_s", "{:,.0f}"),
            ("tokens/s", "tokens_s", "{:,.0f}"), ("TFLOP/s", "tflops", "{:.1f}"), ("MFU", "mfu", "{:.1%}"),
            ("ST texts/s", "st_texts_s", "{:,.0f}"), ("speedup", "speedup", "{:.2f}x"),
            ("cos min", "cosine_min", "{:.5f}"), ("tok texts/s", "tokenize_texts_s", "{:,.0f}")]
    head = (f"{result['gpu']} ({result['device']}), torch {result['torch']}, n={result['n']}, "
            f"bf16 matmul peak {result['peak_bf16_tflops'] or 0:.0f} TFLOP/s")
    rows = [[(fmt.format(r[key]) if r.get(key) is not None else "-") for _, key, fmt in cols]
            for r in result["results"]]
    widths = [max(len(c[0]), *(len(r[i]) for r in rows)) if rows else len(c[0]) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([head, line([c[0] for c in cols]), *map(line, rows)])
