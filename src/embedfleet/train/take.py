"""A training step's rows, taken from the storage by the epoch's order: one kernel on CUDA.

    take(src, rows, pos, labels, x_out, y_out, step_no, base, first, stride, ahead=0, count=None)

writes x_out[i] = src[rows[at + i]] and y_out[i] = labels[pos[at + i]] for i < count, where
at = first + (step_no - base + ahead) * stride is computed on the device (step_no and base are
one-element int64 tensors there), so a replayed CUDA graph finds its next step's rows by itself.
Positions at or past len(rows) are not read (the step after an epoch's last, taken ahead).

Why a kernel: in torch ops the same work was six small kernels (the offset, two index gathers into
the order, the rows', the labels', the offset's increment), half of a linear head's step and the
gpu tier's whole distance from pure compute (docs/decisions/train-tiers-and-take.md). The
kernel also casts the rows to x_out's dtype (bf16: what autocast would cast a Linear's input to).

`src` may be pinned host memory (the ram tier): the kernel then reads its rows across PCIe itself
(CUDA's unified addressing), with no host thread gathering and no staging copy.
"""

from __future__ import annotations

import torch

__all__ = ["take", "kernel_available"]


def kernel_available(device: torch.device, triton: bool = True) -> bool:
    """Whether `take` runs as one Triton kernel on `device` (else the torch ops, device storage only);
    `triton`: Settings.triton."""
    if device.type != "cuda" or not triton:
        return False
    try:
        import embedfleet.train.take_kernel  # noqa: F401 - triton ships with CUDA builds of torch
    except ImportError:
        return False
    return True


def take(src: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, labels: torch.Tensor, x_out: torch.Tensor,
         y_out: torch.Tensor, step_no: torch.Tensor, base: torch.Tensor, first: int, stride: int, ahead: int = 0,
         count: int | None = None, kernel: bool = False) -> None:
    """See the module's docstring. `kernel`: the Triton kernel (CUDA; `src` on the device or pinned on
    the host) rather than torch ops (`src` where `rows` is)."""
    count = x_out.shape[0] if count is None else count
    if count == 0:
        return
    if kernel:
        from embedfleet.train.take_kernel import take_rows

        take_rows(src, rows, pos, labels, x_out, y_out, step_no, base, first, stride, ahead, count)
        return
    at = (step_no - base + ahead) * stride + first
    i = (at + torch.arange(count, device=rows.device)).clamp_max(len(rows) - 1)
    x_out[:count].copy_(src.index_select(0, rows.index_select(0, i)))
    y_out[:count].copy_(labels.index_select(0, pos.index_select(0, i)))
