"""Every setting, declared once: the knobs of a process (`Settings`, one field per EMBEDFLEET_* variable) and
the specs of what a command makes (`JobSpec` for an ingest job, `TrainSpec` for a training run).

- `Settings` is the only reader of EMBEDFLEET_* variables. An entry point resolves it once (`Settings.from_env`,
  flags given winning over variables) and passes it down; a launcher hands its Settings to each worker it starts
  as an argument, a Ray actor gets the object. Nothing below an entry point reads the environment for them.
  docs/reference/configuration.md is generated from these declarations.
- `JobSpec` is what a job makes (inputs, model, template, table…), from flags or a YAML file; it is stored in the
  ledger, so a worker on any host needs only the job's name and the database. `TrainSpec` is a training run's.
  Both are checked by msgspec against their annotations; checking returns a normalised copy, never mutates.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from embedfleet.errors import InputError

__all__ = ["JobSpec", "RunOptions", "Settings", "TrainSpec", "build_job", "default_chunk_bytes", "load_yaml",
           "local_model", "run_options", "shell_escapes", "typed"]

DEFAULT_CHUNK_BYTES = 2 << 20  # fine-grained claiming and a short pipeline fill on a GPU
CPU_CHUNK_BYTES = 256 << 10  # a CPU embeds slowly: small chunks show progress and commit often
MAX_PARTITIONS = 1024  # a query plans each partition: PostgreSQL's docs speak of up to a few thousand


def default_chunk_bytes(device: str) -> int:
    """Bytes of input per chunk (and per committed unit of a stream) when --chunk-bytes is not given."""
    return CPU_CHUNK_BYTES if device == "cpu" else DEFAULT_CHUNK_BYTES


# --- the knobs ------------------------------------------------------------------------------------------


def _knob(default, env: str, doc: str, shown: str | None = None):
    return dataclasses.field(default=default, metadata={"env": env, "doc": doc, "shown_default": shown})


@dataclass(frozen=True)
class Settings:
    """Every EMBEDFLEET_* variable: its default, its name and what it does."""

    home: str = _knob("~/.embedfleet", "EMBEDFLEET_HOME", "where the embedded server's data, runs and caches live")
    db: str | None = _knob(None, "EMBEDFLEET_DB", "the database (a postgresql:// DSN) when --db is not given",
                           "the embedded server")
    source_db: str | None = _knob(None, "EMBEDFLEET_SOURCE_DB",
                                  "the database a --from-table source lives in when --source-db is not given",
                                  "the target's (--db)")
    model: str | None = _knob(None, "EMBEDFLEET_MODEL", "the model when --model is not given (a directory or hub id)",
                              "the bundled all-MiniLM-L6-v2")
    pg_tune: bool = _knob(True, "EMBEDFLEET_PG_TUNE", "tune the embedded server for bulk loads (0: leave it as it is)")
    pycache: str = _knob("auto", "EMBEDFLEET_PYCACHE",
                         "keep Python bytecode under $EMBEDFLEET_HOME/cache/pycache where the environment keeps none "
                         "(auto; 1: whenever Python writes none; 0: never)")
    api_key: str | None = _knob(None, "EMBEDFLEET_API_KEY",
                                "the bearer key `serve` asks every request for (all routes but /health) when --api-key "
                                "is not given", "none: serve listens on loopback only")
    debug: bool = _knob(False, "EMBEDFLEET_DEBUG", "show tracebacks (as --debug), in every process of a command")
    lease_seconds: float = _knob(30.0, "EMBEDFLEET_LEASE_SECONDS",
                                 "how long a claimed chunk stays a worker's without a heartbeat (renewed every third)")
    db_patience_seconds: float = _knob(300.0, "EMBEDFLEET_DB_PATIENCE",
                                       "how long a worker keeps reconnecting to a database that went away")
    helpers: int | None = _knob(None, "EMBEDFLEET_PREP_WORKERS",
                                "helper processes per worker (0: in-process)", "half its cores, at most 8, none under 4")
    helper_nice: int = _knob(0, "EMBEDFLEET_HELPER_NICE",
                             "how far below its worker a helper runs in the CPU's queue (0-19; 0: level with it)")
    tasks_ahead: int | None = _knob(None, "EMBEDFLEET_TASKS_AHEAD", "most units in preparation at once",
                                    "2 × helpers + 2")
    writers: int | None = _knob(None, "EMBEDFLEET_WRITERS", "writer connections per worker",
                                "6 on a GPU, 3 on a CPU, fewer on a full server")
    writer_depth: int | None = _knob(None, "EMBEDFLEET_WRITER_DEPTH", "units queued per writer connection",
                                     "8 on a GPU, 2 on a CPU")
    switch_interval: float = _knob(0.0005, "EMBEDFLEET_SWITCH_INTERVAL",
                                   "seconds a worker thread may hold the GIL before handing it over")
    word_cache: int = _knob(1 << 18, "EMBEDFLEET_WORD_CACHE", "distinct words each tokenizer remembers")
    compile: bool = _knob(True, "EMBEDFLEET_COMPILE", "torch.compile the forward pass on CUDA (0: eager)")
    compile_wait: bool = _knob(False, "EMBEDFLEET_COMPILE_WAIT",
                               "an ingest worker's loop waits for its compile (0: starts eager, switches when ready)")
    compile_tokens: int | None = _knob(None, "EMBEDFLEET_COMPILE_TOKENS", "tokens of work before compiling starts",
                                       "2^23, 2^18 once cached")
    triton: bool = _knob(True, "EMBEDFLEET_TRITON",
                         "Triton kernels on CUDA: the packed glue of Qwen3, ModernBERT and Gemma3 (norms, RoPE, "
                         "GeGLU), the trainer's take of a step's rows (0: off)")
    train_readers: int | None = _knob(None, "EMBEDFLEET_TRAIN_READERS", "connections one training read uses",
                                      "a quarter of the cores, 1-4")
    train_gather_threads: int | None = _knob(None, "EMBEDFLEET_TRAIN_GATHER_THREADS",
                                             "threads gathering a batch on the host in the ram tier",
                                             "half the cores, at most 8")
    train_graph: bool = _knob(True, "EMBEDFLEET_TRAIN_GRAPH",
                              "replay each training step on CUDA as one CUDA graph (0: every step eager)")
    host_id: str = _knob(socket.gethostname(), "EMBEDFLEET_HOST_ID",
                         "this host's name in the ledger: a dead worker's chunks are freed at once only on its own host",
                         "the host's name")
    metrics_port: int | None = _knob(None, "EMBEDFLEET_METRICS_PORT",
                                     "serve the job's Prometheus metrics on this port (ingest, worker)", "off")

    @classmethod
    def from_env(cls, environ=None, **flags) -> "Settings":
        """The knobs of this process: flags given (not None) win over EMBEDFLEET_* variables, which win over the
        defaults. A value that does not parse is a one-line error naming the variable."""
        environ = os.environ if environ is None else environ
        values = {}
        for f in dataclasses.fields(cls):
            if flags.get(f.name) is not None:
                values[f.name] = flags[f.name]
            elif (raw := environ.get(f.metadata["env"], "").strip()):
                values[f.name] = _parse_knob(f.metadata["env"], raw, f.type)
        return _checked(cls(**values))

    @property
    def home_path(self) -> Path:
        return Path(self.home).expanduser()

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Settings":
        names = {f.name for f in dataclasses.fields(cls)}
        return typed(cls, {k: v for k, v in d.items() if k in names}, "settings")


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


def _env_of(name: str) -> str:
    return next(f.metadata["env"] for f in dataclasses.fields(Settings) if f.name == name)


def _checked(s: Settings) -> Settings:
    for name, least in (("helpers", 0), ("tasks_ahead", 0), ("writers", 1), ("writer_depth", 1), ("word_cache", 2),
                        ("metrics_port", 0), ("train_readers", 1), ("train_gather_threads", 1), ("compile_tokens", 0)):
        value = getattr(s, name)
        if value is not None and value < least:
            raise InputError(f"{_env_of(name)}={value}: expected a whole number ≥ {least}")
    if s.metrics_port is not None and s.metrics_port > 65535:
        raise InputError(f"EMBEDFLEET_METRICS_PORT={s.metrics_port}: expected a port number from 0 to 65535")
    if not 0 <= s.helper_nice <= 19:
        raise InputError(f"EMBEDFLEET_HELPER_NICE={s.helper_nice}: expected a whole number from 0 to 19")
    for name in ("lease_seconds", "db_patience_seconds", "switch_interval"):
        if not 0 < getattr(s, name) < float("inf"):
            raise InputError(f"{_env_of(name)}={getattr(s, name)}: expected a positive number")
    if s.pycache not in ("auto", "1", "0"):
        raise InputError(f"EMBEDFLEET_PYCACHE={s.pycache!r}: use auto, 1 or 0")
    return s


# --- what a command makes ----------------------------------------------------------------------------------


def typed(cls, values: dict[str, Any], source: str):
    """`cls(**values)` with every value's type checked against the field's annotation (strict: "5" is no int,
    3.7 no int, "false" no bool); a wrong one is a one-line error naming the key and `source`."""
    import msgspec

    for key in ("inputs", "columns"):
        if isinstance(values.get(key), str):  # one input; "stars:int,lang:text"
            values = {**values, key: [values[key]] if key == "inputs" else values[key].split(",")}
    try:
        return msgspec.convert(values, cls, strict=True)
    except msgspec.ValidationError as e:
        msg, _, where = str(e).partition(" - at `$.")
        key = where.split("`")[0].split(".")[0].split("[")[0]
        flag = {field: flag for flag, field in FLAG_FIELDS.items()}.get(key, key).replace("_", "-")
        raise InputError(f"{source}: key '{key}' (--{flag}): {msg[:1].lower()}{msg[1:].replace('`', '')}") from None


@dataclass(frozen=True)
class JobSpec:
    """What an ingest job makes. Stored in the ledger (its DSN left out), so every worker runs the same job."""

    inputs: tuple[str, ...] = ()
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
    columns: tuple[str, ...] | None = None  # "NAME:TYPE" fields promoted from the records into typed columns
    replacing: tuple[str, ...] | None = None  # --replace: files to embed again in place of their earlier rows (not identity)
    source_table: str | None = None  # --from-table: a PostgreSQL table's rows are the records (inputs: its name)
    where: str | None = None  # --where: which of the source table's rows (read-only SQL)
    trust_remote_code: bool = False  # --trust-remote-code: run a model's own Python code (transformers' auto_map)
    index: str = "hnsw"  # --index: hnsw (as the width allows) | binary (HNSW over the binary-quantized vectors)
    fts: bool = False  # --fts: a full-text index of the content beside the vector one (hybrid search)
    fts_config: str | None = None  # --fts-config: its text search configuration (None: the table's, else simple)
    task: str | None = None  # --task: the task a model's own first module takes (jina's adapters; default: the prompt's name)

    # Fields that change how a record lands in the table. Two runs agreeing on these are the same job, whatever
    # their inputs: a rerun adds the files (and appended bytes) it finds new.
    _IDENTITY = (
        "meta", "preset", "text_template", "text_field", "id_field", "model",
        "table", "chunk_bytes", "limit", "dtype", "dim", "prompt", "passages", "columns", "source_table", "where",
        "task",
    )

    def replace(self, **changes) -> "JobSpec":
        return dataclasses.replace(self, **changes)

    def fingerprint(self, legacy: bool = False) -> str:
        """The job's identity. `legacy`: as jobs planned before reruns added files had it (inputs included)."""
        # A field at its default is left out: a job planned before the field existed keeps its fingerprint.
        keys = ("inputs",) + self._IDENTITY if legacy else self._IDENTITY
        ident = {k: (list(v) if isinstance(v := getattr(self, k), tuple) else v) for k in keys
                 if k not in ("passages", "columns", "source_table", "where", "task") or getattr(self, k) is not None}
        return hashlib.sha256(orjson.dumps(ident, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("db")  # a DSN may hold a password; workers get it from their own flags/env
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "JobSpec":
        names = {f.name for f in dataclasses.fields(cls)}
        return typed(cls, {k: v for k, v in d.items() if k in names}, "the ledger's job")


def shell_escapes(template: str | None) -> str | None:
    """A template typed in a shell (or a YAML string): its backslash-n and backslash-t as the newline and tab the
    user meant."""
    return template.replace("\\n", "\n").replace("\\t", "\t") if template else template


# A flag whose field has another name: a --config file spells it as the flag.
FLAG_FIELDS = {"from_table": "source_table", "replace": "replacing"}


@dataclass(frozen=True)
class RunOptions:
    """The keys of a --config file that say how `ingest` runs, not what its job makes (flags win)."""

    source_db: str | None = None
    metrics_port: int | None = None
    ray: str | None = None
    json: bool = False


def load_yaml(path: str | None) -> dict[str, Any]:
    """Flags from a YAML file (keys spelled like the flags, `-` or `_`): a job's fields and RunOptions' keys. A
    relative path in it (inputs, meta, model) is read from the file's folder where it is there; a template's
    backslash-n is a newline, as on the command line."""
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
    known = {f.name for f in dataclasses.fields(JobSpec)} | {f.name for f in dataclasses.fields(RunOptions)}
    out = {}
    for k, v in data.items():
        key = str(k).replace("-", "_")
        key = FLAG_FIELDS.get(key, key)
        if key not in known:
            raise InputError(f"{path}: unknown key '{k}'")
        out[key] = v
    if isinstance(out.get("text_template"), str):
        out["text_template"] = shell_escapes(out["text_template"])
    for key in ("inputs", "meta", "model"):
        if isinstance(out.get(key), (str, list)):
            out[key] = beside(p.parent, out[key])
    return out


def beside(folder: Path, value: str | list) -> str | list:
    """Relative local paths in `value` as found in `folder` (a config file's), where they are there; the rest
    (absolute paths, URLs, hub ids, paths found only from the current directory) as given."""
    import glob

    def one(v):
        if not isinstance(v, str) or "://" in v or Path(v).expanduser().is_absolute():
            return v
        there = folder / v
        return str(there) if there.exists() or glob.has_magic(v) and glob.glob(str(there), recursive=True) else v

    return [one(v) for v in value] if isinstance(value, list) else one(value)


def run_options(yaml_path: str | None) -> RunOptions:
    """RunOptions' keys from a --config file (defaults without one)."""
    names = {f.name for f in dataclasses.fields(RunOptions)}
    return typed(RunOptions, {k: v for k, v in load_yaml(yaml_path).items() if k in names}, yaml_path or "")


def local_model(model: str | None) -> str | None:
    """A model given as a relative local folder, made absolute: the job records it for every worker and later
    search, which run from other folders. A hub id (or any name not a folder here) is kept."""
    if not model or "://" in model or not Path(model).expanduser().is_dir():
        return model
    return str(Path(model).expanduser().resolve())


# Flags that pick one of two ways: given on the command line, the other way's key in a --config file gives way.
_EITHER = (("text_template", "text_field"), ("source_table", "inputs"))


def build_job(flags: dict[str, Any], yaml_path: str | None = None) -> JobSpec:
    """Merge YAML and flags (flags win when given), check each value's type, then validate."""
    names = {f.name for f in dataclasses.fields(JobSpec)}
    loaded = {k: v for k, v in load_yaml(yaml_path).items() if k in names}
    merged = dataclasses.asdict(typed(JobSpec, loaded, yaml_path)) if yaml_path else {}
    given = {k: v for k, v in flags.items() if v is not None and v != [] and v != () and v is not False}
    for a, b in _EITHER:
        for mine, other in ((a, b), (b, a)):
            if mine in given and other not in given and other in merged:
                merged[other] = () if other == "inputs" else None
    merged.update(given)
    merged["model"] = local_model(merged.get("model"))
    if merged.get("source_table"):
        if merged.get("inputs"):
            raise InputError("give input files or --from-table, not both")
        merged["inputs"] = (merged["source_table"],)  # checked and qualified against the source's catalog
    elif merged.get("where"):
        raise InputError("--where picks a --from-table source's rows; for files, filter them before ingesting")
    if not merged.get("inputs"):
        raise InputError("no input given: embedfleet ingest FILE... or --from-table TABLE (or `inputs:` in --config)")
    return validated(typed(JobSpec, merged, "flags"))


def validated(spec: JobSpec) -> JobSpec:
    """`spec` checked, as a normalised copy (the preset filled in)."""
    from embedfleet.platform.devices import validate_devices

    validate_devices(spec.devices)
    if spec.workers is not None and spec.workers < 1:
        raise InputError("--workers must be at least 1")
    if spec.index not in ("hnsw", "binary"):
        raise InputError(f"--index {spec.index!r}: use hnsw or binary")
    bt = str(spec.batch_tokens)
    if bt != "auto" and not (bt.isdigit() and int(bt) >= 16):
        raise InputError(f"--batch-tokens {bt!r}: use auto or a number of tokens ≥ 16")
    if spec.chunk_bytes is not None and spec.chunk_bytes < 1024:
        raise InputError("--chunk-bytes must be at least 1024")
    if spec.limit is not None and spec.limit < 1:
        raise InputError(f"--limit {spec.limit}: embed at least 1 record (leave --limit out for all of them)")
    if spec.no_index and spec.index != "hnsw":
        raise InputError(f"--index {spec.index} asks for an index and --no-index for none: give one of them")
    if spec.dtype not in ("float", "half"):
        raise InputError(f"--dtype {spec.dtype!r}: use float (vector) or half (halfvec)")
    if spec.partitions is not None and not 2 <= spec.partitions <= MAX_PARTITIONS:
        raise InputError(f"--partitions {spec.partitions}: use 2 to {MAX_PARTITIONS}, or leave it out for one relation")
    from embedfleet.encode.passages import parse_passages

    parse_passages(spec.passages)
    if spec.text_template and spec.text_field:
        raise InputError("give --text-field or --text-template, not both")
    if spec.source_table:  # a table's columns are its fields: the preset of tables, columns typed from its catalog
        for flag, given in (("--preset", spec.preset not in (None, "table")), ("--meta", spec.meta),
                            ("--limit", spec.limit is not None), ("--passages", spec.passages),
                            ("--replace", spec.replacing)):
            if given:
                raise InputError(f"{flag} is for input files, not --from-table")
        return spec.replace(preset="table")
    preset = spec.preset or ("amazon-reviews" if spec.meta else "generic")
    from embedfleet.sources.presets import FILE_PRESETS, job_preset  # here, not at the top: settings stay light

    if preset not in FILE_PRESETS:
        raise InputError(f"--preset {preset!r}: choose one of {', '.join(FILE_PRESETS)}")
    if spec.meta and preset != "amazon-reviews":
        raise InputError("--meta joins product metadata and needs --preset amazon-reviews")
    job_preset(preset, list(spec.columns) if spec.columns else None)  # names and types that can be columns
    return spec.replace(preset=preset)


@dataclass(frozen=True)
class TrainSpec:
    """A training run: `embedfleet train`'s flags."""

    table: str
    label: str
    task: str = "classify"
    head: str = "linear"
    epochs: int = 10
    batch_size: int | None = None  # global, across ranks (None: an eighth of the train split, see trainer)
    lr: float | None = None  # None: auto_lr of the run's steps
    weight_decay: float = 0.01
    where: str | None = None
    val_fraction: float = 0.1
    devices: str = "auto"
    workers: int | None = None
    cache: str = "auto"
    out: str | None = None
    db: str | None = None
    seed: int = 0
    json: bool = False
    features: list[str] | None = None  # columns making x (None: the table's vector column)
    fill_null: float | None = None  # stands in for a feature's NULLs

    def replace(self, **changes) -> "TrainSpec":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "TrainSpec":
        return typed(cls, d, "train")

    def checked(self) -> "TrainSpec":
        """This spec's values checked (types by msgspec, ranges here); returns it."""
        from embedfleet.platform.devices import validate_devices
        from embedfleet.train.heads import HEADS

        typed(TrainSpec, dataclasses.asdict(self), "flags")
        if self.task not in ("classify", "regress"):
            raise InputError(f"--task {self.task!r}: use classify or regress")
        if self.head not in HEADS:
            raise InputError(f"--head {self.head!r}: use {' or '.join(HEADS)}")
        if self.epochs < 1 or (self.batch_size is not None and self.batch_size < 1):
            raise InputError("--epochs and --batch-size must be at least 1")
        if self.lr is not None and not self.lr > 0:
            raise InputError(f"--lr {self.lr}: use a positive learning rate")
        if not 0.0 <= self.val_fraction < 1.0:
            raise InputError(f"--val-fraction {self.val_fraction}: use a value in [0, 1)")
        if self.cache not in ("auto", "gpu", "ram", "stream"):
            raise InputError(f"--tier {self.cache!r}: use auto, gpu, ram or stream")
        validate_devices(self.devices)
        if self.workers is not None and self.workers < 1:
            raise InputError(f"--ranks {self.workers}: train on at least 1")
        return self
