"""Variable-length attention over packed sequences.

On CUDA in half precision, FlashAttention's varlen kernel reads the packed [T, heads, dim]
tensors directly: no padding, GQA without repeating K/V. Elsewhere (CPU, float32, an older torch)
a reference path scatters into a padded [N, L] layout and runs SDPA with a key mask; batches are
length-sorted, so that padding is small. A process's first eager calls on CUDA take that path too
while the varlen module is imported on a thread (it pulls torch._dynamo in: seconds).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Mask elements (sequences x length x length) an eager causal call may build on the padded path
# rather than wait for the varlen module: 64 MB of booleans.
PADDED_MASK_LIMIT = 1 << 26

_imported = threading.Event()  # the varlen module's import has ended (either way)
_import_lock = threading.Lock()
_import_started = False


@functools.cache
def _varlen():
    """(varlen_attn, whether it takes enable_gqa), or (None, False) before torch 2.10. Imported on
    first use on a GPU: the module imports torch._dynamo (1.5 s on the 2-core VM, ~4 s on a GPU host),
    which the CPU path (a query in `embedfleet search`) never needs."""
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None, False
    # torch 2.11 has no enable_gqa flag, but its flash kernel already takes fewer K/V heads.
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


def import_in_background() -> None:
    """Import the varlen module on a daemon thread, once a process: eager calls meanwhile take the
    padded path rather than wait for torch._dynamo's import."""
    global _import_started
    with _import_lock:
        if _import_started:
            return
        _import_started = True

    def run():
        try:
            _varlen()
        finally:
            _imported.set()

    threading.Thread(target=run, name="embedfleet-import", daemon=True).start()


def kernel_for(on_cuda: bool, compiling: bool, imported: bool, causal: bool, sequences: int, max_len: int) -> str:
    """Which attention a half-precision call takes: "flash" (the varlen kernel: in a compiled graph, or
    once its module is imported), "padded" (an eager call while the module is still being imported,
    or off CUDA) or "wait" (import it first: an eager causal call whose padded mask would be big)."""
    if not on_cuda:
        return "padded"
    if compiling or imported:
        return "flash"
    return "wait" if causal and sequences * max_len * max_len > PADDED_MASK_LIMIT else "padded"


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


def _flash(pk: Packing, causal: bool) -> bool:
    kernel = kernel_for(pk.cu.is_cuda, torch.compiler.is_compiling(), _imported.is_set(), causal,
                        pk.lengths.shape[0], pk.max_len)
    if kernel == "padded":
        if pk.cu.is_cuda:
            import_in_background()
        return False
    return _varlen()[0] is not None  # "wait": the import, if under way on its thread, is waited for


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pk: Packing, causal: bool,
              scale: float | None = None) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
    if q.dtype in (torch.float16, torch.bfloat16) and _flash(pk, causal):
        varlen_attn, gqa_flag = _varlen()
        gqa = {"enable_gqa": True} if gqa_flag and k.shape[1] != q.shape[1] else {}
        return varlen_attn(q, k, v, pk.cu, pk.cu, pk.max_len, pk.max_len, scale=scale,
                           window_size=(-1, 0) if causal else (-1, -1), **gqa)
    return _padded_sdpa(q, k, v, pk, causal, scale)


def _padded_sdpa(q, k, v, pk: Packing, causal: bool, scale: float | None) -> torch.Tensor:
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
    out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=mask, scale=scale,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)[seg, pos]
