"""Gemma3 text models over packed sequences: EmbeddingGemma (bidirectional) and causal Gemma3 alike.

Each layer: RMSNorm with (1 + weight) before and after attention and before and after the GeGLU MLP; per-head
q/k RMSNorm; RoPE with one base for the global layers and another for the local ones; grouped K/V heads; the
local layers attending within a sliding window (bidirectional: each token to those less than the window's half
away, as transformers masks them); scores scaled by query_pre_attn_scalar. Embeddings are scaled by the square
root of the width. The config is read as transformers' Gemma3TextConfig reads it (`config.py`). On CUDA in half
precision the glue between matmuls is Triton kernels (`kernels.py`: q/k norm with RoPE, each post-norm with its
residual add and the next pre-norm, GeGLU), from the first call; elsewhere torch's ops, compiled in the background
on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from embedfleet.encode.packed import OnDevice, kernels_apply, start_glue, strip_prefix
from embedfleet.encode.packed.attention import Packing, attention
from embedfleet.encode.packed.config import gemma3_config
from embedfleet.encode.packed.rope import layer_rope_tables, rope

_ACT = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}
_KERNEL_ACT = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def _norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: in float32, times `scale` (1 + the weight, float32, made at load), then cast back."""
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * scale).type_as(x)


class PackedGemma3:
    def __init__(self, weights: dict, layers: list[dict], heads: int, kv_heads: int, head_dim: int, eps: float,
                 scale: float, act: str, tables: dict, causal: bool, compile: bool = True, triton: bool = True):
        self.w, self.layers, self.heads, self.kv_heads, self.head_dim = weights, layers, heads, kv_heads, head_dim
        self.eps, self.scale, self.tables, self.causal = eps, scale, tables, causal
        self.act, self.act_name = _ACT[act], _KERNEL_ACT[act]
        embed = weights["embed"]
        self.hidden = embed.shape[1]
        use_kernels = triton and kernels_apply(embed.device, embed.dtype, head_dim)
        if use_kernels:  # the q and k norms' scales a head each, as the kernel reads them
            for L in layers:
                L["qk_norm"] = torch.cat([L["q_norm"].expand(heads, -1), L["k_norm"].expand(kv_heads, -1)]).contiguous()
        self._qkv, self._mlp = start_glue(self, (_norm_qkv_rope, _attention_out_and_mlp), embed.device, compile,
                                          use_kernels)

    @classmethod
    def create(cls, cfg: dict, state: dict, device, dtype, max_len: int, compile: bool = True, triton: bool = True):
        conf = gemma3_config(cfg)

        def t(x):
            return x.to(device=device, dtype=dtype).contiguous()

        def scale(w):  # a norm's (1 + weight), made once rather than in every batch
            return 1.0 + t(w).float()

        heads, kv, hd = conf.num_attention_heads, conf.num_key_value_heads, conf.head_dim
        tables = layer_rope_tables(conf, hd, max_len, t)
        if conf.hidden_activation not in _ACT or conf.attn_logit_softcapping or tables is None:
            return None
        sd = OnDevice(strip_prefix(state, "embed_tokens.weight"), device)
        layers = []
        for i in range(conf.num_hidden_layers):
            p = f"layers.{i}."
            g = lambda n: sd[p + n]  # noqa: E731
            local = conf.layer_types[i] == "sliding_attention"
            bias = p + "self_attn.q_proj.bias" in sd
            layers.append({
                "in": scale(g("input_layernorm.weight")), "post_attn": scale(g("post_attention_layernorm.weight")),
                "pre_ff": scale(g("pre_feedforward_layernorm.weight")), "post_ff": scale(g("post_feedforward_layernorm.weight")),
                "qkv_w": t(torch.cat([g(f"self_attn.{n}.weight") for n in ("q_proj", "k_proj", "v_proj")])),
                "qkv_b": t(torch.cat([g(f"self_attn.{n}.bias") for n in ("q_proj", "k_proj", "v_proj")])) if bias else None,
                "o_w": t(g("self_attn.o_proj.weight")), "o_b": t(g("self_attn.o_proj.bias")) if bias else None,
                "q_norm": scale(g("self_attn.q_norm.weight")), "k_norm": scale(g("self_attn.k_norm.weight")),
                "gu_w": t(torch.cat([g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")])),
                "down_w": t(g("mlp.down_proj.weight")), "type": conf.layer_types[i],
                # transformers' window is exclusive (distance < sliding_window); `attention`'s is inclusive
                "window": conf.sliding_window - 1 if local and conf.sliding_window else None,
            })
        weights = {"embed": t(sd["embed_tokens.weight"]), "scale": torch.tensor(conf.hidden_size ** 0.5, dtype=dtype, device=device),
                   "norm": scale(sd["norm.weight"])}
        return cls(weights, layers, heads, kv, hd, conf.rms_norm_eps, conf.query_pre_attn_scalar ** -0.5,
                   conf.hidden_activation, tables, not conf.use_bidirectional_attention, compile=compile, triton=triton)

    def flops_per_token(self, mean_len: float) -> float:
        lin = sum(L[k].numel() for L in self.layers for k in ("qkv_w", "o_w", "gu_w", "down_w"))
        keys = sum(min(mean_len, 2 * L["window"] + 1) if L["window"] else mean_len for L in self.layers)
        return 2 * lin + 4 * self.heads * self.head_dim * keys

    def __call__(self, ids: torch.Tensor, pk: Packing) -> torch.Tensor:
        kernels = self.kernels
        if kernels is not None:
            return self._with_kernels(ids, pk, kernels)
        w, eps, hq, hk = self.w, self.eps, self.heads, self.kv_heads
        x = F.embedding(ids, w["embed"]) * w["scale"]
        pos = pk.pos.long()
        rot = {kind: (cos[pos], sin[pos]) for kind, (cos, sin) in self.tables.items()}
        for L in self.layers:
            q, k, v = self._qkv(x, *rot[L["type"]], L["in"], L["qkv_w"], L["qkv_b"], L["q_norm"], L["k_norm"], hq, hk,
                                eps)
            a = attention(q, k, v, pk, causal=self.causal, scale=self.scale, window=L["window"])
            x = self._mlp(x, a, L["o_w"], L["o_b"], L["post_attn"], L["pre_ff"], L["gu_w"], L["down_w"], L["post_ff"],
                          eps, self.act)
        return _norm(x, w["norm"], eps)

    def _with_kernels(self, ids: torch.Tensor, pk: Packing, kn) -> torch.Tensor:
        """The same forward pass, its glue in Triton kernels: each post-norm fused with its residual add and the
        pre-norm after it."""
        w, eps, hq, hk, n = self.w, self.eps, self.heads, self.kv_heads, ids.shape[0]
        x, h = kn.add_norm(F.embedding(ids, w["embed"]) * w["scale"], None, self.layers[0]["in"], None, eps, rms=True)
        for i, L in enumerate(self.layers):
            qkv = F.linear(h, L["qkv_w"], L["qkv_b"]).view(n, hq + 2 * hk, -1)
            cos, sin = self.tables[L["type"]]
            qk = kn.qk_norm_rope(qkv, hq + hk, L["qk_norm"], cos, sin, pk.pos, eps, round_norm=False)
            a = attention(qk[:, :hq], qk[:, hq:], qkv[:, hq + hk:], pk, causal=self.causal, scale=self.scale,
                          window=L["window"])
            o = F.linear(a.reshape(n, -1), L["o_w"], L["o_b"])
            x, h = kn.add_norm(x, o, L["pre_ff"], None, eps, rms=True, post_w=L["post_attn"])
            up = kn.gated_act(F.linear(h, L["gu_w"]), self.act_name)
            after = self.layers[i + 1]["in"] if i + 1 < len(self.layers) else w["norm"]
            x, h = kn.add_norm(x, F.linear(up, L["down_w"]), after, None, eps, rms=True, post_w=L["post_ff"])
        return h


def _norm_qkv_rope(x, cos, sin, in_w, qkv_w, qkv_b, q_norm, k_norm, hq: int, hk: int, eps: float):
    """The normed input through QKV, then q and k each normed per head and rotated; v as a view of the QKV output."""
    qkv = F.linear(_norm(x, in_w, eps), qkv_w, qkv_b).view(x.shape[0], hq + 2 * hk, -1)
    q = rope(_norm(qkv[:, :hq], q_norm, eps), cos, sin)
    k = rope(_norm(qkv[:, hq:hq + hk], k_norm, eps), cos, sin)
    return q, k, qkv[:, hq + hk:]


def _attention_out_and_mlp(x, a, o_w, o_b, post_attn, pre_ff, gu_w, down_w, post_ff, eps: float, act):
    x = x + _norm(F.linear(a.reshape(x.shape[0], -1), o_w, o_b), post_attn, eps)
    g, u = F.linear(_norm(x, pre_ff, eps), gu_w).chunk(2, dim=-1)
    return x + _norm(F.linear(act(g) * u, down_w), post_ff, eps)
