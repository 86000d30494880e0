"""ModernBERT (gte-modernbert, modernbert-embed, nomic-embed v2's base) over packed sequences.

Pre-norm layers (the first without its attention norm), QKV as one matmul, RoPE with one base for the global
layers and another for the local ones, local layers attending within a sliding window (each token to those at
most `local_attention // 2` positions away: FlashAttention's window on CUDA, a band mask elsewhere), GeGLU MLP,
no biases unless the config asks for them. The config is read as transformers' ModernBertConfig reads it
(`config.py`). On CUDA in half precision the glue between matmuls is three Triton kernels a layer (`kernels.py`:
RoPE, a residual add with the next norm, GeGLU), from the first call; elsewhere torch's ops, compiled in the
background on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from embedfleet.encode.packed import OnDevice, kernels_apply, start_glue, strip_prefix
from embedfleet.encode.packed.attention import Packing, attention
from embedfleet.encode.packed.config import modernbert_config
from embedfleet.encode.packed.rope import layer_rope_tables, rope

_ACT = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "relu": F.relu}
_KERNEL_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu", "relu": "relu"}


class PackedModernBert:
    causal = False

    def __init__(self, weights: dict, layers: list[dict], heads: int, eps: float, act: str, tables: dict,
                 compile: bool = True, triton: bool = True):
        self.w, self.layers, self.heads, self.eps, self.tables = weights, layers, heads, eps, tables
        self.act, self.act_name = _ACT[act], _KERNEL_ACT[act]
        embed = weights["embed"]
        self.hidden = embed.shape[1]
        use_kernels = triton and kernels_apply(embed.device, embed.dtype, self.hidden // heads)
        self._qkv, self._mlp = start_glue(self, (_norm_qkv_rope, _attention_out_and_mlp), embed.device, compile,
                                          use_kernels)

    @classmethod
    def create(cls, cfg: dict, state: dict, device, dtype, max_len: int, compile: bool = True, triton: bool = True):
        conf = modernbert_config(cfg)

        def t(x):
            return x.to(device=device, dtype=dtype).contiguous()

        heads = conf.num_attention_heads
        hd = conf.hidden_size // heads
        tables = layer_rope_tables(conf, hd, max_len, t)
        if conf.hidden_activation not in _ACT or conf.hidden_size % heads or tables is None:
            return None
        sd = OnDevice(strip_prefix(state, "embeddings.tok_embeddings.weight"), device)

        def norm(prefix: str) -> tuple:
            return t(sd[prefix + ".weight"]), t(sd[prefix + ".bias"]) if prefix + ".bias" in sd else None

        def linear(prefix: str) -> tuple:
            return t(sd[prefix + ".weight"]), t(sd[prefix + ".bias"]) if prefix + ".bias" in sd else None

        layers = []
        for i in range(conf.num_hidden_layers):
            p = f"layers.{i}."
            local = conf.layer_types[i] == "sliding_attention"
            layers.append({
                "attn_norm": norm(p + "attn_norm") if i else (None, None), "qkv": linear(p + "attn.Wqkv"),
                "o": linear(p + "attn.Wo"), "mlp_norm": norm(p + "mlp_norm"), "wi": linear(p + "mlp.Wi"),
                "wo": linear(p + "mlp.Wo"), "type": conf.layer_types[i],
                "window": conf.sliding_window if local else None,
            })
        weights = {"embed": t(sd["embeddings.tok_embeddings.weight"]), "embed_norm": norm("embeddings.norm"),
                   "final_norm": norm("final_norm")}
        return cls(weights, layers, heads, conf.norm_eps, conf.hidden_activation, tables, compile=compile, triton=triton)

    def flops_per_token(self, mean_len: float) -> float:
        lin = sum(L[k][0].numel() for L in self.layers for k in ("qkv", "o", "wi", "wo"))
        keys = sum(min(mean_len, 2 * L["window"] + 1) if L["window"] else mean_len for L in self.layers)
        return 2 * lin + 4 * self.hidden * keys

    def __call__(self, ids: torch.Tensor, pk: Packing) -> torch.Tensor:
        kernels = self.kernels
        if kernels is not None:
            return self._with_kernels(ids, pk, kernels)
        w, h, eps = self.w, self.hidden, self.eps
        x = F.layer_norm(F.embedding(ids, w["embed"]), (h,), *w["embed_norm"], eps)
        pos = pk.pos.long()
        rot = {kind: (cos[pos], sin[pos]) for kind, (cos, sin) in self.tables.items()}
        for L in self.layers:
            q, k, v = self._qkv(x, *rot[L["type"]], *L["attn_norm"], *L["qkv"], self.heads, eps)
            a = attention(q, k, v, pk, causal=False, window=L["window"])
            x = self._mlp(x, a, L["o"][0], L["o"][1], L["mlp_norm"][0], L["mlp_norm"][1], L["wi"][0], L["wi"][1],
                          L["wo"][0], L["wo"][1], eps, self.act)
        return F.layer_norm(x, (h,), *w["final_norm"], eps)

    def _with_kernels(self, ids: torch.Tensor, pk: Packing, kn) -> torch.Tensor:
        """The same forward pass, its glue in Triton kernels: each norm fused with the residual add before it."""
        w, eps, heads, n = self.w, self.eps, self.heads, ids.shape[0]
        _, x = kn.add_norm(F.embedding(ids, w["embed"]), None, *w["embed_norm"], eps, rms=False)
        h = x  # the first layer has no attention norm
        for i, L in enumerate(self.layers):
            qkv = F.linear(h, *L["qkv"]).view(n, 3 * heads, -1)
            cos, sin = self.tables[L["type"]]
            qk = kn.qk_norm_rope(qkv, 2 * heads, None, cos, sin, pk.pos, eps)
            a = attention(qk[:, :heads], qk[:, heads:], qkv[:, 2 * heads:], pk, causal=False, window=L["window"])
            x, h = kn.add_norm(x, F.linear(a.reshape(n, -1), *L["o"]), *L["mlp_norm"], eps, rms=False)
            up = kn.gated_act(F.linear(h, *L["wi"]), self.act_name)
            after = self.layers[i + 1]["attn_norm"] if i + 1 < len(self.layers) else w["final_norm"]
            x, h = kn.add_norm(x, F.linear(up, *L["wo"]), *after, eps, rms=False)
        return h


def _norm_qkv_rope(x, cos, sin, n_w, n_b, qkv_w, qkv_b, heads: int, eps: float):
    """The input (normed, except in the first layer: `n_w` None) through QKV, then q and k rotated."""
    a_in = x if n_w is None else F.layer_norm(x, (x.shape[1],), n_w, n_b, eps)
    q, k, v = F.linear(a_in, qkv_w, qkv_b).view(x.shape[0], 3, heads, -1).unbind(1)
    return rope(q, cos, sin), rope(k, cos, sin), v


def _attention_out_and_mlp(x, a, o_w, o_b, n_w, n_b, wi_w, wi_b, wo_w, wo_b, eps: float, act):
    x = x + F.linear(a.reshape(x.shape[0], -1), o_w, o_b)
    inp, gate = F.linear(F.layer_norm(x, (x.shape[1],), n_w, n_b, eps), wi_w, wi_b).chunk(2, dim=-1)
    return x + F.linear(act(inp) * gate, wo_w, wo_b)
