"""Devices, named one way everywhere: `auto`, `cpu`, `cuda`, or `cuda:0,1,…` (several GPUs). One parser serves
ingest, worker, train and the launchers; the launcher counts GPUs through NVML, without importing torch."""

from __future__ import annotations

import re

from embedfleet.errors import InputError

__all__ = ["parse_devices", "validate_devices"]

_DEVICES = re.compile(r"^(auto|cpu|cuda|cuda:\d+(,\d+)*)$")


def validate_devices(devices: str) -> str:
    if not _DEVICES.match(str(devices)):
        raise InputError(f"--devices {devices!r}: use auto, cpu, cuda or cuda:0,1,…")
    return devices


def parse_devices(devices: str, workers: int | None = None) -> list[str]:
    """The device of each worker (or rank): one per GPU by default, `workers` round-robin over them."""
    validate_devices(devices)
    visible = _cuda_count() if devices != "cpu" else 0
    if devices == "cpu" or (devices == "auto" and not visible):
        return ["cpu"] * (workers or 1)
    if not visible:
        raise InputError(f"--devices {devices}: no CUDA GPU is visible; use --devices cpu")
    if devices in ("auto", "cuda"):
        gpus = list(range(visible))
    else:
        gpus = [int(x) for x in devices.split(":", 1)[1].split(",")]
        if max(gpus) >= visible:
            raise InputError(f"--devices {devices}: only {visible} GPU(s) visible (cuda:0…cuda:{visible - 1})")
    n = workers or len(gpus)
    return [f"cuda:{gpus[i % len(gpus)]}" for i in range(n)]


def _cuda_count() -> int:
    """GPUs visible to this process (NVML first: the launcher need not import torch)."""
    from embedfleet.platform.gpu import visible_gpu_count

    return visible_gpu_count()
