"""Devices, GPUs as NVML counts them, memory kept for the next unit."""

from __future__ import annotations

import pytest

from embedfleet.errors import InputError
from embedfleet.platform.devices import parse_devices
from embedfleet.sources.plan import ChunkSpec


def _c(src, first, kind="jsonl"):
    return ChunkSpec(src, kind, 0, 0, first)


def test_devices_spread_workers_round_robin(monkeypatch):
    import embedfleet.platform.devices as local

    assert parse_devices("cpu", None) == ["cpu"]
    assert parse_devices("cpu", 2) == ["cpu", "cpu"]
    monkeypatch.setattr(local, "_cuda_count", lambda: 4)  # a 4-GPU host, without needing one
    assert parse_devices("auto", None) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert parse_devices("cuda:0,1", None) == ["cuda:0", "cuda:1"]
    assert parse_devices("cuda:2,3", 3) == ["cuda:2", "cuda:3", "cuda:2"]
    assert parse_devices("cuda:0", 2) == ["cuda:0", "cuda:0"]  # two processes share one GPU
    with pytest.raises(InputError, match="only 4 GPU"):
        parse_devices("cuda:4", None)
    monkeypatch.setattr(local, "_cuda_count", lambda: 0)
    assert parse_devices("auto", None) == ["cpu"]
    with pytest.raises(InputError, match="no CUDA GPU"):
        parse_devices("cuda:1", None)


def test_cuda_visible_devices_read_as_cuda_reads_them():
    from embedfleet.platform.gpu import cuda_visible_count

    assert cuda_visible_count(None, 4) == 4
    assert cuda_visible_count("", 4) == 0 and cuda_visible_count("-1", 4) == 0
    assert cuda_visible_count("0,2", 4) == 2 and cuda_visible_count(" 3 ", 4) == 1
    assert cuda_visible_count("1,7,2", 4) == 1  # CUDA stops at the first index it does not have
    assert cuda_visible_count("0,0", 4) == 1  # a repeated device ends the list too
    assert cuda_visible_count("GPU-8f0e-aa,GPU-77b1-cc", 2) == 2


def test_counting_gpus_where_nvml_cannot_answer_falls_back_to_torch():
    """No NVIDIA driver here: NVML's init fails (nvidia-ml-py is installed) and torch's count is the answer."""
    import torch

    from embedfleet.platform.gpu import visible_gpu_count

    if torch.cuda.is_available():
        pytest.skip("a GPU machine: NVML answers (the GPU tests check that count)")
    assert visible_gpu_count() == torch.cuda.device_count() == 0


def test_a_worker_process_reuses_the_pages_it_freed_for_its_next_units_buffers():
    """A unit's buffers (MBs, freed once it is written, on several writer threads) come back from the
    heap for the next unit instead of fresh pages: glibc's default maps many afresh each time."""
    import subprocess
    import sys

    script = (
        "import random, resource, sys, threading\n"
        "from embedfleet.platform.heap import keep_freed_memory\n"
        "kept = keep_freed_memory() if sys.argv[1] == 'keep' else None\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "def writer(seed):\n"
        "    sizes = random.Random(seed)\n"
        "    for _ in range(20):\n"
        "        unit = bytearray(sizes.randrange(2 << 20, 12 << 20))\n"  # a unit's COPY stream, then freed
        "        del unit\n"
        "threads = [threading.Thread(target=writer, args=(k,)) for k in range(6)]\n"
        "for t in threads: t.start()\n"
        "for t in threads: t.join()\n"
        "print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n")
    out = {mode: subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, check=True)
           .stdout.split() for mode in ("default", "keep")}
    if out["keep"][0] != "True":
        pytest.skip("not glibc: its allocator is left as it is")
    # 120 units of ~7 MB (~210k pages): by default 29-42k faults on the 2-core VM; kept, 6-12k (each thread's first)
    assert int(out["default"][1]) > 2 * int(out["keep"][1]), out
