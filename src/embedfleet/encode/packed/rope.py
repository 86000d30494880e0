"""Rotary position embeddings for the packed families: the tables, the torch rotation, and the Triton kernel
that rotates (and per-head normalises) q and k in one pass on CUDA.

Eager, the torch rotation is a dozen element-wise kernels a layer over strided views of the QKV output: most
of a first call's device time on the RoPE families before the forward pass is compiled. The kernel reads
each q/k head once and writes it once, compiled or not.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE as in transformers; x [T, H, D], cos/sin [T, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_table(theta: float, head_dim: int, max_len: int, to) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [max_len, 1, head_dim/2] of RoPE with base `theta`, each passed through `to`."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)[:, None, :]
    return to(ang.cos()), to(ang.sin())


def layer_rope_tables(conf, head_dim: int, max_len: int, to) -> dict | None:
    """RoPE tables per layer type of a config with `layer_types` and `rope_parameters` (ModernBERT, Gemma3), or
    None where a type's RoPE is a scaled variant (the generic path serves those)."""
    params = conf.rope_parameters or {}
    kinds = set(conf.layer_types)
    if any((params.get(k) or {}).get("rope_type", "default") != "default" for k in kinds):
        return None
    return {k: rope_table(float(params[k]["rope_theta"]), head_dim, max_len, to) for k in kinds}


def qk_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qk_heads: int) -> torch.Tensor:
    """The q and k heads of qkv [T, heads, D] rotated together: [T, qk_heads, D]. The torch path of the kernel
    below without a norm (compiled on CUDA when the kernel is off)."""
    return rope(qkv[:, :qk_heads], cos, sin)


def triton_qk_norm_rope(device: torch.device, dtype: torch.dtype, head_dim: int, enabled: bool = True):
    """The Triton q/k (norm +) RoPE kernel where it applies (CUDA, half precision, a power-of-two half head,
    Settings.triton on), else None: then the torch path does the same."""
    half = head_dim // 2
    if not enabled or device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or half & (half - 1):
        return None
    try:
        from embedfleet.encode.packed.kernels import qk_norm_rope
    except ImportError:
        return None
    return qk_norm_rope


def prefetch_triton() -> None:
    """Triton's once-a-process start-up (its import, the hash of its own files that keys its cache, its CUDA
    helper module), run on a thread while the constructor waits on CUDA and reads the weights: otherwise it
    lands on the first forward pass. Best effort: what fails here fails again, and is handled, at first use."""
    try:
        from embedfleet.encode.packed import kernels  # noqa: F401 - imports triton
        from triton.compiler.compiler import triton_key
        from triton.runtime import driver

        triton_key()
        driver.active.utils  # noqa: B018 - builds or loads the helper module
    except Exception:  # noqa: BLE001
        pass


class KernelFallback:
    """A packed model whose `_forward` may run a Triton kernel (`self._kernel`). A kernel that cannot build
    here is turned off, with a warning, and the batch runs again on the torch path."""

    _kernel = None

    def __call__(self, ids: torch.Tensor, pk) -> torch.Tensor:
        try:
            return self._forward(ids, pk)
        except torch.OutOfMemoryError:
            raise  # the encoder halves its token budget and retries
        except Exception as err:  # noqa: BLE001 - a Triton that cannot build here: the torch path from now on
            if self._kernel is None:
                raise
            log.warning("Triton q/k RoPE kernel failed (%s); using the torch path", str(err).splitlines()[0])
            self._kernel = None
            return self._forward(ids, pk)

    def _forward(self, ids: torch.Tensor, pk) -> torch.Tensor:
        raise NotImplementedError


