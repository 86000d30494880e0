"""Native packed forward passes, loaded straight from safetensors (no transformers model object).

`build(spec, device, dtype)` returns a model for the architectures written here, or None, in
which case the encoder uses the generic transformers fallback.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from collections.abc import Mapping
from pathlib import Path

import torch

from embedfleet.errors import ModelError
from embedfleet.encode.models import (BERT_TYPES, DECODER_TYPES, GEMMA_TYPES, NOMIC_TYPES, ROPE_ENCODER_TYPES,
                                      packed_type, read_weights, strip_prefix)

KERNEL_TYPES = DECODER_TYPES + ROPE_ENCODER_TYPES + GEMMA_TYPES  # the families with Triton glue kernels

__all__ = ["BERT_TYPES", "DECODER_TYPES", "KERNEL_TYPES", "OnDevice", "build", "glue_kernels", "import_kernels_aside",
           "kernels_apply", "load_kernels_aside", "load_state", "start_glue", "strip_prefix", "supports"]

log = logging.getLogger(__name__)


def load_state(hf_dir: Path) -> dict[str, torch.Tensor] | None:
    """All tensors of model.safetensors (or its shards) on the CPU, or None if there are none."""
    from safetensors.torch import load_file

    return read_weights(hf_dir, lambda f: load_file(str(f)))


def kernels_apply(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the Triton kernels (`kernels.py`) serve this model: CUDA, half precision, a power-of-two half head
    (the RoPE kernel's tile), Triton installed. Elsewhere the torch glue (compiled in the background) does the same."""
    half = head_dim // 2
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and not half & (half - 1)
            and importlib.util.find_spec("triton") is not None)


def glue_kernels(device: torch.device, dtype: torch.dtype, head_dim: int):
    """The Triton kernels module where `kernels_apply`, else None."""
    if not kernels_apply(device, dtype, head_dim):
        return None
    try:
        from embedfleet.encode.packed import kernels
    except ImportError:
        return None
    return kernels


def import_kernels_aside(spec, device: torch.device) -> None:
    """Start importing Triton and the kernels module, on a thread, for a model whose glue they may serve: its weights
    load meanwhile, and the thread that later loads its kernels (`load_kernels_aside`) finds them imported."""
    if not (device.type == "cuda" and supports(spec) and spec.model_type in KERNEL_TYPES
            and importlib.util.find_spec("triton") is not None):
        return

    def run() -> None:
        try:
            from embedfleet.encode.packed import kernels  # noqa: F401
        except Exception:  # noqa: BLE001 - the model's own load of them says why
            pass

    # not a daemon: an import cut short by the process's end would leave a half-made module behind
    threading.Thread(target=run, name="embedfleet-triton").start()


def start_glue(model, fns, device: torch.device, compile: bool, use_kernels: bool) -> list:
    """`fns`, the model's torch glue (Fused on CUDA, compiled in the background once enough work came), set up on
    `model` (its `kernels`, `kernels_loaded`, `fused`): where the Triton kernels serve it (`use_kernels`), they
    start loading on their thread and nothing compiles."""
    from embedfleet.encode.compile import fused

    model.kernels, model.kernels_loaded = None, threading.Event()
    parts = [fused(f, device, compile) for f in fns]
    model.fused = [] if use_kernels else parts  # what a BackgroundCompile compiles
    if use_kernels:
        load_kernels_aside(model, device)
    else:
        model.kernels_loaded.set()
    return parts


