"""NomicBert (nomic-embed-text v1 and v1.5) over packed sequences.

BERT's post-norm layers with RoPE in place of position embeddings, no biases, and a gated MLP (SwiGLU): each
layer is LayerNorm(x + attention(x)), then LayerNorm(x + down(act(gate(x)) · up(x))). Token type 0 is added to
every token, as the model's tokenizer sets it. The weights come under either naming: the checkpoints' own
(`encoder.layers.N.attn.Wqkv`, `mlp.fc11` up, `fc12` gate, `fc2` down, `norm1`, `norm2`, `emb_ln`) or
transformers' (`layers.N.self_attn.q_proj`, …); the config under either too (`n_embd` or `hidden_size`, …).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from embedfleet.encode.compile import fused
from embedfleet.encode.packed import OnDevice, strip_prefix
from embedfleet.encode.packed.attention import Packing, attention
from embedfleet.encode.packed.qwen3 import rope, rope_table

_ACT = {"silu": F.silu, "swiglu": F.silu, "gelu": F.gelu, "geglu": F.gelu}


def _setting(cfg: dict, *names, default=None):
    return next((cfg[n] for n in names if cfg.get(n) is not None), default)


def _theta(cfg: dict) -> float | None:
    params = cfg.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default":
        return None
    return float(params.get("rope_theta") or cfg.get("rotary_emb_base") or 1000.0)


class PackedNomicBert:
    causal = False

    def __init__(self, weights: dict, layers: list[dict], heads: int, eps: float, act, cos, sin, compile: bool = True):
        self.w, self.layers, self.heads, self.eps, self.act, self.cos, self.sin = (
            weights, layers, heads, eps, act, cos, sin)
        self.hidden = weights["embed"].shape[1]
        self._post = fused(_post_attention, weights["embed"].device, compile)
        self.fused = [self._post]  # what a BackgroundCompile compiles

    @classmethod
    def create(cls, cfg: dict, state: dict, device, dtype, max_len: int, compile: bool = True):
        hidden = _setting(cfg, "hidden_size", "n_embd", default=768)
        heads = _setting(cfg, "num_attention_heads", "n_head", default=12)
        n_layers = _setting(cfg, "num_hidden_layers", "n_layer", default=12)
        act = _setting(cfg, "hidden_act", "activation_function", default="silu")
        theta = _theta(cfg)
        if (act not in _ACT or theta is None or hidden % heads or cfg.get("prenorm")
                or _setting(cfg, "rotary_emb_fraction", default=1.0) != 1.0 or cfg.get("rotary_emb_interleaved")):
            return None  # the generic path serves the variants not written here

        def t(x):
            return x.to(device=device, dtype=dtype).contiguous()

        sd = OnDevice(strip_prefix(state, "embeddings.word_embeddings.weight"), device)
        own = "encoder.layers.0.attn.Wqkv.weight" in sd  # the checkpoints' own names, else transformers'

        def opt(name: str):
            return t(sd[name]) if name in sd else None

        layers = []
        for i in range(n_layers):
            if own:
                p = f"encoder.layers.{i}."
                qkv = [sd[p + "attn.Wqkv.weight"]]
                qkv_b = [sd[p + "attn.Wqkv.bias"]] if p + "attn.Wqkv.bias" in sd else None
                names = {"o": "attn.out_proj", "gate": "mlp.fc12", "up": "mlp.fc11", "down": "mlp.fc2",
                         "n1": "norm1", "n2": "norm2"}
            else:
                p = f"layers.{i}."
                qkv = [sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
                qkv_b = ([sd[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]
                         if p + "self_attn.q_proj.bias" in sd else None)
                names = {"o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                         "down": "mlp.down_proj", "n1": "post_attention_layernorm", "n2": "post_mlp_layernorm"}
            L = {"qkv_w": t(torch.cat(qkv)), "qkv_b": t(torch.cat(qkv_b)) if qkv_b else None,
                 "gu_w": t(torch.cat([sd[p + names["gate"] + ".weight"], sd[p + names["up"] + ".weight"]]))}
            gb, ub = opt(p + names["gate"] + ".bias"), opt(p + names["up"] + ".bias")
            L["gu_b"] = torch.cat([gb, ub]) if gb is not None and ub is not None else None
            for key in ("o", "down", "n1", "n2"):
                L[key] = (t(sd[p + names[key] + ".weight"]), opt(p + names[key] + ".bias"))
            layers.append(L)
        emb_norm = "emb_ln" if own else "embeddings.LayerNorm"
        weights = {"embed": t(sd["embeddings.word_embeddings.weight"]),
                   "type0": t(sd["embeddings.token_type_embeddings.weight"][0]) if
                   "embeddings.token_type_embeddings.weight" in sd else None,
                   "norm": (t(sd[emb_norm + ".weight"]), opt(emb_norm + ".bias"))}
        eps = _setting(cfg, "layer_norm_eps", "layer_norm_epsilon", default=1e-12)
        cos, sin = rope_table(theta, hidden // heads, max_len, t)
        return cls(weights, layers, heads, eps, _ACT[act], cos, sin, compile=compile)

    def flops_per_token(self, mean_len: float) -> float:
        lin = sum(L[k].numel() for L in self.layers for k in ("qkv_w", "gu_w")) + sum(
            L[k][0].numel() for L in self.layers for k in ("o", "down"))
        return 2 * lin + 4 * self.hidden * mean_len * len(self.layers)

    def __call__(self, ids: torch.Tensor, pk: Packing) -> torch.Tensor:
        w, h, n, eps = self.w, self.hidden, ids.shape[0], self.eps
        x = F.embedding(ids, w["embed"])
        if w["type0"] is not None:
            x = x + w["type0"]
        x = F.layer_norm(x, (h,), *w["norm"], eps)
        pos = pk.pos.long()
        cos, sin = self.cos[pos], self.sin[pos]
        for L in self.layers:
            q, k, v = F.linear(x, L["qkv_w"], L["qkv_b"]).view(n, 3, self.heads, -1).unbind(1)
            a = attention(rope(q, cos, sin), rope(k, cos, sin), v, pk, causal=False)
            x = self._post(x, a, *L["o"], *L["n1"], L["gu_w"], L["gu_b"], *L["down"], *L["n2"], eps, self.act)
        return x


def _post_attention(x, a, o_w, o_b, n1_w, n1_b, gu_w, gu_b, down_w, down_b, n2_w, n2_b, eps: float, act):
    h = x.shape[1]
    x = F.layer_norm(x + F.linear(a.reshape(x.shape[0], -1), o_w, o_b), (h,), n1_w, n1_b, eps)
    g, u = F.linear(x, gu_w, gu_b).chunk(2, dim=-1)
    return F.layer_norm(x + F.linear(act(g) * u, down_w, down_b), (h,), n2_w, n2_b, eps)
