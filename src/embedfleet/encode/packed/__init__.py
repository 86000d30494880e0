"""Native packed forward passes, loaded straight from safetensors (no transformers model object).

`build(spec, device, dtype)` returns a model for the architectures written here, or None, in
which case the encoder uses the generic transformers fallback.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

BERT_TYPES = ("bert", "roberta", "xlm-roberta", "camembert")
DECODER_TYPES = ("qwen3", "qwen2", "llama")


def load_state(hf_dir: Path) -> dict[str, torch.Tensor] | None:
    """All tensors of model.safetensors (or its shards) on the CPU, or None if there are none."""
    from safetensors.torch import load_file

    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (hf_dir / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        return None
    state = {}
    for f in files:
        state.update(load_file(str(hf_dir / f)))
    return state


def strip_prefix(state: dict[str, torch.Tensor], anchor: str) -> dict[str, torch.Tensor]:
    """Drop whatever wrapper prefix ('bert.', 'model.', ...) sits before `anchor`'s key."""
    key = next((k for k in state if k.endswith(anchor)), None)
    if key is None:
        return {}
    cut = len(key) - len(anchor)
    return {k[cut:]: v for k, v in state.items() if k.startswith(key[:cut])}


def fused(fn, device: torch.device):
    """torch.compile `fn` on CUDA (fuses norms, RoPE, activations and residual adds between the
    matmuls, which otherwise cost more GPU time than the matmuls themselves); eager elsewhere, when
    EMBEDFLEET_COMPILE=0, or if compiling fails."""
    if device.type != "cuda" or os.environ.get("EMBEDFLEET_COMPILE", "1") == "0":
        return fn
    compiled = torch.compile(fn)
    state = {"fn": compiled}

    def call(*args):
        try:
            return state["fn"](*args)
        except Exception as err:  # noqa: BLE001 - any compiler failure: run eager, say so once
            if state["fn"] is fn:
                raise
            log.warning("torch.compile failed (%s); running the eager forward", str(err).splitlines()[0])
            state["fn"] = fn
            return fn(*args)

    return call


def build(spec, device: torch.device, dtype: torch.dtype):
    cfg, mtype = spec.config, spec.model_type
    if mtype not in BERT_TYPES + DECODER_TYPES:
        return None
    state = load_state(spec.hf_dir)
    if state is None:
        return None
    if mtype in BERT_TYPES:
        from embedfleet.encode.packed.bert import PackedBert

        return PackedBert.create(cfg, state, device, dtype)
    from embedfleet.encode.packed.qwen3 import PackedDecoder

    return PackedDecoder.create(cfg, state, device, dtype, spec.max_seq_length)
