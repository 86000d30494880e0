"""Qwen3 (and Qwen2 / Llama-shaped) decoders over packed sequences, causal varlen attention.

Q, K, V are one matmul and gate/up another; grouped K/V heads go to the kernel as they are
(no repeat); RoPE tables are built once for max_seq_length positions. On CUDA the q/k norms and
RoPE are one Triton kernel (kernels.py); elsewhere the same steps in torch.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from embedfleet.encode.compile import fused
from embedfleet.encode.packed import OnDevice, glue_kernels, strip_prefix
from embedfleet.encode.packed.attention import Packing, attention
from embedfleet.encode.packed.rope import rope, rope_table

log = logging.getLogger(__name__)


def _rope_theta(cfg: dict) -> float | None:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if params.get("rope_type", params.get("type", "default")) != "default":
        return None  # scaled RoPE variants: leave them to the generic path
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


class PackedDecoder:
    causal = True

    def __init__(self, weights, layers, heads, kv_heads, head_dim, eps, cos, sin, compile: bool = True,
                 triton: bool = True):
        self.w, self.layers, self.heads, self.kv_heads, self.head_dim, self.eps = (
            weights, layers, heads, kv_heads, head_dim, eps)
        self.cos, self.sin = cos, sin
        self.hidden = weights["embed"].shape[1]
        device = weights["embed"].device
        self._qkv, self._qk, self._post = (fused(f, device, compile)
                                           for f in (_qkv_proj, _qk_norm_rope, _post_attention))
        self.fused = [self._qkv, self._qk, self._post]  # what a BackgroundCompile compiles (those it runs)
        kernels = glue_kernels(device, weights["embed"].dtype, head_dim) if triton else None
        self._kernel = kernels.qk_norm_rope if kernels is not None else None

    @classmethod
    def create(cls, cfg: dict, state: dict, device, dtype, max_len: int, compile: bool = True, triton: bool = True):
        theta = _rope_theta(cfg)
        if theta is None or cfg.get("hidden_act", "silu") != "silu" or cfg.get("use_sliding_window"):
            return None
        window = cfg.get("sliding_window") if cfg.get("model_type") == "mistral" else None
        if window is not None and window < max_len:  # a window the texts can outgrow: the generic path applies it
            return None
        sd = OnDevice(strip_prefix(state, "embed_tokens.weight"), device)

        def t(x):
            return x.to(device=device, dtype=dtype).contiguous()

        heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
        hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
        layers = []
        for i in range(cfg["num_hidden_layers"]):
            p = f"layers.{i}."
            g = lambda n: sd[p + n]  # noqa: E731
            qkv = ("q_proj", "k_proj", "v_proj")
            L = {
                "in_w": t(g("input_layernorm.weight")), "post_w": t(g("post_attention_layernorm.weight")),
                "qkv_w": t(torch.cat([g(f"self_attn.{n}.weight") for n in qkv])),
                "qkv_b": t(torch.cat([g(f"self_attn.{n}.bias") for n in qkv])) if p + "self_attn.q_proj.bias" in sd else None,
                "o_w": t(g("self_attn.o_proj.weight")),
                "gu_w": t(torch.cat([g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")])),
                "down_w": t(g("mlp.down_proj.weight")),
                # Qwen3's per-head q and k norms as one [heads + kv, head_dim] table: one kernel for both
                "qkn_w": t(torch.cat([g("self_attn.q_norm.weight").expand(heads, hd),
                                      g("self_attn.k_norm.weight").expand(kv, hd)]))
                if p + "self_attn.q_norm.weight" in sd else None,
            }
            layers.append(L)
        cos, sin = rope_table(theta, hd, max_len, t)
        weights = {"embed": t(sd["embed_tokens.weight"]), "norm": t(sd["norm.weight"])}
        return cls(weights, layers, heads, kv, hd, cfg.get("rms_norm_eps", 1e-6), cos, sin, compile=compile, triton=triton)

    def flops_per_token(self, mean_len: float) -> float:
        lin = sum(l[k].numel() for l in self.layers for k in ("qkv_w", "o_w", "gu_w", "down_w"))
        # causal: each token attends to (L+1)/2 keys on average; QK^T and PV, 2 flops per MAC
        return 2 * lin + 4 * len(self.layers) * self.heads * self.head_dim * (mean_len + 1) / 2

    def __call__(self, ids: torch.Tensor, pk: Packing) -> torch.Tensor:
        try:
            return self._forward(ids, pk)
        except torch.OutOfMemoryError:
            raise  # the encoder halves its token budget and retries
        except Exception as err:  # noqa: BLE001 - a Triton that cannot build here: the torch path from now on
            if self._kernel is None:
                raise
            log.warning("Triton q/k norm kernel failed (%s); using the torch path", str(err).splitlines()[0])
            self._kernel = None
            return self._forward(ids, pk)

    def _forward(self, ids: torch.Tensor, pk: Packing) -> torch.Tensor:
        x = F.embedding(ids, self.w["embed"])
        n, qk_heads = x.shape[0], self.heads + self.kv_heads
        if self._kernel is None:
            pos = pk.pos.long()
            cos, sin = self.cos[pos], self.sin[pos]
        for L in self.layers:
            qkv = self._qkv(x, L["in_w"], L["qkv_w"], L["qkv_b"], self.eps).view(n, qk_heads + self.kv_heads, -1)
            if self._kernel is not None:
                qk = self._kernel(qkv, qk_heads, L["qkn_w"], self.cos, self.sin, pk.pos, self.eps)
            else:
                qk = self._qk(qkv, L["qkn_w"], cos, sin, qk_heads, self.eps)
            # q, k and v as views: FlashAttention takes any row stride if each head is contiguous
            a = attention(qk[:, : self.heads], qk[:, self.heads :], qkv[:, qk_heads:], pk, causal=True)
            x = self._post(x, a, L["o_w"], L["post_w"], L["gu_w"], L["down_w"], self.eps)
        return F.rms_norm(x, (self.hidden,), self.w["norm"], self.eps)


def _qkv_proj(x, in_w, qkv_w, qkv_b, eps: float):
    return F.linear(F.rms_norm(x, (x.shape[1],), in_w, eps), qkv_w, qkv_b)


def _qk_norm_rope(qkv, qkn_w, cos, sin, qk_heads: int, eps: float):
    """Qwen3's per-head q/k RMSNorm, then RoPE, over the q and k heads of qkv [T, heads, D]."""
    qk = qkv[:, :qk_heads]
    if qkn_w is not None:
        qk = F.rms_norm(qk, (qk.shape[-1],), eps=eps) * qkn_w  # normalise, cast, then scale: as transformers
    return rope(qk, cos, sin)


def _post_attention(x, a, o_w, post_w, gu_w, down_w, eps: float):
    x = x + F.linear(a.reshape(x.shape[0], -1), o_w)
    g, u = F.linear(F.rms_norm(x, (x.shape[1],), post_w, eps), gu_w).chunk(2, dim=-1)
    return x + F.linear(F.silu(g) * u, down_w)
