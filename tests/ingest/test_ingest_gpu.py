"""The whole ingest path on a GPU: example corpus → one worker per GPU → embedded PostgreSQL."""

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parents[2]
MINILM = Path(os.environ.get("EMBEDFLEET_GPU_MINILM", ROOT / ".models/all-MiniLM-L6-v2-fp16"))


@pytest.mark.skipif(not MINILM.is_dir(), reason="fp16 MiniLM not prepared (.models/)")
def test_ingest_on_every_gpu_then_verify(tmp_path, dsn):
    env = dict(os.environ, EMBEDFLEET_HOME=str(tmp_path))

    def cli(*args):
        p = subprocess.run([sys.executable, "-m", "embedfleet.cli", *map(str, args)], env=env,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        return p

    examples = ROOT / "examples"
    cli("ingest", examples / "Cell_Phones_and_Accessories.jsonl", "--meta",
        examples / "meta_Cell_Phones_and_Accessories.jsonl", "--preset", "amazon-reviews", "--model", MINILM,
        "--devices", "cuda", "--db", dsn, "--quiet", "--chunk-bytes", "20000")
    report = orjson.loads(cli("verify", "--table", "Cell_Phones_and_Accessories", "--db", dsn, "--json").stdout)
    assert report["ok"] and report["rows"] == 200
    hits = orjson.loads(cli("search", "charger stopped working", "--table", "Cell_Phones_and_Accessories",
                            "--db", dsn, "--json").stdout)["results"]
    assert len(hits) == 10


def test_the_launcher_counts_gpus_as_torch_does_without_importing_it():
    code = ("import sys; from embedfleet.platform.gpu import visible_gpu_count; n = visible_gpu_count(); "
            "print(n, 'torch' in sys.modules)")
    for visible in (None, "0"):
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        count, imported = out.stdout.split()
        torch_says = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"], env=env,
                                    capture_output=True, text=True, timeout=120).stdout
        assert int(count) == int(torch_says) and (visible is None or int(count) == 1), out.stderr[-2000:]
        try:
            import pynvml  # noqa: F401
        except ImportError:
            continue  # without NVML the count comes from torch
        assert imported == "False"  # NVML answered: torch was not imported
