"""JobConfig: every knob of an ingest job, from flags or a YAML file, validated once.

The job's config is stored in the ledger, so a worker on any host needs only the job name and
the database to run the same job (`embedfleet worker --job NAME --db DSN`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from embedfleet.errors import InputError

DEFAULT_CHUNK_BYTES = 2 << 20  # ~6k reviews: fine-grained claiming, short pipeline fill
DEFAULT_LEASE_SECONDS = 30.0


@dataclass
class JobConfig:
    inputs: list[str]
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
    batch_tokens: str = "auto"
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    limit: int | None = None
    no_index: bool = False
    quiet: bool = False
    dtype: str = "float"  # stored vector type: float -> vector, half -> halfvec
    dim: int | None = None  # Matryoshka truncation
    prompt: str | None = None  # prompt name for documents (models with a "document" prompt use it by default)
    lease_seconds: float = DEFAULT_LEASE_SECONDS

    # Fields that change what lands in the table. Two runs agreeing on these are the same job.
    _IDENTITY = (
        "inputs", "meta", "preset", "text_template", "text_field", "id_field", "model",
        "table", "chunk_bytes", "limit", "dtype", "dim", "prompt",
    )

    def fingerprint(self) -> str:
        ident = {k: getattr(self, k) for k in self._IDENTITY}
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


def build_config(flags: dict[str, Any], yaml_path: str | None = None) -> JobConfig:
    """Merge YAML and flags (flags win when given), then validate."""
    merged = load_yaml(yaml_path)
    merged.update({k: v for k, v in flags.items() if v is not None and v != [] and v is not False})
    if isinstance(merged.get("inputs"), str):
        merged["inputs"] = [merged["inputs"]]
    if not merged.get("inputs"):
        raise InputError("no input given: embedfleet ingest FILE... (or `inputs:` in --config)")
    cfg = JobConfig(**merged)
    return validate(cfg)


_DEVICES = re.compile(r"^(auto|cpu|cuda|cuda:\d+(,\d+)*)$")


def validate(cfg: JobConfig) -> JobConfig:
    if not _DEVICES.match(str(cfg.devices)):
        raise InputError(f"--devices {cfg.devices!r}: use auto, cpu, cuda or cuda:0,1,…")
    if cfg.workers is not None and int(cfg.workers) < 1:
        raise InputError("--workers must be at least 1")
    bt = str(cfg.batch_tokens)
    if bt != "auto" and not (bt.isdigit() and int(bt) >= 16):
        raise InputError(f"--batch-tokens {bt!r}: use auto or a number of tokens ≥ 16")
    if int(cfg.chunk_bytes) < 1024:
        raise InputError("--chunk-bytes must be at least 1024")
    if cfg.limit is not None and int(cfg.limit) < 0:
        raise InputError("--limit must be ≥ 0")
    if cfg.dtype not in ("float", "half"):
        raise InputError(f"--dtype {cfg.dtype!r}: use float (vector) or half (halfvec)")
    if cfg.text_template and cfg.text_field:
        raise InputError("give --text-field or --text-template, not both")
    if cfg.preset is None:
        cfg.preset = "amazon-reviews" if cfg.meta else "generic"
    from embedfleet.sources.presets import PRESETS  # here, not at the top: config stays light to import

    if cfg.preset not in PRESETS:
        raise InputError(f"--preset {cfg.preset!r}: choose one of {', '.join(PRESETS)}")
    if cfg.meta and cfg.preset != "amazon-reviews":
        raise InputError("--meta joins product metadata and needs --preset amazon-reviews")
    cfg.lease_seconds = float(os.environ.get("EMBEDFLEET_LEASE_SECONDS", cfg.lease_seconds))
    return cfg


def _env_number(name: str, default, parse, valid, expected: str):
    """A number setting from the environment (the measuring knobs); unset or empty: `default`. `parse`
    returns None for text that is no number; anything `valid` refuses is a one-line error."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    value = parse(raw)
    if value is None or not valid(value):
        raise InputError(f"{name}={raw!r}: expected {expected}")
    return value


def _float_or_none(raw: str) -> float | None:
    try:
        return float(raw)
    except ValueError:
        return None


def env_int(name: str, default: int | None, least: int = 1) -> int | None:
    """A whole number ≥ `least` (digits only, no sign but a minus)."""
    return _env_number(name, default, lambda raw: int(raw) if raw.lstrip("-").isdigit() else None,
                       lambda v: v >= least, f"a whole number ≥ {least}")


def env_float(name: str, default: float) -> float:
    """A positive, finite number."""
    return _env_number(name, default, _float_or_none, lambda v: 0 < v < float("inf"), "a positive number")
