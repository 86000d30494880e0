"""What NVML says: how many GPUs this process may use (the launcher's count, without torch), and a
worker's GPU's utilisation, memory, temperature and power for the fleet view. Without NVML's library
(no NVIDIA driver, or a CPU) the count comes from torch and the reader returns nothing."""

from __future__ import annotations

import os
from typing import Callable

__all__ = ["cuda_visible_count", "gpu_reader", "visible_gpu_count"]


def visible_gpu_count() -> int:
    """GPUs this process may use, from NVML and CUDA_VISIBLE_DEVICES: the launcher asks before a job starts,
    and importing torch there costs seconds that each worker pays again. torch's count where NVML cannot
    answer (no driver) or a GPU is split into MIG instances (CUDA then counts instances, not GPUs)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            total = pynvml.nvmlDeviceGetCount()
            if any(_mig_enabled(pynvml, i) for i in range(total)):
                raise LookupError("MIG")
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return _torch_count()
    return cuda_visible_count(os.environ.get("CUDA_VISIBLE_DEVICES"), total)


def cuda_visible_count(value: str | None, total: int) -> int:
    """How many of `total` GPUs CUDA_VISIBLE_DEVICES (`value`) leaves visible: CUDA reads its comma-separated
    indices or UUIDs up to the first one that is not valid (unset: every GPU; empty or -1: none)."""
    if value is None:
        return total
    seen: set[str] = set()
    for item in (part.strip() for part in value.split(",")):
        valid = (item.isdigit() and int(item) < total) or item.startswith(("GPU-", "MIG-"))
        if not valid or item in seen:
            break
        seen.add(item)
    return len(seen)


def _mig_enabled(pynvml, index: int) -> bool:
    try:
        current, _ = pynvml.nvmlDeviceGetMigMode(pynvml.nvmlDeviceGetHandleByIndex(index))
    except Exception:  # not supported on this GPU: no MIG
        return False
    return bool(current)


def _torch_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def gpu_reader(device: str) -> Callable[[], dict]:
    """A function returning {gpu_util, gpu_mem_used, gpu_mem_total (MiB), gpu_temp (°C), gpu_power (W)}
    for `device` ("cuda:N" as this process sees it), or {} where NVML cannot tell."""
    if not device.startswith("cuda"):
        return dict
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        # NVML numbers GPUs its own way; the device's UUID names the same GPU in both.
        index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:  # no NVML library, no driver, an old torch without uuid: nothing to show
        return dict

    def read() -> dict:
        try:
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            return {"gpu_util": float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                    "gpu_mem_used": mem.used >> 20, "gpu_mem_total": mem.total >> 20,
                    "gpu_temp": float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
                    "gpu_power": pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0}
        except Exception:
            return {}

    return read
