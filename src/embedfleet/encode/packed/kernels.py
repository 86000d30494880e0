"""Triton kernels for the packed forward passes (CUDA only; imported lazily).

`qk_norm_rope`: the per-head RMSNorm of q and k (Qwen3, Gemma3; none for ModernBERT) and the rotary
embedding, in one pass over the fused QKV matmul's output. torch.compile split it into a reduction and a
second element-wise pass, which read the q/k heads twice and took a good share of the Qwen3 forward's GPU
time (docs/decisions/qk-norm-rope-kernel.md); one program per token reads each head once, normalises and
rotates it in registers and writes it once.

`add_norm` (a residual add and the next norm) and `gated_act` (GeGLU/SwiGLU): the rest of ModernBERT's and
Gemma3's glue between matmuls. Eager, torch ran it as a dozen element-wise kernels a layer, slower than the
matmuls; torch.compile fuses it only after seconds of tracing, so a first call never had it
(docs/decisions/glue-kernels.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["pos"])  # a batch's slice, aligned or not: one variant
def _qk_norm_rope_kernel(qkv, w, cos, sin, pos, out, qkv_stride, eps,
                         HEADS: tl.constexpr, HEADS_P2: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr,
                         ROUND: tl.constexpr):
    t = tl.program_id(0)
    h = tl.arange(0, HEADS_P2)[:, None]  # q heads then k heads
    j = tl.arange(0, HALF)[None, :]
    keep = h < HEADS
    src = qkv + t.to(tl.int64) * qkv_stride + h * (2 * HALF) + j
    x1 = tl.load(src, mask=keep, other=0.0).to(tl.float32)  # first half of each head
    x2 = tl.load(src + HALF, mask=keep, other=0.0).to(tl.float32)
    if NORM:  # normalise in float32, then scale: Qwen3RMSNorm rounds before the scale (ROUND), Gemma3's after
        r = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w + h * (2 * HALF) + j, mask=keep, other=0.0).to(tl.float32)
        w2 = tl.load(w + h * (2 * HALF) + HALF + j, mask=keep, other=0.0).to(tl.float32)
        x1, x2 = x1 * r, x2 * r
        if ROUND:
            x1, x2 = x1.to(out.dtype.element_ty).to(tl.float32), x2.to(out.dtype.element_ty).to(tl.float32)
        x1, x2 = x1 * w1, x2 * w2
    p = tl.load(pos + t).to(tl.int64)
    c = tl.load(cos + p * HALF + j).to(tl.float32)
    s = tl.load(sin + p * HALF + j).to(tl.float32)
    dst = out + t.to(tl.int64) * (HEADS * 2 * HALF) + h * (2 * HALF) + j
    tl.store(dst, (x1 * c - x2 * s).to(out.dtype.element_ty), mask=keep)
    tl.store(dst + HALF, (x2 * c + x1 * s).to(out.dtype.element_ty), mask=keep)


def qk_norm_rope(qkv: torch.Tensor, heads: int, w: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 pos: torch.Tensor, eps: float, round_norm: bool = True) -> torch.Tensor:
    """qkv [T, heads + 2*kv, D] (rows may be strided, heads contiguous) -> normed, rotated q and k
    heads [T, heads, D] (`heads` = q + k heads); w [heads, D] or None; cos/sin tables [max_len, ., D/2]
    indexed by `pos` [T]. `round_norm`: the normalised value rounded to the model's dtype before the scale."""
    n, _, d = qkv.shape
    out = torch.empty(n, heads, d, dtype=qkv.dtype, device=qkv.device)
    if n:
        _qk_norm_rope_kernel[(n,)](
            qkv, w if w is not None else qkv, cos, sin, pos, out, qkv.stride(0), eps,
            HEADS=heads, HEADS_P2=triton.next_power_of_2(heads), HALF=d // 2, NORM=w is not None, ROUND=round_norm,
            num_warps=4)
    return out


