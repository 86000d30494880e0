"""Heads trained on stored embeddings: `linear` (one layer) and `mlp` (one hidden layer, GELU).
A head's shape is (kind, dim, outputs, hidden): enough to rebuild it from head.json."""

from __future__ import annotations

from torch import nn

from embedfleet.errors import InputError

__all__ = ["HEADS", "build_head", "hidden_size"]

HEADS = ("linear", "mlp")


def hidden_size(dim: int) -> int:
    return 2 * dim


def build_head(kind: str, dim: int, outputs: int, hidden: int | None = None) -> nn.Module:
    if kind == "linear":
        return nn.Linear(dim, outputs)
    if kind == "mlp":
        hidden = hidden or hidden_size(dim)
        return nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, outputs))
    raise InputError(f"--head {kind!r}: use {' or '.join(HEADS)}")
