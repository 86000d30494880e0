"""Heads trained on stored embeddings or a table's features: `linear` (one layer) and `mlp` (one hidden
layer, GELU). A head's shape is (kind, dim, outputs, hidden, standardize): enough to rebuild it from head.json.
Heads on named features standardize their input first (raw columns differ in scale by orders of magnitude)."""

from __future__ import annotations

import torch
from torch import nn

from embedfleet.errors import InputError

__all__ = ["HEADS", "build_head", "hidden_size"]

HEADS = ("linear", "mlp")


def hidden_size(dim: int) -> int:
    return 2 * dim


class Standardize(nn.Module):
    """(x - mean) / std per feature, from the training rows; kept in the head's weights."""

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("inv_std", torch.ones(dim))

    def fit(self, x: torch.Tensor) -> Standardize:
        x = x.double()
        std = x.std(0, unbiased=False) if len(x) > 1 else torch.ones(x.shape[1], dtype=x.dtype, device=x.device)
        self.mean.copy_(x.mean(0).float())
        self.inv_std.copy_(torch.where(std > 0, 1.0 / std, torch.ones_like(std)).float())
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() - self.mean) * self.inv_std


def build_head(kind: str, dim: int, outputs: int, hidden: int | None = None, standardize: bool = False) -> nn.Module:
    if kind == "linear":
        head: nn.Module = nn.Linear(dim, outputs)
    elif kind == "mlp":
        hidden = hidden or hidden_size(dim)
        head = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, outputs))
    else:
        raise InputError(f"--head {kind!r}: use {' or '.join(HEADS)}")
    return nn.Sequential(Standardize(dim), head) if standardize else head
