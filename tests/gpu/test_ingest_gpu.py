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
