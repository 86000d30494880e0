"""Where the encoder's GPU time goes, and what a few variants change — one process, one GPU.

    python bench/profile_encoder.py [--shape qwen3-0.6b] [--n 20000] [--variants default,tokens_128k]

For each variant: texts/s and MFU end to end (tokenisation included, as `embedfleet bench`), then
the forward passes alone on pre-tokenized input; for the first variant also a torch.profiler table
of GPU time by kernel family (matmul, attention, fused element-wise, copies) and the top kernels.

Variants (each patches one thing in this process only):
  default       the encoder as shipped
  tokens_128k   twice the default token-budget ceiling (bigger matmuls per batch)
  autotune      torch.compile mode="max-autotune-no-cudagraphs" (Triton GEMMs with fused epilogues)
  manual_qk     Qwen3's q/k norm written out in float32 instead of F.rms_norm
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

FAMILIES = [("attention", ("flash", "fmha", "attn")), ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "sm90")),
            ("fused element-wise", ("triton",)), ("copies", ("memcpy", "memset", "copy"))]


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def apply(variant: str):
    """Patch this process for `variant`; returns the function that undoes it."""
    from embedfleet.encode import budget

    if variant == "tokens_128k":
        budget.MAX_BATCH_TOKENS = 131072
        return lambda: setattr(budget, "MAX_BATCH_TOKENS", 65536)
    if variant == "autotune":
        real = torch.compile
        torch.compile = lambda fn, **kw: real(fn, mode="max-autotune-no-cudagraphs", **kw)
        return lambda: setattr(torch, "compile", real)
    if variant == "manual_qk":
        from embedfleet.encode.packed import qwen3

        real_pre = qwen3._pre_attention
        qwen3._pre_attention = _pre_manual_qk
        return lambda: setattr(qwen3, "_pre_attention", real_pre)
    if variant != "default":
        raise SystemExit(f"unknown variant {variant}")
    return lambda: None


def _pre_manual_qk(x, in_w, qkv_w, qkv_b, qkn_w, cos, sin, heads: int, kv_heads: int, eps: float):
    """The q/k norm written out in float32 (as transformers' Qwen3RMSNorm), with RoPE on the same values."""
    import torch.nn.functional as F

    from embedfleet.encode.packed.qwen3 import rope

    n, hd = x.shape[0], cos.shape[-1] * 2
    y = F.rms_norm(x, (x.shape[1],), in_w, eps)
    qkv = F.linear(y, qkv_w, qkv_b).view(n, heads + 2 * kv_heads, hd)
    qk = qkv[:, : heads + kv_heads].float()
    if qkn_w is not None:
        qk = (qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * qkn_w
    qk = rope(qk, cos, sin).to(x.dtype)
    return qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]


def profile(enc, tok) -> dict:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        enc.embed(tok)
    by_family, by_kernel = defaultdict(float), defaultdict(float)
    for e in prof.events():  # device-side events only: kernels, copies, memsets
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us = e.time_range.elapsed_us()
            by_family[family(e.name)] += us
            by_kernel[e.name[:90]] += us
    total = sum(by_family.values())
    return {"gpu_ms": round(total / 1e3, 1),
            "families": {k: [round(v / 1e3, 1), round(v / total, 3)] for k, v in sorted(by_family.items(), key=lambda x: -x[1])},
            "top": [[k, round(v / 1e3, 2)] for k, v in sorted(by_kernel.items(), key=lambda x: -x[1])[:15]]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--variants", default="default,tokens_128k")
    ap.add_argument("--profile-texts", type=int, default=8000)
    ap.add_argument("--out", default=None, help="write every run as JSON here")
    ap.add_argument("--profile-all", action="store_true", help="profile every variant, not only the first")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    a = ap.parse_args()
    from embedfleet.encode.bench import matmul_peak_tflops
    from embedfleet.encode.encoder import Encoder
    from embedfleet.encode.shapes import build_random_model
    from embedfleet.synth import review_texts

    dev = torch.device(a.device)
    peak = matmul_peak_tflops(dev) or float("nan")
    texts = review_texts(a.n, 0)
    out = {"gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__, "peak_tflops": peak, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_random_model(a.shape, Path(tmp) / a.shape, seed=0)
        for i, variant in enumerate(a.variants.split(",")):
            undo = apply(variant)
            t0 = time.perf_counter()
            enc = Encoder(str(path), device=a.device)
            enc.encode(texts[:4096])
            setup = time.perf_counter() - t0
            tok = enc.tokenize(texts)
            lengths = tok.lengths.astype(np.float64)
            flops = enc.model.flops_per_token(float((lengths**2).sum() / lengths.sum())) * tok.num_tokens
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            enc.encode(texts)
            e2e = time.perf_counter() - t0
            t0 = time.perf_counter()
            enc.embed(tok)
            fwd = time.perf_counter() - t0
            run = {"variant": variant, "batch_tokens": enc.budget.tokens, "setup_s": round(setup, 1),
                   "texts_s": round(a.n / e2e), "mfu_end_to_end": round(flops / e2e / 1e12 / peak, 4),
                   "mfu_forward_only": round(flops / fwd / 1e12 / peak, 4), "tokens_per_text": float(lengths.mean())}
            if a.profile_all or i == 0:
                run["profile"] = profile(enc, enc.tokenize(texts[: a.profile_texts]))
            print(json.dumps(run), flush=True)
            out["runs"].append(run)
            enc.close()
            del enc
            undo()
            torch._dynamo.reset()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
