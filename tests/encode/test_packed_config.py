"""The packed paths read ModernBERT's and Gemma3's config.json without transformers: what they read must be what
transformers' own config classes make of the same file, for today's layout and the older ones real checkpoints
carry."""

import json
import subprocess
import sys

import pytest

from embedfleet.encode.packed.config import gemma3_config, modernbert_config
from embedfleet.encode.shapes import build_random_model
from embedfleet.errors import ModelError

FIELDS = {
    "modernbert": ("hidden_size", "num_hidden_layers", "num_attention_heads", "hidden_activation", "norm_eps",
                   "layer_types", "sliding_window"),
    "gemma3": ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "hidden_activation", "rms_norm_eps", "query_pre_attn_scalar", "attn_logit_softcapping",
               "use_bidirectional_attention", "layer_types", "sliding_window"),
}
# config.json as checkpoints published before transformers 5 wrote them
MODERNBERT_LEGACY = {"hidden_size": 768, "num_hidden_layers": 22, "num_attention_heads": 12, "intermediate_size": 1152,
                     "global_attn_every_n_layers": 3, "global_rope_theta": 160000.0, "local_rope_theta": 10000.0,
                     "local_attention": 128, "hidden_activation": "gelu", "norm_eps": 1e-05}
MODERNBERT_LARGE_THETA = {**MODERNBERT_LEGACY, "num_hidden_layers": 28, "global_rope_theta": 80000.0,
                          "local_attention": 256, "global_attn_every_n_layers": 4}
EMBEDDINGGEMMA_LEGACY = {"hidden_size": 768, "num_hidden_layers": 24, "num_attention_heads": 3, "num_key_value_heads": 1,
                         "head_dim": 256, "intermediate_size": 1152, "query_pre_attn_scalar": 256, "rope_theta": 1000000.0,
                         "rope_local_base_freq": 10000.0, "sliding_window": 512, "use_bidirectional_attention": True,
                         "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-06, "sliding_window_pattern": 6}
GEMMA3_CAUSAL_SCALED = {**EMBEDDINGGEMMA_LEGACY, "use_bidirectional_attention": False, "sliding_window": 1024,
                        "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
# layouts no known checkpoint has, read as transformers reads them all the same
MODERNBERT_WINDOW_KEY = {**MODERNBERT_LEGACY, "sliding_window": 32}
GEMMA3_FLAT_ROPE = {**EMBEDDINGGEMMA_LEGACY, "rope_parameters": {"rope_type": "default", "rope_theta": 5.0}}
GEMMA3_NO_WINDOW = {**EMBEDDINGGEMMA_LEGACY, "use_bidirectional_attention": False, "sliding_window": None}


def _theirs(family: str, cfg: dict) -> dict:
    """What transformers' config class makes of `cfg`, in a process of its own (its import is what the readers avoid)."""
    code = f"""
import json, sys
from transformers import {'ModernBertConfig as C' if family == 'modernbert' else 'Gemma3TextConfig as C'}
cfg = json.loads(sys.stdin.read())
c = C(**{{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}})
rope = {{k: {{"rope_type": v.get("rope_type"), "rope_theta": v.get("rope_theta"), "factor": v.get("factor")}}
        for k, v in c.rope_parameters.items() if k in ("full_attention", "sliding_attention")}}
print(json.dumps({{**{{f: getattr(c, f) for f in {FIELDS[family]!r}}}, "rope": rope}}))
"""
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(cfg), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def _ours(family: str, cfg: dict) -> dict:
    c = (modernbert_config if family == "modernbert" else gemma3_config)(cfg)
    rope = {k: {"rope_type": v.get("rope_type"), "rope_theta": v.get("rope_theta"), "factor": v.get("factor")}
            for k, v in c.rope_parameters.items()}
    return json.loads(json.dumps({**{f: getattr(c, f) for f in FIELDS[family]}, "rope": rope}))


@pytest.mark.parametrize("family,shape", [("modernbert", "modernbert-base"), ("gemma3", "gemma3-300m")])
def test_a_config_written_by_transformers_reads_the_same(tmp_path, family, shape):
    cfg = json.loads((build_random_model(shape, tmp_path, tiny=True) / "config.json").read_text())
    assert _ours(family, cfg) == _theirs(family, cfg)


@pytest.mark.parametrize("family,name", [
    ("modernbert", "MODERNBERT_LEGACY"), ("modernbert", "MODERNBERT_LARGE_THETA"), ("modernbert", "MODERNBERT_WINDOW_KEY"),
    ("gemma3", "EMBEDDINGGEMMA_LEGACY"), ("gemma3", "GEMMA3_CAUSAL_SCALED"), ("gemma3", "GEMMA3_FLAT_ROPE"),
    ("gemma3", "GEMMA3_NO_WINDOW")])
def test_an_older_config_json_reads_as_transformers_reads_it(family, name):
    cfg = globals()[name]
    ours = _ours(family, cfg)
    assert ours == _theirs(family, cfg)
    scaled = {k: v["rope_type"] for k, v in ours["rope"].items() if v["rope_type"] != "default"}
    assert scaled == ({"full_attention": "linear"} if name == "GEMMA3_CAUSAL_SCALED" else {})


@pytest.mark.parametrize("read", [modernbert_config, gemma3_config])
def test_layer_types_that_do_not_match_the_layers_are_one_line(read):
    with pytest.raises(ModelError, match="3 layer_types for 4 layers"):
        read({"num_hidden_layers": 4, "layer_types": ["full_attention"] * 3})


def test_the_packed_readers_do_not_import_transformers():
    code = ("import sys, json\nfrom embedfleet.encode.packed.config import gemma3_config, modernbert_config\n"
            "modernbert_config({}); gemma3_config({})\nprint('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
