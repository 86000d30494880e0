"""The Triton kernel behind take.take (CUDA only; imported lazily: CPU builds of torch have no triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ELEMENTS = 8192  # a program's rows x columns: every row loaded at once, many reads in flight (PCIe's latency)


# values that change between calls are not specialised on: one compile, not one per step kind
@triton.jit(do_not_specialize=["first", "stride", "ahead", "count", "n"])
def _take_kernel(src, rows, pos, labels, x_out, y_out, step_no, base, first, stride, ahead, count, n, dim,
                 ROWS: tl.constexpr, COLS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    at = first + (tl.load(step_no) - tl.load(base) + ahead) * stride + r
    write = r < count
    read = write & (at < n)
    row = tl.load(rows + at, mask=read, other=0)
    p = tl.load(pos + at, mask=read, other=0)
    tl.store(y_out + r, tl.load(labels + p, mask=read), mask=write)
    c = tl.arange(0, COLS)
    for c0 in range(0, dim, COLS):
        cols = c0 + c
        inside = cols[None, :] < dim
        v = tl.load(src + row[:, None] * dim + cols[None, :], mask=read[:, None] & inside, other=0.0)
        tl.store(x_out + r[:, None].to(tl.int64) * dim + cols[None, :], v.to(x_out.dtype.element_ty),
                 mask=write[:, None] & inside)


def take_rows(src: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, labels: torch.Tensor, x_out: torch.Tensor,
              y_out: torch.Tensor, step_no: torch.Tensor, base: torch.Tensor, first: int, stride: int, ahead: int,
              count: int, elements: int = ELEMENTS, warps: int = 4) -> None:
    """take.take's work (contiguous `src` and `x_out`); `elements` and `warps` shape a program (bench/take_pcie.py)."""
    dim = src.shape[1]
    cols = min(1024, triton.next_power_of_2(dim))
    per = max(1, elements // cols)
    _take_kernel[(triton.cdiv(count, per),)](src, rows, pos, labels, x_out, y_out, step_no, base, first, stride,
                                            ahead, count, rows.shape[0], dim, ROWS=per, COLS=cols, num_warps=warps)
