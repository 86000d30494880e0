"""The two kinds of settings, each read and validated once, then passed explicitly.

- JobConfig: what a job makes (inputs, model, template, table…), from flags or a YAML file. It is
  stored in the ledger, so a worker on any host needs only the job name and the database to run the
  same job (`embedfleet worker --job NAME --db DSN`).
- Settings: how a worker runs (lease, helpers, writers…), the tuning knobs, from flags and the
  EMBEDFLEET_* variables of the process that reads them (`Settings.from_env`, the only place that
  reads them). The launcher hands its Settings to each worker it starts; a Ray actor gets the object.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from embedfleet.errors import InputError

DEFAULT_CHUNK_BYTES = 2 << 20  # ~6k reviews: fine-grained claiming, short pipeline fill
# A CPU embeds ~100 reviews/s: 2 MB chunks would show no progress for a minute; 256 kB commit every few seconds.
CPU_CHUNK_BYTES = 256 << 10
DEFAULT_LEASE_SECONDS = 30.0
MAX_PARTITIONS = 1024  # a query plans each partition: PostgreSQL's docs speak of up to a few thousand


def default_chunk_bytes(device: str) -> int:
    """Bytes of input per chunk (and per committed unit of a stream) when --chunk-bytes is not given."""
    return CPU_CHUNK_BYTES if device == "cpu" else DEFAULT_CHUNK_BYTES


@dataclass
class JobConfig:
    inputs: list[str] = dataclasses.field(default_factory=list)
    meta: str | None = None
    preset: str | None = None  # None: amazon-reviews when --meta is given, else generic
    text_template: str | None = None
    text_field: str | None = None
    id_field: str | None = None
    model: str | None = None
    db: str | None = None
    table: str | None = None
    job: str | None = None
    devices: str = "auto"
    workers: int | None = None
    batch_tokens: int | str = "auto"
    chunk_bytes: int | None = None  # None: default_chunk_bytes(device) of the planning launcher / the worker
    limit: int | None = None
    no_index: bool = False
    quiet: bool = False
    dtype: str = "float"  # stored vector type: float -> vector, half -> halfvec
    dim: int | None = None  # Matryoshka truncation
    prompt: str | None = None  # prompt name for documents (models with a "document" prompt use it by default)
    passages: str | None = None  # "TOKENS[:OVERLAP]": each record as passages of at most TOKENS tokens
    partitions: int | None = None  # a new table as this many hash partitions of its id (None: one relation)
    columns: list[str] | None = None  # "NAME:TYPE" fields promoted from the records into typed columns

    # Fields that change what lands in the table. Two runs agreeing on these are the same job.
    _IDENTITY = (
        "inputs", "meta", "preset", "text_template", "text_field", "id_field", "model",
        "table", "chunk_bytes", "limit", "dtype", "dim", "prompt", "passages", "columns",
    )

    def fingerprint(self) -> str:
        # A field at its default is left out: a job planned before the field existed keeps its fingerprint.
        ident = {k: getattr(self, k) for k in self._IDENTITY
                 if k not in ("passages", "columns") or getattr(self, k) is not None}
        return hashlib.sha256(orjson.dumps(ident, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("db")  # a DSN may hold a password; workers get it from their own flags/env
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "JobConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def load_yaml(path: str | None) -> dict[str, Any]:
    """Flags from a YAML file (keys spelled like the flags, `-` or `_`)."""
    if not path:
        return {}
    import yaml

    p = Path(path)
    if not p.is_file():
        raise InputError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise InputError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a mapping of flag: value")
    known = {f.name for f in dataclasses.fields(JobConfig)}
    out = {}
    for k, v in data.items():
        key = str(k).replace("-", "_")
        if key not in known:
            raise InputError(f"{path}: unknown key '{k}'")
        out[key] = v
    return out


def typed(cls, values: dict[str, Any], source: str):
    """`cls(**values)` with every value's type checked against the field's annotation (strict: "5" is
    no int, 3.7 no int, "false" no bool); a wrong one is a one-line error naming the key and `source`."""
    import msgspec

    for key in ("inputs", "columns"):
        if isinstance(values.get(key), str):  # one input; "stars:int,lang:text"
            values = {**values, key: [values[key]] if key == "inputs" else values[key].split(",")}
    try:
        return msgspec.convert(values, cls, strict=True)
    except msgspec.ValidationError as e:
        msg, _, where = str(e).partition(" - at `$.")
        key = where.split("`")[0].split(".")[0].split("[")[0]
        flag = key.replace("_", "-")
        raise InputError(f"{source}: key '{key}' (--{flag}): {msg[:1].lower()}{msg[1:].replace('`', '')}") from None


def build_config(flags: dict[str, Any], yaml_path: str | None = None) -> JobConfig:
    """Merge YAML and flags (flags win when given), check each value's type, then validate."""
    merged = typed(JobConfig, load_yaml(yaml_path), yaml_path).__dict__ if yaml_path else {}
    merged.update({k: v for k, v in flags.items() if v is not None and v != [] and v is not False})
    if not merged.get("inputs"):
        raise InputError("no input given: embedfleet ingest FILE... (or `inputs:` in --config)")
    return validate(typed(JobConfig, merged, "flags"))


