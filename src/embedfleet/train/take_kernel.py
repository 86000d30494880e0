"""The Triton kernel behind take.take (CUDA only; imported lazily: CPU builds of torch have no triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A program's tile (elements: rows x columns, all loaded at once: many reads in flight against PCIe's
# latency), its warps, and at most how many programs loop over the tiles (None: one program a tile),
# by where the rows are. From pinned host memory the take runs beside the step's kernels (the ram
# tier, one step ahead): 32 programs leave them SMs, where a program a tile made the two take turns
# (docs/decisions/train-tiers-and-take.md).
SHAPES: dict[str, tuple[int, int, int | None]] = {"cuda": (8192, 4, None), "cpu": (8192, 4, 32)}


# values that change between calls are not specialised on: one compile, not one per step kind
@triton.jit(do_not_specialize=["first", "stride", "ahead", "count", "n"])
def _take_kernel(src, rows, pos, labels, x_out, y_out, step_no, base, first, stride, ahead, count, n, dim,
                 ROWS: tl.constexpr, COLS: tl.constexpr):
    at0 = first + (tl.load(step_no) - tl.load(base) + ahead) * stride
    c = tl.arange(0, COLS)
    for tile in range(tl.program_id(0), tl.cdiv(count, ROWS), tl.num_programs(0)):
        r = tile * ROWS + tl.arange(0, ROWS)
        at = at0 + r
        write = r < count
        read = write & (at < n)
        row = tl.load(rows + at, mask=read, other=0)
        p = tl.load(pos + at, mask=read, other=0)
        tl.store(y_out + r, tl.load(labels + p, mask=read), mask=write)
        for c0 in range(0, dim, COLS):
            cols = c0 + c
            inside = cols[None, :] < dim
            v = tl.load(src + row[:, None] * dim + cols[None, :], mask=read[:, None] & inside, other=0.0)
            tl.store(x_out + r[:, None].to(tl.int64) * dim + cols[None, :], v.to(x_out.dtype.element_ty),
                     mask=write[:, None] & inside)


def take_rows(src: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, labels: torch.Tensor, x_out: torch.Tensor,
              y_out: torch.Tensor, step_no: torch.Tensor, base: torch.Tensor, first: int, stride: int, ahead: int,
              count: int, shape: tuple[int, int, int | None] | None = None) -> None:
    """take.take's work (contiguous `src` and `x_out`); `shape`: (elements, warps, programs), default
    SHAPES' for where `src` is."""
    elements, warps, programs = shape or SHAPES[src.device.type]
    dim = src.shape[1]
    cols = min(1024, triton.next_power_of_2(dim))
    per = max(1, elements // cols)
    tiles = triton.cdiv(count, per)
    _take_kernel[(min(tiles, programs or tiles),)](src, rows, pos, labels, x_out, y_out, step_no, base, first,
                                                   stride, ahead, count, rows.shape[0], dim, ROWS=per, COLS=cols,
                                                   num_warps=warps)
