"""Rotary position embeddings for the packed families (Qwen3 and Llama-shaped decoders, ModernBERT, NomicBert,
Gemma3): the tables and the rotation, as transformers computes them."""

from __future__ import annotations

import torch


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
