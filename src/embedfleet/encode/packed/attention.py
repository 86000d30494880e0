"""Variable-length attention over packed sequences.

On CUDA in half precision, FlashAttention's varlen kernel reads the packed [T, heads, dim]
tensors directly: no padding, GQA without repeating K/V. Elsewhere (CPU, float32, a torch without
that kernel) a reference path scatters into a padded [N, L] layout and runs SDPA with a key mask;
batches are length-sorted, so that padding is small.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# The arguments aten::_flash_attention_forward takes before its keyword-only ones (torch 2.11, 2.13).
_FLASH_ARGS = ["query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal",
               "return_debug_mask"]


@functools.cache
def _flash_op():
    """FlashAttention's varlen forward, torch's aten op called directly — as its public wrapper
    (torch.nn.attention.varlen, torch >= 2.10) calls it, without that module's import, which pulls
    torch._dynamo in, seconds a first forward pass on a GPU host waited for (docs/decisions/no-dynamo-first-call.md).
    None where torch has no such op, or one with other arguments."""
    try:
        op = torch.ops.aten._flash_attention_forward.default
    except (AttributeError, RuntimeError):
        return None
    return op if takes_flash_args([a.name for a in op._schema.arguments]) else None


def takes_flash_args(names: list[str]) -> bool:
    """Whether an op's argument names are the ones `attention` passes (positionally, then scale=)."""
    return names[:len(_FLASH_ARGS)] == _FLASH_ARGS and "scale" in names[len(_FLASH_ARGS):]


def token_layout(lengths: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For packed sequences of `lengths` (int32, `total` tokens in all), on their device: offsets
    [0, l0, l0+l1, …], each token's sequence, and its position inside that sequence (all int32).
    Built where the tensors live, so only the lengths travel; `total` known, nothing waits on the device."""
    n, dev = len(lengths), lengths.device
    cu = torch.zeros(n + 1, dtype=torch.int32, device=dev)
    torch.cumsum(lengths, 0, dtype=torch.int32, out=cu[1:])
    seg = torch.repeat_interleave(torch.arange(n, dtype=torch.int32, device=dev), lengths, output_size=total)
    pos = torch.arange(total, dtype=torch.int32, device=dev) - cu.index_select(0, seg)
    return cu, seg, pos


@dataclass
class Packing:
    """Where each packed token sits: what every layer of one batch needs, built once per batch."""

    cu: torch.Tensor  # int32 [N+1] offsets
    max_len: int
    seg: torch.Tensor  # int32 [T] sequence of each token
    pos: torch.Tensor  # int32 [T] position inside its sequence
    lengths: torch.Tensor  # int32 [N]

    @property
    def use_flash(self) -> bool:
        return self.cu.is_cuda and _flash_op() is not None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pk: Packing, causal: bool,
              scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]. Fewer K/V heads than Q heads (GQA) go to the
    kernel as they are. `window`: each token sees only the tokens at most that many positions away (a
    sliding-window layer)."""
    if q.dtype in (torch.float16, torch.bfloat16) and pk.use_flash:
        # dropout 0, no debug mask; causal: each token sees its sequence up to itself
        if window is None:
            return _flash_op()(q, k, v, pk.cu, pk.cu, pk.max_len, pk.max_len, 0.0, causal, False, scale=scale)[0]
        return _flash_op()(q, k, v, pk.cu, pk.cu, pk.max_len, pk.max_len, 0.0, causal, False, scale=scale,
                           window_size_left=window, window_size_right=0 if causal else window)[0]
    return _padded_sdpa(q, k, v, pk, causal, scale, window)


def _padded_sdpa(q, k, v, pk: Packing, causal: bool, scale: float | None, window: int | None = None) -> torch.Tensor:
    n, length = pk.lengths.shape[0], pk.max_len
    seg, pos = pk.seg.long(), pk.pos.long()

    def pad(x):
        out = x.new_zeros(n, length, x.shape[1], x.shape[2])
        out[seg, pos] = x
        return out.transpose(1, 2)  # [N, H, L, D]

    keep = torch.arange(length, device=q.device)[None, :] < pk.lengths[:, None]  # [N, L]
    mask = keep[:, None, None, :]
    if causal:
        mask = mask & torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    if window is not None:
        at = torch.arange(length, device=q.device)
        mask = mask & ((at[:, None] - at[None, :]).abs() <= window)
    out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=mask, scale=scale,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)[seg, pos]