@triton.jit
def _add_norm_kernel(x, y, post_w, w, b, x_out, n_out, eps, N: tl.constexpr, BLOCK: tl.constexpr,
                     ADD: tl.constexpr, POST: tl.constexpr, RMS: tl.constexpr, BIAS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * N
    col = tl.arange(0, BLOCK)
    keep = col < N
    dt = n_out.dtype.element_ty
    v = tl.load(x + row + col, mask=keep, other=0.0).to(tl.float32)
    if ADD:
        u = tl.load(y + row + col, mask=keep, other=0.0).to(tl.float32)
        if POST:  # Gemma3: the branch's own RMSNorm (times its scale, then rounded) before the add
            r = tl.rsqrt(tl.sum(u * u, axis=0) / N + eps)
            u = (u * r * tl.load(post_w + col, mask=keep, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
        v = (v + u).to(dt).to(tl.float32)  # the residual stream, rounded as torch's add rounds it
        tl.store(x_out + row + col, v.to(dt), mask=keep)
    if RMS:
        out = v * tl.rsqrt(tl.sum(v * v, axis=0) / N + eps)
    else:
        d = tl.where(keep, v - tl.sum(v, axis=0) / N, 0.0)
        out = d * tl.rsqrt(tl.sum(d * d, axis=0) / N + eps)
    out = out * tl.load(w + col, mask=keep, other=0.0).to(tl.float32)
    if BIAS:
        out = out + tl.load(b + col, mask=keep, other=0.0).to(tl.float32)
    tl.store(n_out + row + col, out.to(dt), mask=keep)


def add_norm(x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor, b: torch.Tensor | None, eps: float,
             rms: bool, post_w: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y, norm(x + y)) for x, y [T, N] contiguous: LayerNorm (with bias `b` if given) or, `rms`, RMSNorm, times
    `w`, computed in float32 and rounded once. `post_w`: y is first RMS-normed and scaled by it (Gemma3's
    post-norms). `y` None: (x, norm(x))."""
    n, width = x.shape
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if y is not None else x
    if n:
        _add_norm_kernel[(n,)](x, y if y is not None else x, post_w if post_w is not None else w, w,
                               b if b is not None else w, summed, out, eps, N=width,
                               BLOCK=triton.next_power_of_2(width), ADD=y is not None, POST=post_w is not None,
                               RMS=rms, BIAS=b is not None, num_warps=4 if width <= 2048 else 8)
    return summed, out


ACTIVATIONS = {"gelu": 0, "gelu_tanh": 1, "silu": 2, "relu": 3}


@triton.jit
def _gated_act_kernel(h, out, total, I: tl.constexpr, BLOCK: tl.constexpr, ACT: tl.constexpr):
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # over the output's T * I values
    keep = at < total
    src = h + (at // I) * (2 * I) + at % I
    dt = out.dtype.element_ty
    a = tl.load(src, mask=keep, other=0.0).to(tl.float32)
    g = tl.load(src + I, mask=keep, other=0.0).to(tl.float32)
    if ACT == 0:
        a = 0.5 * a * (1.0 + tl.erf(a * 0.7071067811865476))
    elif ACT == 1:  # 0.5·a·(1 + tanh(z)) = a·sigmoid(2z)
        a = a * tl.sigmoid(1.5957691216057308 * (a + 0.044715 * a * a * a))
    elif ACT == 2:
        a = a * tl.sigmoid(a)
    else:
        a = tl.maximum(a, 0.0)
    tl.store(out + at, (a.to(dt).to(tl.float32) * g).to(dt), mask=keep)


def gated_act(h: torch.Tensor, act: str) -> torch.Tensor:
    """act(first half) * second half of h [T, 2I] (contiguous), each rounded as torch rounds them: GeGLU, SwiGLU."""
    n, width = h.shape
    half = width // 2
    out = torch.empty(n, half, dtype=h.dtype, device=h.device)
    if n:
        _gated_act_kernel[(triton.cdiv(n * half, 1024),)](h, out, n * half, I=half, BLOCK=1024, ACT=ACTIVATIONS[act],
                                                          num_warps=4)
    return out
