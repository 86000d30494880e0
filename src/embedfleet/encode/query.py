"""Embedding queries: a few texts, now, on the CPU, without what big work needs.

`embedfleet search` embeds one query (or a file of them) and `embedfleet serve` one per request. A
cold process that imports torch, starts CUDA, builds the packed model and compiles spends seconds
before the first vector; one query needs none of it. For BERT-family models (MiniLM, BERT, RoBERTa,
bge/e5-style: what the packed BERT path serves), `NumpyBert` runs the same forward pass in numpy,
in float32, on the CPU: weights read straight from the safetensors file, the library's tokenizer, no
torch import (importing torch alone takes longer than a MiniLM query: docs/decisions/query-encoder-numpy.md).
Anything else — another architecture, or a GPU asked for — goes through `Encoder`, eagerly.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np

from embedfleet.encode.models import BERT_TYPES, ModelSpec, model_name, read_spec, read_weights, resolve_model, strip_prefix
from embedfleet.encode.tokenize import model_tokenizer
from embedfleet.errors import ModelError

__all__ = ["NumpyBert", "QueryEncoder", "read_safetensors"]

_BATCH_TOKENS = 8192  # padded tokens a pass: attention's [N, heads, L, L] scores stay a few MB


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every floating-point tensor of a .safetensors file as float32 numpy arrays (bf16 widened)."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    (n,) = struct.unpack("<Q", data[:8].tobytes())
    header = json.loads(data[8 : 8 + n].tobytes())
    base, out = 8 + n, {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        raw = data[base + start : base + end]
        kind = meta["dtype"]
        if kind == "F32":
            a = raw.view(np.float32)
        elif kind == "F16":
            a = raw.view(np.float16).astype(np.float32)
        elif kind == "BF16":  # the high half of a float32
            a = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            continue  # integer buffers (position_ids): not weights
        out[name] = np.array(a, dtype=np.float32).reshape(meta["shape"])
    return out


def _load_state(hf_dir: Path) -> dict[str, np.ndarray] | None:
    return read_weights(hf_dir, read_safetensors)


def _erf(x: np.ndarray) -> np.ndarray:
    """erf to within 1.5e-7 (Abramowitz & Stegun 7.1.26): below float32's rounding of GELU's output.
    In place where it can: this runs over every token's intermediate activations."""
    a = np.abs(x)
    t = 0.3275911 * a
    t += 1.0
    np.reciprocal(t, out=t)
    y = 1.061405429 * t
    for c in (-1.453152027, 1.421413741, -0.284496736, 0.254829592):
        y += c
        y *= t
    a *= a
    np.negative(a, out=a)
    np.exp(a, out=a)
    y *= a
    np.subtract(1.0, y, out=y)
    return np.copysign(y, x, out=y)


def _gelu(x):
    e = _erf(x * np.float32(1 / math.sqrt(2.0)))
    e += 1.0
    e *= x
    e *= 0.5
    return e


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.float32(math.sqrt(2 / math.pi)) * (x + np.float32(0.044715) * x ** 3)))


_ACT = {"gelu": _gelu, "gelu_new": _gelu_tanh, "gelu_pytorch_tanh": _gelu_tanh, "relu": lambda x: np.maximum(x, 0)}


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    c = x - mean
    return c / np.sqrt((c * c).mean(-1, keepdims=True) + eps) * w + b