_DEVICES = re.compile(r"^(auto|cpu|cuda|cuda:\d+(,\d+)*)$")


def validate_devices(devices: str) -> str:
    if not _DEVICES.match(str(devices)):
        raise InputError(f"--devices {devices!r}: use auto, cpu, cuda or cuda:0,1,…")
    return devices


def validate(cfg: JobConfig) -> JobConfig:
    validate_devices(cfg.devices)
    if cfg.workers is not None and int(cfg.workers) < 1:
        raise InputError("--workers must be at least 1")
    bt = str(cfg.batch_tokens)
    if bt != "auto" and not (bt.isdigit() and int(bt) >= 16):
        raise InputError(f"--batch-tokens {bt!r}: use auto or a number of tokens ≥ 16")
    if cfg.chunk_bytes is not None and int(cfg.chunk_bytes) < 1024:
        raise InputError("--chunk-bytes must be at least 1024")
    if cfg.limit is not None and int(cfg.limit) < 0:
        raise InputError("--limit must be ≥ 0")
    if cfg.dtype not in ("float", "half"):
        raise InputError(f"--dtype {cfg.dtype!r}: use float (vector) or half (halfvec)")
    if cfg.partitions is not None and not 2 <= cfg.partitions <= MAX_PARTITIONS:
        raise InputError(f"--partitions {cfg.partitions}: use 2 to {MAX_PARTITIONS}, or leave it out for one relation")
    from embedfleet.encode.passages import parse_passages

    parse_passages(cfg.passages)
    if cfg.text_template and cfg.text_field:
        raise InputError("give --text-field or --text-template, not both")
    if cfg.preset is None:
        cfg.preset = "amazon-reviews" if cfg.meta else "generic"
    from embedfleet.sources.presets import PRESETS  # here, not at the top: config stays light to import

    if cfg.preset not in PRESETS:
        raise InputError(f"--preset {cfg.preset!r}: choose one of {', '.join(PRESETS)}")
    if cfg.meta and cfg.preset != "amazon-reviews":
        raise InputError("--meta joins product metadata and needs --preset amazon-reviews")
    from embedfleet.sources.presets import job_preset

    job_preset(cfg.preset, cfg.columns)  # names and types that can be columns
    return cfg


def _knob(default, env: str, doc: str):
    return dataclasses.field(default=default, metadata={"env": env, "doc": doc})


