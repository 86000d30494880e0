"""Triton kernels for the packed forward passes (CUDA only; imported lazily).

`qk_norm_rope`: Qwen3's per-head RMSNorm of q and k and the rotary embedding, in one pass over the
fused QKV matmul's output. torch.compile split it into a reduction and a second element-wise
pass, which read the q/k heads twice and took a good share of the Qwen3 forward's GPU time
(docs/decisions/qk-norm-rope-kernel.md); one program per token reads each head once,
normalises and rotates it in registers and writes it once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _qk_norm_rope_kernel(qkv, w, cos, sin, pos, out, qkv_stride, eps,
                         HEADS: tl.constexpr, HEADS_P2: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0)
    h = tl.arange(0, HEADS_P2)[:, None]  # q heads then k heads
    j = tl.arange(0, HALF)[None, :]
    keep = h < HEADS
    src = qkv + t.to(tl.int64) * qkv_stride + h * (2 * HALF) + j
    x1 = tl.load(src, mask=keep, other=0.0).to(tl.float32)  # first half of each head
    x2 = tl.load(src + HALF, mask=keep, other=0.0).to(tl.float32)
    if NORM:  # as transformers' Qwen3RMSNorm: normalise in float32, round, then scale
        r = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w + h * (2 * HALF) + j, mask=keep, other=0.0).to(tl.float32)
        w2 = tl.load(w + h * (2 * HALF) + HALF + j, mask=keep, other=0.0).to(tl.float32)
        x1 = (x1 * r).to(out.dtype.element_ty).to(tl.float32) * w1
        x2 = (x2 * r).to(out.dtype.element_ty).to(tl.float32) * w2
    p = tl.load(pos + t).to(tl.int64)
    c = tl.load(cos + p * HALF + j).to(tl.float32)
    s = tl.load(sin + p * HALF + j).to(tl.float32)
    dst = out + t.to(tl.int64) * (HEADS * 2 * HALF) + h * (2 * HALF) + j
    tl.store(dst, (x1 * c - x2 * s).to(out.dtype.element_ty), mask=keep)
    tl.store(dst + HALF, (x2 * c + x1 * s).to(out.dtype.element_ty), mask=keep)


def qk_norm_rope(qkv: torch.Tensor, heads: int, w: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 pos: torch.Tensor, eps: float) -> torch.Tensor:
    """qkv [T, heads + 2*kv, D] (rows may be strided, heads contiguous) -> normed, rotated q and k
    heads [T, heads, D] (`heads` = q + k heads); w [heads, D] or None; cos/sin tables [max_len, ., D/2]
    indexed by `pos` [T]."""
    n, _, d = qkv.shape
    out = torch.empty(n, heads, d, dtype=qkv.dtype, device=qkv.device)
    if n:
        _qk_norm_rope_kernel[(n,)](
            qkv, w if w is not None else qkv, cos, sin, pos, out, qkv.stride(0), eps,
            HEADS=heads, HEADS_P2=triton.next_power_of_2(heads), HALF=d // 2, NORM=w is not None, num_warps=4)
    return out