class NumpyBert:
    """packed/bert.py's forward pass in numpy (padded batches, a key mask), for a few texts on the CPU."""

    def __init__(self, weights: dict, layers: list[dict], heads: int, eps: float, act, pos_offset: int):
        self.w, self.layers, self.heads, self.eps, self.act, self.pos_offset = (
            weights, layers, heads, eps, act, pos_offset)
        self.hidden = weights["word"].shape[1]

    @classmethod
    def load(cls, spec: ModelSpec) -> "NumpyBert | None":
        """The model, or None when it is not a BERT-family model this (and packed/bert.py) serves."""
        cfg = spec.config
        if (spec.custom is not None or spec.model_type not in BERT_TYPES  # custom: the model's own first module
                or cfg.get("position_embedding_type", "absolute") != "absolute"
                or cfg.get("hidden_act", "gelu") not in _ACT):
            return None
        state = _load_state(spec.hf_dir)
        if state is None:
            return None
        sd = {k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias"): v
              for k, v in strip_prefix(state, "embeddings.word_embeddings.weight").items()}
        try:
            pos = sd["embeddings.position_embeddings.weight"]
            if "embeddings.token_type_embeddings.weight" in sd:  # single sentences: type 0, folded in
                pos = pos + sd["embeddings.token_type_embeddings.weight"][0]
            weights = {"word": sd["embeddings.word_embeddings.weight"], "pos": pos,
                       "ln_w": sd["embeddings.LayerNorm.weight"], "ln_b": sd["embeddings.LayerNorm.bias"]}
            layers = []
            for i in range(cfg["num_hidden_layers"]):
                p = f"encoder.layer.{i}."
                g = lambda n: sd[p + n]  # noqa: E731
                layers.append({  # matmul weights transposed once: x @ w
                    "qkv_w": np.ascontiguousarray(np.concatenate(
                        [g(f"attention.self.{n}.weight") for n in ("query", "key", "value")]).T),
                    "qkv_b": np.concatenate([g(f"attention.self.{n}.bias") for n in ("query", "key", "value")]),
                    "o_w": np.ascontiguousarray(g("attention.output.dense.weight").T), "o_b": g("attention.output.dense.bias"),
                    "ln1_w": g("attention.output.LayerNorm.weight"), "ln1_b": g("attention.output.LayerNorm.bias"),
                    "i_w": np.ascontiguousarray(g("intermediate.dense.weight").T), "i_b": g("intermediate.dense.bias"),
                    "out_w": np.ascontiguousarray(g("output.dense.weight").T), "out_b": g("output.dense.bias"),
                    "ln2_w": g("output.LayerNorm.weight"), "ln2_b": g("output.LayerNorm.bias"),
                })
        except KeyError as missing:
            raise ModelError(f"model {spec.path} lacks weight {missing} of a {spec.model_type} model") from None
        roberta = spec.model_type in ("roberta", "xlm-roberta", "camembert")
        offset = int(cfg.get("pad_token_id", 1)) + 1 if roberta else 0
        return cls(weights, layers, cfg["num_attention_heads"], cfg.get("layer_norm_eps", 1e-12),
                   _ACT[cfg.get("hidden_act", "gelu")], offset)

    def forward(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """ids [N, L] (right-padded), lengths [N] -> hidden states [N, L, H] (pads: anything)."""
        w, n, length, h = self.w, ids.shape[0], ids.shape[1], self.hidden
        # Rows of tokens, [N·L, H]: numpy hands 2-D matmuls to BLAS (3-D ones run far slower).
        x = (w["word"][ids] + w["pos"][self.pos_offset + np.arange(length)]).reshape(n * length, h)
        x = _layer_norm(x, w["ln_w"], w["ln_b"], self.eps)
        bias = np.where(np.arange(length)[None, :] < lengths[:, None], 0.0, -np.inf).astype(np.float32)
        bias = bias[:, None, None, :]  # [N, 1, 1, L]: no query looks at a pad
        head = h // self.heads
        scale = np.float32(1.0 / math.sqrt(head))
        for L in self.layers:
            qkv = (x @ L["qkv_w"] + L["qkv_b"]).reshape(n, length, 3, self.heads, head).transpose(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]  # [N, heads, L, d]
            s = q @ k.transpose(0, 1, 3, 2) * scale + bias
            s = np.exp(s - s.max(-1, keepdims=True))
            a = ((s / s.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(n * length, h)
            x = _layer_norm(x + a @ L["o_w"] + L["o_b"], L["ln1_w"], L["ln1_b"], self.eps)
            m = self.act(x @ L["i_w"] + L["i_b"]) @ L["out_w"] + L["out_b"]
            x = _layer_norm(x + m, L["ln2_w"], L["ln2_b"], self.eps)
        return x.reshape(n, length, h)

    def embed(self, ids: np.ndarray, lengths: np.ndarray, pooling: str, dim: int, post: list = (),
              skip: int = 0) -> np.ndarray:
        """Packed ids (any order) -> pooled, through the modules after the pooling (`post_ops`), truncated,
        L2-normalised float32 vectors [N, dim]. `skip`: each sequence's first tokens left out of the pooling
        (a prompt, where the model's Pooling has `include_prompt: false`)."""
        n = len(lengths)
        out = np.empty((n, dim), np.float32)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        order = np.argsort(-lengths, kind="stable")
        i = 0
        while i < n:  # longest first, as many as fit the padded budget
            longest = int(lengths[order[i]])
            j = min(n, i + max(1, _BATCH_TOKENS // max(longest, 1)))
            rows = order[i:j]
            lens = lengths[rows]
            ids_b = np.zeros((len(rows), longest), np.int64)
            for r, (s, ln) in enumerate(zip(starts[rows], lens)):
                ids_b[r, :ln] = ids[s : s + ln]
            h = self.forward(ids_b, lens)
            if pooling == "cls":
                pooled = h[np.arange(len(rows)), np.where(lens > skip, skip, 0)]
            elif pooling == "lasttoken":
                pooled = h[np.arange(len(rows)), lens - 1]
            else:
                at = np.arange(longest)[None, :]
                keep = ((at < lens[:, None]) & (at >= skip)).astype(np.float32)
                pooled = (h * keep[:, :, None]).sum(1) / np.maximum(lens - skip, 1)[:, None].astype(np.float32)
            for kind, d, act in post:
                if kind == "normalize":
                    pooled = _unit(pooled)
                    continue
                out = act(pooled @ d.weight.T + (0.0 if d.bias is None else d.bias))
                if d.residual:
                    out = out + (pooled if d.residual_weight is None else pooled @ d.residual_weight.T)
                pooled = out
            pooled = pooled[:, :dim]
            out[rows] = pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
            i = j
        return out


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


_NP_ACTIVATIONS = {"Identity": lambda x: x, "Tanh": np.tanh, "ReLU": lambda x: np.maximum(x, 0), "GELU": _gelu,
                   "Sigmoid": lambda x: 1 / (1 + np.exp(-x)), "SiLU": lambda x: x / (1 + np.exp(-x))}


def post_ops(spec: ModelSpec) -> list:
    """The model's modules after its pooling (Dense, Normalize) as numpy ops."""
    ops = []
    for kind, d in spec.post:
        if kind == "normalize":
            ops.append(("normalize", None, None))
        else:
            ops.append(("dense", d.weights(), _NP_ACTIVATIONS[d.activation]))
    return ops


class QueryEncoder:
    """Vectors for a few texts at a time, as `Encoder(model).encode(texts, prompt)` makes them.

    device "cpu": numpy for BERT-family models (no torch import), else `Encoder` on the CPU;
    "cuda"/"cuda:N"/"auto": `Encoder` there (eager for small work: no compile, no helper processes).
    """

    def __init__(self, model=None, device: str = "cpu", dim: int | None = None, settings=None,
                 trust_remote_code: bool = False, task: str | None = None):
        spec = read_spec(resolve_model(model))
        spec.check_task(task)
        self.spec, self.name = spec, model_name(model, spec.path)
        self._np = NumpyBert.load(spec) if device == "cpu" else None
        if self._np is not None:
            hidden = spec.output_dim(self._np.hidden)
            self._post = post_ops(spec)
            if dim is not None and not 0 < int(dim) <= hidden:
                raise ModelError(f"--dim {dim} is out of range: {spec.path.name} makes {hidden}-dimensional vectors.")
            self.dim, self.path, self.device = int(dim) if dim else hidden, "numpy", "cpu"
            self._tok = model_tokenizer(spec).build(0, shortcuts=False)
            self._enc = None
        else:
            from embedfleet.encode.encoder import Encoder

            self._enc = Encoder(model, device=device, dim=dim, tokenizer_workers=0, settings=settings,
                                trust_remote_code=trust_remote_code, task=task)
            self.dim, self.path, self.device = self._enc.dim, self._enc.path, self._enc.device

    def encode(self, texts: list[str], prompt: str | None = "query") -> np.ndarray:
        """[len(texts), dim] float32, L2-normalised, input order; `prompt` as Encoder.encode takes it."""
        return self.encode_counted(texts, prompt)[0]

    def encode_counted(self, texts: list[str], prompt: str | None = "query") -> tuple[np.ndarray, np.ndarray]:
        """(encode's vectors, each text's tokens: its prompt included, after truncation)."""
        texts = list(texts)
        if self._enc is not None:
            tok = self._enc.tokenize(texts, prompt, pool=False)
            return self._enc.embed(tok), tok.lengths[tok.inverse].astype(np.int64)
        if not texts:
            return np.zeros((0, self.dim), np.float32), np.zeros(0, np.int64)
        prefix = self.spec.prompt_text(prompt)
        ids, lengths = self._tok.encode_unsorted([prefix + t for t in texts])
        lengths = lengths.astype(np.int64)
        skip = 0 if self.spec.include_prompt else self._tok.prompt_tokens(prefix)
        return self._np.embed(ids, lengths, self.spec.pooling, self.dim, self._post, skip), lengths

    def describe(self) -> dict:
        return {"model": str(self.spec.path), "name": self.name, "path": self.path, "device": self.device,
                "dim": self.dim}

    def close(self) -> None:
        if self._enc is not None:
            self._enc.close()
