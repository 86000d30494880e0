"""Pooling, Matryoshka truncation and normalisation of packed hidden states, on the device."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pool_packed(hidden: torch.Tensor, cu: torch.Tensor, seg: torch.Tensor, lengths: torch.Tensor,
                mode: str, pos: torch.Tensor | None = None, skip: int = 0) -> torch.Tensor:
    """hidden [T, H] of sequences packed at offsets `cu` -> [N, H] in float32.

    Mean pooling sums in float32 with index_add_ (no padding, no cumsum drift over long batches).
    `skip`: each sequence's first tokens left out, as sentence-transformers leaves out a prompt
    (`include_prompt: false`); `pos` is each token's position in its sequence.
    """
    if mode == "cls":
        first = cu[:-1].long()
        return hidden[first + skip * (lengths > skip).long() if skip else first].float()
    if mode == "lasttoken":
        return hidden[cu[1:].long() - 1].float()
    out = torch.zeros(lengths.shape[0], hidden.shape[1], dtype=torch.float32, device=hidden.device)
    if skip:  # a weight rather than a boolean index, which would wait for the device
        out.index_add_(0, seg.long(), hidden.float() * (pos >= skip).unsqueeze(1))
        return out / (lengths - skip).clamp(min=1).unsqueeze(1).float()
    out.index_add_(0, seg.long(), hidden.float())
    return out / lengths.unsqueeze(1).float()


_TORCH_ACTIVATIONS = {"Identity": lambda x: x, "Tanh": torch.tanh, "ReLU": torch.relu, "GELU": F.gelu,
                      "Sigmoid": torch.sigmoid, "SiLU": F.silu}


def post_modules(spec, device: torch.device) -> list:
    """The model's modules after its pooling (sentence-transformers' Dense and Normalize), as device ops:
    ("normalize", None, None) or ("dense", DenseWeights as tensors, activation)."""
    ops = []
    for kind, d in spec.post:
        if kind == "normalize":
            ops.append(("normalize", None, None))
            continue
        w = d.weights()
        on = lambda a: None if a is None else torch.from_numpy(a).to(device)  # noqa: E731
        ops.append(("dense", w._replace(weight=on(w.weight), bias=on(w.bias), residual_weight=on(w.residual_weight)),
                    _TORCH_ACTIVATIONS[d.activation]))
    return ops


def apply_post(emb: torch.Tensor, ops: list) -> torch.Tensor:
    """Pooled float32 vectors through the post-pooling modules, in order, in float32."""
    for kind, d, act in ops:
        if kind == "normalize":
            emb = F.normalize(emb, p=2.0, dim=1)
            continue
        out = act(F.linear(emb, d.weight, d.bias))
        if d.residual:  # the input added back, mapped to the output's width where they differ
            out = out + (emb if d.residual_weight is None else F.linear(emb, d.residual_weight))
        emb = out
    return emb


def finish(emb: torch.Tensor, dim: int | None) -> torch.Tensor:
    """Matryoshka truncation (slice, then re-normalise) and L2 normalisation."""
    if dim is not None:
        emb = emb[:, :dim]
    return F.normalize(emb, p=2.0, dim=1)
