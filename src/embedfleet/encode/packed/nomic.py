"""NomicBert (nomic-embed-text v1 and v1.5) over packed sequences.

BERT's post-norm layers with RoPE in place of position embeddings, no biases in the linear layers, and a gated
MLP (SwiGLU, GeGLU): each layer is LayerNorm(x + attention(x)), then LayerNorm(x + down(act(gate(x)) · up(x))).
Token type 0 is added to every token, as the model's tokenizer sets it. Which configs qualify:
models.nomic_packable. The weights come under either naming: the checkpoints' own
(`encoder.layers.N.attn.Wqkv`, `mlp.fc11` up, `fc12` gate, `fc2` down, `norm1`, `norm2`, `emb_ln`) or
transformers' (`layers.N.self_attn.q_proj`, …); the config under either too (`n_embd` or `hidden_size`, …).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from embedfleet.encode.compile import fused
from embedfleet.encode.models import NOMIC_GATED, nomic_packable
from embedfleet.encode.packed import OnDevice, strip_prefix
from embedfleet.encode.packed.attention import Packing, attention
from embedfleet.encode.packed.rope import rope, rope_table

_ACT = {"silu": F.silu, "gelu": F.gelu}


def _setting(cfg: dict, *names, default=None):
    return next((cfg[n] for n in names if cfg.get(n) is not None), default)


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
        if not nomic_packable(cfg):
            return None  # the generic path serves the variants not written here
        hidden = _setting(cfg, "hidden_size", "n_embd", default=768)
        heads = _setting(cfg, "num_attention_heads", "n_head", default=12)
        n_layers = _setting(cfg, "num_hidden_layers", "n_layer", default=12)
        act = NOMIC_GATED.get(cfg.get("activation_function")) or cfg.get("hidden_act", "silu")
        theta = float(_setting(cfg.get("rope_parameters") or {}, "rope_theta") or
                      _setting(cfg, "rope_theta", "rotary_emb_base", default=1000.0))
        if hidden % heads:
            return None

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
                names = {"o": "attn.out_proj", "gate": "mlp.fc12", "up": "mlp.fc11", "down": "mlp.fc2",
                         "n1": "norm1", "n2": "norm2"}
            else:
                p = f"layers.{i}."
                qkv = [sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
                names = {"o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                         "down": "mlp.down_proj", "n1": "post_attention_layernorm", "n2": "post_mlp_layernorm"}
            w = {key: p + name + ".weight" for key, name in names.items()}
            layers.append({"qkv": t(torch.cat(qkv)), "gu": t(torch.cat([sd[w["gate"]], sd[w["up"]]])),
                           "o": t(sd[w["o"]]), "down": t(sd[w["down"]]),
                           "n1": (t(sd[w["n1"]]), opt(p + names["n1"] + ".bias")),
                           "n2": (t(sd[w["n2"]]), opt(p + names["n2"] + ".bias"))})
        emb_norm = "emb_ln" if own else "embeddings.LayerNorm"
        weights = {"embed": t(sd["embeddings.word_embeddings.weight"]),
                   "type0": t(sd["embeddings.token_type_embeddings.weight"][0]) if
                   "embeddings.token_type_embeddings.weight" in sd else None,
                   "norm": (t(sd[emb_norm + ".weight"]), opt(emb_norm + ".bias"))}
        eps = _setting(cfg, "layer_norm_eps", "layer_norm_epsilon", default=1e-12)
        cos, sin = rope_table(theta, hidden // heads, max_len, t)
        return cls(weights, layers, heads, eps, _ACT[act], cos, sin, compile=compile)

    def flops_per_token(self, mean_len: float) -> float:
        lin = sum(L[k].numel() for L in self.layers for k in ("qkv", "gu", "o", "down"))
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
            q, k, v = F.linear(x, L["qkv"]).view(n, 3, self.heads, -1).unbind(1)
            a = attention(rope(q, cos, sin), rope(k, cos, sin), v, pk, causal=False)
            x = self._post(x, a, L["o"], *L["n1"], L["gu"], L["down"], *L["n2"], eps, self.act)
        return x


def _post_attention(x, a, o_w, n1_w, n1_b, gu_w, down_w, n2_w, n2_b, eps: float, act):
    h = x.shape[1]
    x = F.layer_norm(x + F.linear(a.reshape(x.shape[0], -1), o_w), (h,), n1_w, n1_b, eps)
    g, u = F.linear(x, gu_w).chunk(2, dim=-1)
    return F.layer_norm(x + F.linear(act(g) * u, down_w), (h,), n2_w, n2_b, eps)
