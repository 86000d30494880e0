"""BERT-family encoder (BERT, RoBERTa/XLM-R, MiniLM, bge/e5-style) over packed sequences.

Q, K and V are one matmul; token type 0 is folded into the position table at load time (single
sentences never use type 1), saving a gather per batch; a pair's second text adds type 1's difference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from embedfleet.encode.compile import fused
from embedfleet.encode.packed import OnDevice, strip_prefix
from embedfleet.encode.packed.attention import Packing, attention

_ACT = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class PackedBert:
    causal = False

    def __init__(self, weights: dict, layers: list[dict], heads: int, eps: float, act, pos_offset: int,
                 compile: bool = True):
        self.w, self.layers, self.heads, self.eps, self.act, self.pos_offset = (
            weights, layers, heads, eps, act, pos_offset)
        # token type 1 less type 0 (folded into the positions): a pair's second text adds it (cross-encoders)
        self.type_delta: torch.Tensor | None = weights.get("type_delta")
        self.hidden = weights["word"].shape[1]
        self._post = fused(_post_attention, weights["word"].device, compile)
        self.fused = [self._post]  # what a BackgroundCompile compiles

    @classmethod
    def create(cls, cfg: dict, state: dict, device, dtype, compile: bool = True):
        if cfg.get("position_embedding_type", "absolute") != "absolute" or cfg.get("hidden_act", "gelu") not in _ACT:
            return None
        sd = OnDevice({k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias"): v
                       for k, v in strip_prefix(state, "embeddings.word_embeddings.weight").items()}, device)

        def t(x):
            return x.to(device=device, dtype=dtype).contiguous()

        pos = sd["embeddings.position_embeddings.weight"].float()
        weights = {}
        if "embeddings.token_type_embeddings.weight" in sd:
            types = sd["embeddings.token_type_embeddings.weight"].float()
            pos = pos + types[0]
            if types.shape[0] > 1:
                weights["type_delta"] = t(types[1] - types[0])
        weights.update({"word": t(sd["embeddings.word_embeddings.weight"]), "pos": t(pos),
                        "ln_w": t(sd["embeddings.LayerNorm.weight"]), "ln_b": t(sd["embeddings.LayerNorm.bias"])})
        layers = []
        for i in range(cfg["num_hidden_layers"]):
            p = f"encoder.layer.{i}."
            g = lambda n: sd[p + n]  # noqa: E731
            layers.append({
                "qkv_w": t(torch.cat([g(f"attention.self.{n}.weight") for n in ("query", "key", "value")])),
                "qkv_b": t(torch.cat([g(f"attention.self.{n}.bias") for n in ("query", "key", "value")])),
                "o_w": t(g("attention.output.dense.weight")), "o_b": t(g("attention.output.dense.bias")),
                "ln1_w": t(g("attention.output.LayerNorm.weight")), "ln1_b": t(g("attention.output.LayerNorm.bias")),
                "i_w": t(g("intermediate.dense.weight")), "i_b": t(g("intermediate.dense.bias")),
                "out_w": t(g("output.dense.weight")), "out_b": t(g("output.dense.bias")),
                "ln2_w": t(g("output.LayerNorm.weight")), "ln2_b": t(g("output.LayerNorm.bias")),
            })
        roberta = cfg.get("model_type") in ("roberta", "xlm-roberta", "camembert")
        offset = int(cfg.get("pad_token_id", 1)) + 1 if roberta else 0
        return cls(weights, layers, cfg["num_attention_heads"], cfg.get("layer_norm_eps", 1e-12),
                   _ACT[cfg.get("hidden_act", "gelu")], offset, compile=compile)

    def flops_per_token(self, mean_len: float) -> float:
        lin = sum(l[k].numel() for l in self.layers for k in ("qkv_w", "o_w", "i_w", "out_w"))
        return 2 * lin + 4 * len(self.layers) * self.hidden * mean_len

    def __call__(self, ids: torch.Tensor, pk: Packing, types: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states of packed `ids`; `types` (0 or 1 a token, the pair's second text 1) where they matter."""
        w, h, n = self.w, self.hidden, ids.shape[0]
        x = F.embedding(ids, w["word"]) + F.embedding(pk.pos + self.pos_offset, w["pos"])
        if types is not None and self.type_delta is not None:
            x = x + types.to(x.dtype)[:, None] * self.type_delta
        x = F.layer_norm(x, (h,), w["ln_w"], w["ln_b"], self.eps)
        for L in self.layers:
            q, k, v = F.linear(x, L["qkv_w"], L["qkv_b"]).view(n, 3, self.heads, -1).unbind(1)
            a = attention(q, k, v, pk, causal=False)
            x = self._post(x, a, L, self.eps, self.act)
        return x


def _post_attention(x, a, L: dict, eps: float, act):
    h = x.shape[1]
    x = F.layer_norm(x + F.linear(a.reshape(x.shape[0], h), L["o_w"], L["o_b"]), (h,), L["ln1_w"], L["ln1_b"], eps)
    m = F.linear(act(F.linear(x, L["i_w"], L["i_b"])), L["out_w"], L["out_b"])
    return F.layer_norm(x + m, (h,), L["ln2_w"], L["ln2_b"], eps)