def load_kernels_aside(model, device: torch.device) -> None:
    """Hand `model` the Triton kernels (its `kernels`) once they have run one small batch through its
    `_with_kernels`, on a thread of their own: a machine's first use compiles them (seconds), later ones read
    them from the cache, and meanwhile the model's glue runs as torch ops. `model.kernels_loaded` is set
    either way; a failure leaves the torch glue, eager (nothing was set to compile), said once."""

    def load() -> None:
        try:
            from embedfleet.encode.packed import kernels
            from embedfleet.encode.packed.attention import Packing, token_layout

            # on the device's default stream, after the weights and before the callers' later batches: no stream
            # of its own, whose reads nothing would order after the writes they need
            with torch.inference_mode(), torch.cuda.device(device):
                lengths = torch.tensor([3, 6], dtype=torch.int32, device=device)
                cu, seg, pos = token_layout(lengths, 9)
                model._with_kernels(torch.ones(9, dtype=torch.long, device=device),
                                    Packing(cu=cu, max_len=6, seg=seg, pos=pos, lengths=lengths), kernels)
                done = torch.cuda.Event()
                done.record()
                done.synchronize()
            model.kernels = kernels
        except Exception as err:  # noqa: BLE001 - any compiler failure: the torch glue stays
            log.warning("Triton kernels for %s unavailable (%s); its glue runs as torch ops", type(model).__name__,
                        str(err).splitlines()[0] if str(err) else type(err).__name__)
        finally:
            model.kernels_loaded.set()

    # not a daemon, as the background compile: a process ending meanwhile waits for it, not tear CUDA down under it
    threading.Thread(target=load, name="embedfleet-kernels").start()


class OnDevice(Mapping):
    """A state dict whose tensors move to `device` as each is read, so the model's concatenations and casts
    run there, one tensor at a time (no second copy of the whole model). On the CPU they ran on torch's
    threads, one per core in every worker, and workers starting together slowed each other
    (docs/decisions/model-build-on-device.md)."""

    def __init__(self, state: Mapping[str, torch.Tensor], device):
        self._state, self._device = state, device

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._state[name].to(self._device)

    def __contains__(self, name) -> bool:  # without moving the tensor (Mapping's own reads it)
        return name in self._state

    def __iter__(self):
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


def supports(spec) -> bool:
    """Whether a packed forward pass is written here for this model's type (and its first module is not the
    model's own code)."""
    return spec.custom is None and packed_type(spec)


def build(spec, device: torch.device, dtype: torch.dtype, state: dict[str, torch.Tensor] | None = None, *,
          compile: bool = True, triton: bool = True):
    """The packed model on `device`, from `state` (the weights on the CPU; read here when None), or
    None when this model needs the generic path. `compile`: its glue may be compiled (Settings.compile);
    `triton`: Triton kernels where written (Settings.triton)."""
    mtype = spec.model_type
    if not supports(spec):
        return None
    state = load_state(spec.hf_dir) if state is None else state
    if state is None:
        return None
    try:
        return _create(spec, device, dtype, state, compile, triton)
    except KeyError as e:  # a model of another type's weights, or a file saved without some: never random ones
        raise ModelError(f"model {spec.path}: its weights lack {e.args[0]!r} of a {mtype} model: not this config's "
                         "trained weights, or saved incompletely") from None


def _create(spec, device: torch.device, dtype: torch.dtype, state: dict, compile: bool, triton: bool):
    cfg, mtype = spec.config, spec.model_type
    if mtype in BERT_TYPES:
        from embedfleet.encode.packed.bert import PackedBert

        return PackedBert.create(cfg, state, device, dtype, compile=compile)
    if mtype in ROPE_ENCODER_TYPES:
        from embedfleet.encode.packed.modernbert import PackedModernBert

        return PackedModernBert.create(cfg, state, device, dtype, spec.max_seq_length, compile=compile, triton=triton)
    if mtype in NOMIC_TYPES:
        from embedfleet.encode.packed.nomic import PackedNomicBert

        return PackedNomicBert.create(cfg, state, device, dtype, spec.max_seq_length, compile=compile)
    if mtype in GEMMA_TYPES:
        from embedfleet.encode.packed.gemma3 import PackedGemma3

        return PackedGemma3.create(cfg, state, device, dtype, spec.max_seq_length, compile=compile, triton=triton)
    from embedfleet.encode.packed.qwen3 import PackedDecoder

    return PackedDecoder.create(cfg, state, device, dtype, spec.max_seq_length, compile=compile, triton=triton)
