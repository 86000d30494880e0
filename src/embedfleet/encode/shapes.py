"""Random-weight models of real shapes, built offline, for benchmarks and tests.

Speed depends on shapes and token counts, not on trained weights, and the GPU machines have no
internet. BERT shapes reuse the bundled MiniLM WordPiece tokenizer. The Qwen3 shape gets a
tokenizer derived from it that splits ~30% of longer words into pieces, giving ~1.3 tokens per
English word as real BPE tokenizers do, and appends EOS for last-token pooling.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from embedfleet.encode.models import bundled_model_dir
from embedfleet.errors import InputError

QWEN_QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
EOS = "<|endoftext|>"

SHAPES = {
    "minilm-l6": dict(model_type="bert", architectures=["BertModel"], hidden_size=384, num_hidden_layers=6,
                      num_attention_heads=12, intermediate_size=1536, max_seq_length=256, pooling="mean"),
    "bert-base": dict(model_type="bert", architectures=["BertModel"], hidden_size=768, num_hidden_layers=12,
                      num_attention_heads=12, intermediate_size=3072, max_seq_length=512, pooling="cls"),
    "modernbert-base": dict(model_type="modernbert", architectures=["ModernBertModel"], hidden_size=768,
                            num_hidden_layers=22, num_attention_heads=12, intermediate_size=1152, max_seq_length=512,
                            pooling="mean"),
    "modernbert-large": dict(model_type="modernbert", architectures=["ModernBertModel"], hidden_size=1024,
                             num_hidden_layers=28, num_attention_heads=16, intermediate_size=2624, max_seq_length=512,
                             pooling="mean"),
    # EmbeddingGemma-300m: bidirectional Gemma3, then two Dense modules after the mean pooling
    "gemma3-300m": dict(model_type="gemma3_text", architectures=["Gemma3TextModel"], hidden_size=768,
                        num_hidden_layers=24, num_attention_heads=3, num_key_value_heads=1, head_dim=256,
                        intermediate_size=1152, max_seq_length=512, pooling="mean", dense=[3072, 768]),
    # nomic-embed-text-v1.5: post-norm BERT with RoPE and SwiGLU, its prompts "search_document: " and "search_query: "
    "nomic-embed-v1.5": dict(model_type="nomic_bert", architectures=["NomicBertModel"], hidden_size=768,
                             num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                             max_seq_length=8192, pooling="mean"),
    "qwen3-0.6b": dict(model_type="qwen3", architectures=["Qwen3Model"], hidden_size=1024, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                       max_seq_length=32768, pooling="lasttoken"),
}
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128)
BERT_BASE = dict(vocab_size=30522, hidden_act="gelu", max_position_embeddings=512, type_vocab_size=2,
                 layer_norm_eps=1e-12, pad_token_id=0, position_embedding_type="absolute")
MODERNBERT_BASE = dict(vocab_size=50368, hidden_activation="gelu", max_position_embeddings=8192, norm_eps=1e-5,
                       norm_bias=False, attention_bias=False, mlp_bias=False, global_rope_theta=160000.0,
                       local_rope_theta=10000.0, local_attention=128, global_attn_every_n_layers=3, pad_token_id=0,
                       bos_token_id=101, eos_token_id=102, cls_token_id=101, sep_token_id=102)
GEMMA3_BASE = dict(vocab_size=262144, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                   query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6, rope_theta=1000000.0,
                   rope_local_base_freq=10000.0, use_bidirectional_attention=True, attention_bias=False,
                   max_position_embeddings=2048, pad_token_id=0, bos_token_id=101, eos_token_id=102)
# A tiny Gemma3 keeps both kinds of layer and a window (4 positions each side) shorter than a review.
TINY_GEMMA3 = dict(num_hidden_layers=4, sliding_window_pattern=2, sliding_window=8, query_pre_attn_scalar=16,
                   vocab_size=30522)
# A tiny ModernBERT keeps both kinds of layer (global every third) and a window shorter than a review.
TINY_MODERNBERT = dict(num_hidden_layers=4, local_attention=8)
NOMIC_BASE = dict(vocab_size=30528, hidden_act="silu", max_position_embeddings=8192, type_vocab_size=2,
                  layer_norm_eps=1e-12, pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
NOMIC_PROMPTS = {"query": "search_query: ", "document": "search_document: "}
QWEN3_BASE = dict(vocab_size=151669, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
                  rope_theta=1000000.0, tie_word_embeddings=True, attention_bias=False, use_sliding_window=False,
                  bos_token_id=151643, eos_token_id=151643)


def build_random_model(shape: str, out_dir: str | Path, seed: int = 0, tiny: bool = False,
                       pooling: str | None = None, model_type: str | None = None, hidden: int | None = None) -> Path:
    """Write a sentence-transformers directory (config, safetensors, tokenizer, ST modules). `hidden`: another
    hidden size (the vectors' width), the rest of the shape kept (a tiny model with 4,096-dimensional vectors)."""
    if shape not in SHAPES:
        raise InputError(f"--shape {shape!r}: choose from {', '.join(SHAPES)}")
    spec = dict(SHAPES[shape])
    max_seq, pool = spec.pop("max_seq_length"), pooling or spec.pop("pooling")
    spec.pop("pooling", None)
    dense = spec.pop("dense", None)
    family = spec["model_type"]
    bert = family != "qwen3"  # a WordPiece tokenizer (the bundled MiniLM's)
    base = {"qwen3": QWEN3_BASE, "modernbert": MODERNBERT_BASE, "gemma3_text": GEMMA3_BASE,
            "nomic_bert": NOMIC_BASE}.get(family, BERT_BASE)
    tiny_extra = {"modernbert": TINY_MODERNBERT, "gemma3_text": TINY_GEMMA3}.get(family, {})
    cfg = {**base, **spec, **({**TINY, **tiny_extra} if tiny else {}), **({"hidden_size": hidden} if hidden else {})}
    if family not in ("qwen3", "gemma3_text"):
        cfg.pop("num_key_value_heads", None), cfg.pop("head_dim", None)
    if model_type:  # e.g. a tiny DistilBERT-like config that only the generic path serves
        cfg["model_type"], cfg["architectures"] = model_type, None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if bert:
        eos_id = None
        _copy_bert_tokenizer(out)
    else:
        eos_id = _write_qwen_tokenizer(out)
        cfg.update(eos_token_id=eos_id, bos_token_id=eos_id, pad_token_id=eos_id)
    if tiny and not bert:
        cfg["vocab_size"] = eos_id + 1
    if tiny:
        max_seq = min(max_seq, 128)
    dtype = "float32" if tiny or (bert and family != "gemma3_text") else "bfloat16"
    (out / "config.json").write_text(json.dumps({**cfg, "torch_dtype": dtype}, indent=1))
    _write_weights(out, cfg, seed, getattr(torch, dtype))
    _write_st_files(out, cfg["hidden_size"], max_seq, pool, prompts=NOMIC_PROMPTS if family == "nomic_bert" else
                    None if bert else {"query": QWEN_QUERY_PROMPT, "document": ""})
    if dense and not tiny:
        _write_dense(out, [cfg["hidden_size"], *dense], seed)
    return out


def _write_weights(out: Path, cfg: dict, seed: int, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModel

    conf = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.device("meta"):  # names and shapes only; the values are drawn below, fast
        names = {k: v.shape for k, v in AutoModel.from_config(conf).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in names.items():
        if name.endswith("position_ids"):
            continue
        if "norm" in name.lower() and name.endswith("weight"):
            w = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("bias"):
            w = 0.02 * torch.randn(shape, generator=gen)
        else:
            w = 0.02 * torch.randn(shape, generator=gen)
        state[name] = w.to(dtype).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def _copy_bert_tokenizer(out: Path) -> None:
    src = bundled_model_dir()
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(src / f, out / f)


def _write_qwen_tokenizer(out: Path) -> int:
    data = json.loads((bundled_model_dir() / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]

    def split(word: str) -> bool:  # deterministic ~30% of words of 5+ letters lose their whole-word entry
        return word.isalpha() and len(word) >= 5 and int(hashlib.md5(word.encode()).hexdigest(), 16) % 100 < 30

    kept = sorted((i, k) for k, i in vocab.items() if not split(k))
    renumber = {old: new for new, (old, _) in enumerate(kept)}  # no holes: transformers reads a vocabulary's size
    data["model"]["vocab"] = {k: renumber[i] for i, k in kept}
    for t in data["added_tokens"]:
        t["id"] = renumber[t["id"]]
    eos_id = len(kept)
    data["added_tokens"].append({"id": eos_id, "content": EOS, "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    data["post_processor"] = {"type": "TemplateProcessing",
                              "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": EOS, "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 0}},
                                       {"SpecialToken": {"id": EOS, "type_id": 0}}],
                              "special_tokens": {EOS: {"id": EOS, "ids": [eos_id], "tokens": [EOS]}}}
    data["padding"] = data["truncation"] = None
    (out / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS, "unk_token": "[UNK]",
        "model_max_length": 32768, "padding_side": "right", "do_lower_case": True}))
    return eos_id


def _write_dense(out: Path, widths: list[int], seed: int) -> None:
    """Dense modules (identity activation, as EmbeddingGemma's) between the pooling and the Normalize module."""
    from safetensors.torch import save_file

    modules = json.loads((out / "modules.json").read_text())
    norm = modules.pop()
    gen = torch.Generator().manual_seed(seed + 1)
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        folder = f"{2 + i}_Dense"
        (out / folder).mkdir(exist_ok=True)
        (out / folder / "config.json").write_text(json.dumps({"in_features": a, "out_features": b, "bias": False,
                                                              "activation_function": "torch.nn.modules.linear.Identity"}))
        save_file({"linear.weight": (0.02 * torch.randn(b, a, generator=gen)).contiguous()},
                  str(out / folder / "model.safetensors"), metadata={"format": "pt"})
        modules.append({"idx": 2 + i, "name": str(2 + i), "path": folder, "type": "sentence_transformers.models.Dense"})
    norm["idx"] = norm["name"] = len(modules)
    norm["name"] = str(norm["name"])
    modules.append(norm)
    (out / "modules.json").write_text(json.dumps(modules, indent=1))


def _write_st_files(out: Path, hidden: int, max_seq: int, pooling: str, prompts: dict | None) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (out / "modules.json").write_text(json.dumps(modules, indent=1))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq, "do_lower_case": False}))
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hidden, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_lasttoken": pooling == "lasttoken",
        "include_prompt": True}))
    st = {"prompts": prompts or {}, "default_prompt_name": None, "similarity_fn_name": "cosine"}
    (out / "config_sentence_transformers.json").write_text(json.dumps(st, indent=1))
