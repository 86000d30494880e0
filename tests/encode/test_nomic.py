"""NomicBert (nomic-embed-text v1/v1.5) on the packed path: a tiny random model built with transformers' own
config class, its attention sharpened so that positions (RoPE) matter, embeds as sentence-transformers does,
with and without its prompt. The same weights under the checkpoints' own names and config keys, with the
`auto_map` nomic ships, run on the packed path without --trust-remote-code and give the same vectors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from embedfleet.encode.encoder import Encoder
from embedfleet.encode.shapes import build_random_model
from embedfleet.synth import world_texts

TEXTS = world_texts(40, seed=1) + ["the charger broke after two days " * 30, "é", "電池 充電 画面"]


@pytest.fixture(scope="module")
def nomic(tmp_path_factory):
    from safetensors.numpy import load_file, save_file

    path = build_random_model("nomic-embed-v1.5", tmp_path_factory.mktemp("nomic") / "native", tiny=True)
    sd = load_file(str(path / "model.safetensors"))
    sd = {k: v * 20 if k.endswith(("q_proj.weight", "k_proj.weight")) else v * 3 if k.endswith("v_proj.weight") else v
          for k, v in sd.items()}
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _st(path, prompt=None, texts=TEXTS):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu").encode(texts, normalize_embeddings=True, prompt_name=prompt)


@pytest.mark.parametrize("prompt", [None, "query"])
def test_nomic_bert_packed_matches_sentence_transformers(nomic, prompt, monkeypatch):
    from embedfleet.encode.packed import nomic as packed_nomic

    enc = Encoder(str(nomic), device="cpu")
    assert enc.path == "packed"
    want = _st(nomic, prompt)
    got = enc.encode(TEXTS, prompt=prompt)
    assert got.shape == want.shape and (got * want).sum(1).min() >= 0.9999
    if prompt:  # the prompt is there: without it the vectors differ
        assert (enc.encode(TEXTS[:5]) * want[:5]).sum(1).max() < 0.9999
    monkeypatch.setattr(packed_nomic, "rope", lambda x, cos, sin: x)  # positions matter to this model
    assert (Encoder(str(nomic), device="cpu").encode(TEXTS, prompt=prompt) * want).sum(1).min() < 0.999


def test_the_checkpoints_own_names_and_config_run_packed_without_remote_code(nomic, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    own = tmp_path / "own"
    shutil.copytree(nomic, own)
    sd = load_file(str(nomic / "model.safetensors"))
    renamed = {"embeddings.word_embeddings.weight": sd["embeddings.word_embeddings.weight"],
               "embeddings.token_type_embeddings.weight": sd["embeddings.token_type_embeddings.weight"],
               "emb_ln.weight": sd["embeddings.LayerNorm.weight"], "emb_ln.bias": sd["embeddings.LayerNorm.bias"]}
    cfg = json.loads((nomic / "config.json").read_text())
    for i in range(cfg["num_hidden_layers"]):
        p, q = f"layers.{i}.", f"encoder.layers.{i}."
        renamed[q + "attn.Wqkv.weight"] = np.concatenate([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        for a, b in (("attn.out_proj", "self_attn.o_proj"), ("mlp.fc11", "mlp.up_proj"), ("mlp.fc12", "mlp.gate_proj"),
                     ("mlp.fc2", "mlp.down_proj")):
            renamed[q + a + ".weight"] = sd[p + b + ".weight"]
        for a, b in (("norm1", "post_attention_layernorm"), ("norm2", "post_mlp_layernorm")):
            renamed[q + a + ".weight"], renamed[q + a + ".bias"] = sd[p + b + ".weight"], sd[p + b + ".bias"]
    save_file(renamed, str(own / "model.safetensors"), metadata={"format": "pt"})
    (own / "config.json").write_text(json.dumps({  # as nomic-embed-text-v1.5 ships it
        "architectures": ["NomicBertModel"], "model_type": "nomic_bert", "activation_function": "swiglu",
        "auto_map": {"AutoConfig": "nomic-ai/nomic-bert-2048--configuration_hf_nomic_bert.NomicBertConfig",
                     "AutoModel": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel"},
        "n_embd": cfg["hidden_size"], "n_head": cfg["num_attention_heads"], "n_layer": cfg["num_hidden_layers"],
        "n_inner": cfg["intermediate_size"], "n_positions": 8192, "layer_norm_epsilon": 1e-12, "prenorm": False,
        "qkv_proj_bias": False, "rotary_emb_base": 1000, "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False,
        "type_vocab_size": 2, "vocab_size": cfg["vocab_size"], "torch_dtype": "float32"}))
    enc = Encoder(str(own), device="cpu")
    assert enc.path == "packed" and enc.dim == cfg["hidden_size"]
    got = enc.encode(TEXTS, prompt="document")
    assert (got * _st(nomic, "document")).sum(1).min() >= 0.9999
    # its position limit is n_positions: a sequence past 512 tokens is embedded whole, as sentence-transformers does
    for d in (own, nomic):
        (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 1024, "do_lower_case": False}))
    enc = Encoder(str(own), device="cpu")
    assert enc.max_seq_length == 1024
    long = ["the charger broke after two days, and the cable frayed " * 70]
    assert (enc.encode(long) * _st(nomic, texts=long)).sum() >= 0.9999


def test_a_variant_the_packed_path_does_not_compute_needs_its_own_code(nomic, tmp_path):
    import shutil

    from embedfleet.encode import packed
    from embedfleet.encode.models import read_spec, remote_code
    from embedfleet.errors import ModelError

    for change in ({"activation_function": "gelu"}, {"moe_every_n_layers": 2, "num_experts": 8},
                   {"rotary_scaling_factor": 2.0}, {"qkv_proj_bias": True}):
        variant = tmp_path / "-".join(change)
        shutil.copytree(nomic, variant)
        cfg = json.loads((variant / "config.json").read_text())
        cfg.update(change, auto_map={"AutoModel": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel"})
        (variant / "config.json").write_text(json.dumps(cfg))
        spec = read_spec(variant)
        assert not packed.supports(spec) and remote_code(spec) is not None
        with pytest.raises(ModelError, match="--trust-remote-code"):
            Encoder(str(variant), device="cpu")