@dataclass(frozen=True)
class Settings:
    """Every tuning knob: its default, its variable and what it does (README's table lists the same)."""

    lease_seconds: float = _knob(DEFAULT_LEASE_SECONDS, "EMBEDFLEET_LEASE_SECONDS",
                                 "how long a claimed chunk stays a worker's without a heartbeat (renewed every third)")
    db_patience_seconds: float = _knob(300.0, "EMBEDFLEET_DB_PATIENCE",
                                       "how long a worker keeps reconnecting to a database that went away")
    helpers: int | None = _knob(None, "EMBEDFLEET_PREP_WORKERS",
                                "helper processes per worker (default: half its cores, at most 8, none under 4; 0: in-process)")
    helper_nice: int = _knob(0, "EMBEDFLEET_HELPER_NICE",
                             "how far below its worker a helper runs in the CPU's queue (0-19; 0: level with it)")
    tasks_ahead: int | None = _knob(None, "EMBEDFLEET_TASKS_AHEAD",
                                    "most units in preparation at once (default: 2 × helpers + 2)")
    writers: int | None = _knob(None, "EMBEDFLEET_WRITERS",
                                "writer connections per worker (default: 6 on a GPU, 3 on a CPU, fewer on a full server)")
    writer_depth: int | None = _knob(None, "EMBEDFLEET_WRITER_DEPTH", "units queued per writer connection (default 8 on a GPU, 2 on a CPU)")
    switch_interval: float = _knob(0.0005, "EMBEDFLEET_SWITCH_INTERVAL",
                                   "seconds a worker thread may hold the GIL before handing it over")
    # ~30 MB of arrays when full; past this, more misses are cheaper than more memory (bench/NOTES.md run 39).
    word_cache: int = _knob(1 << 18, "EMBEDFLEET_WORD_CACHE", "distinct words each tokenizer remembers")
    compile: bool = _knob(True, "EMBEDFLEET_COMPILE", "torch.compile the forward pass on CUDA (0: eager)")
    compile_wait: bool = _knob(False, "EMBEDFLEET_COMPILE_WAIT",
                               "an ingest worker's loop waits for its compile (default 0: starts eager, switches when ready)")
    compile_tokens: int | None = _knob(None, "EMBEDFLEET_COMPILE_TOKENS",
                                       "tokens of work before compiling starts (default 2^23, 2^18 once cached)")
    triton: bool = _knob(True, "EMBEDFLEET_TRITON",
                         "Triton kernels on CUDA: Qwen3's fused q/k-norm + RoPE, the trainer's take of a step's rows (0: off)")
    train_readers: int | None = _knob(None, "EMBEDFLEET_TRAIN_READERS",
                                      "connections one training read uses (default: a quarter of the cores, 1-4)")
    train_gather_threads: int | None = _knob(None, "EMBEDFLEET_TRAIN_GATHER_THREADS",
                                             "threads gathering a batch on the host in the ram tier (default: half the cores, ≤ 8)")
    train_graph: bool = _knob(True, "EMBEDFLEET_TRAIN_GRAPH",
                              "replay each training step on CUDA as one CUDA graph (0: every step eager)")
    host_id: str = _knob(socket.gethostname(), "EMBEDFLEET_HOST_ID",
                         "this host's name in the ledger: a dead worker's chunks are freed at once only on its own host")
    metrics_port: int | None = _knob(None, "EMBEDFLEET_METRICS_PORT",
                                     "serve Prometheus metrics of the job on this port (ingest, worker)")

    @classmethod
    def from_env(cls, environ=None, **flags) -> "Settings":
        """The knobs of this process: flags given (not None) win over EMBEDFLEET_* variables, which win
        over the defaults. A value that does not parse is a one-line error naming the variable."""
        environ = os.environ if environ is None else environ
        values = {}
        for f in dataclasses.fields(cls):
            if flags.get(f.name) is not None:
                values[f.name] = flags[f.name]
            elif (raw := environ.get(f.metadata["env"], "").strip()):
                values[f.name] = _parse_knob(f.metadata["env"], raw, f.type)
        return _checked(cls(**values))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Settings":
        return typed(cls, d, "settings")


_ACTIVE: Settings | None = None


def settings() -> Settings:
    """This process's knobs: the ones its Worker was handed (`use_settings`), else the environment's,
    read once. What the encoder reads deep down (compile, Triton, word cache) comes from here."""
    global _ACTIVE
    if _ACTIVE is None:
        _ACTIVE = Settings.from_env()
    return _ACTIVE


def use_settings(s: Settings) -> None:
    """Make `s` this process's knobs (a worker given its launcher's Settings, in a process or an actor)."""
    global _ACTIVE
    _ACTIVE = s


def _parse_knob(name: str, raw: str, kind: str):
    """An environment variable's text as the knob's type ("int | None", "float", "bool", "str")."""
    if kind.startswith("str"):
        return raw
    try:
        if kind.startswith("bool"):
            return {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}[raw.lower()]
        return float(raw) if kind.startswith("float") else int(raw)
    except (KeyError, ValueError):
        expected = "1 or 0" if kind.startswith("bool") else "a number" if kind.startswith("float") else "a whole number"
        raise InputError(f"{name}={raw!r}: expected {expected}") from None


def _checked(s: Settings) -> Settings:
    for name, least in (("helpers", 0), ("tasks_ahead", 0), ("writers", 1), ("writer_depth", 1), ("word_cache", 2),
                        ("metrics_port", 0), ("train_readers", 1), ("train_gather_threads", 1), ("compile_tokens", 0)):
        value = getattr(s, name)
        if value is not None and value < least:
            env = next(f.metadata["env"] for f in dataclasses.fields(s) if f.name == name)
            raise InputError(f"{env}={value}: expected a whole number ≥ {least}")
    if not 0 <= s.helper_nice <= 19:
        raise InputError(f"EMBEDFLEET_HELPER_NICE={s.helper_nice}: expected a whole number from 0 to 19")
    for name in ("lease_seconds", "db_patience_seconds", "switch_interval"):
        if not 0 < getattr(s, name) < float("inf"):
            env = next(f.metadata["env"] for f in dataclasses.fields(s) if f.name == name)
            raise InputError(f"{env}={getattr(s, name)}: expected a positive number")
    return s
