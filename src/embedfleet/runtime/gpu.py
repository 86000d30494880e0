"""What NVML says about a worker's GPU — utilisation, memory, temperature, power — for the fleet view.
nvidia-ml-py is optional: without it (or on a CPU) the reader returns nothing."""

from __future__ import annotations

from typing import Callable

__all__ = ["gpu_reader"]


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
