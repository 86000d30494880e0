"""Vectors of any width get an index, said before anything is planned: tiny random Qwen3 models making 2,560- and
4,096-dimensional vectors ingest to the end (status done, verify OK), their tables get an HNSW index on an
expression of the vectors (halfvec; binary-quantized above 4,000), and `search` runs on it."""

from __future__ import annotations

import json

import pytest

from embedfleet.encode.shapes import build_random_model

TEXTS = [f"review {i}: the {w} broke after {i % 9 + 1} days, naïve café 東京" for i, w in
         enumerate(["charger", "cable", "case", "screen", "battery", "mount"] * 5)]


@pytest.fixture(scope="module", params=[(2560, "halfvec", "embedding::halfvec(2560)"),
                                        (4096, "bit", "binary_quantize(embedding)::bit(4096)")],
                ids=["2560", "4096"])
def wide(request, tmp_path_factory):
    dim, kind, words = request.param
    model = build_random_model("qwen3-0.6b", tmp_path_factory.mktemp(f"qwen3-{dim}") / "m", tiny=True, hidden=dim)
    if dim == 2560:  # a model card as sentence-transformers writes it after training with MatryoshkaLoss
        (model / "README.md").write_text('## Training Details\n\n#### MatryoshkaLoss\n```json\n{\n    "loss": '
                                         '"MultipleNegativesRankingLoss",\n    "matryoshka_dims": [\n        2560,\n'
                                         '        1024,\n        256\n    ]\n}\n```\n')
    return {"dim": dim, "kind": kind, "words": words, "model": model}


def test_a_wide_model_ingests_to_the_end_with_an_index_search_uses(cli, dsn, conn, wide, tmp_path):
    from embedfleet.encode.query import QueryEncoder
    from embedfleet.pg.ddl import index_of
    from embedfleet.query.search import Searcher

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(TEXTS)))
    p = cli("ingest", src, "--model", wide["model"], "--db", dsn, "--devices", "cpu", "--table", "wide",
            "--id-field", "id", check=True)
    said = p.stderr.index(f"index: HNSW on {wide['words']}")
    suggested = "was trained for shorter vectors (Matryoshka: 1024, 256): --dim N keeps the first N"
    assert (suggested in p.stderr) == (wide["dim"] == 2560)  # only where the model card says it was trained for them
    assert said < p.stderr.index("searchable")  # decided and said before the job ran
    assert conn.execute("SELECT count(*), min(vector_dims(embedding)) FROM wide").fetchone() == (len(TEXTS),
                                                                                                  wide["dim"])
    name, kind = index_of(conn, "wide")
    assert kind == wide["kind"]
    status = json.loads(cli("status", "--db", dsn, "--json", check=True).stdout)
    jobs = status["jobs"] if isinstance(status, dict) else status
    assert [j["state"] for j in jobs if j["job"] == "wide"] == ["done"]
    verified = cli("verify", "--table", "wide", "--db", dsn, "--json", check=True)
    assert json.loads(verified.stdout)["ok"] is True
    query = QueryEncoder(str(wide["model"]), device="cpu")
    vec = query.encode([TEXTS[7]], prompt=None)[0]
    searcher = Searcher(conn, "wide")
    assert name in searcher.explain(vec, 5)  # the statement a search runs can take the index
    hits = searcher.search(vec, 5)
    assert searcher.scan == "index" and len(hits) == 5
    assert hits[0]["id"] == "7" and hits[0]["distance"] == pytest.approx(0.0, abs=1e-3)
    assert [h["distance"] for h in hits] == sorted(h["distance"] for h in hits)  # ranked by the full vectors
    filtered = searcher.search(vec, 3, where="id <> '7'")
    assert len(filtered) == 3 and "7" not in [h["id"] for h in filtered]
    p = cli("search", TEXTS[7], "--table", "wide", "--db", dsn, "--json", "-k", "3", check=True)
    assert "7" in json.dumps(json.loads(p.stdout))
    query.close()


def test_index_plans_by_width():
    from embedfleet.errors import InputError
    from embedfleet.pg.ddl import index_plan

    assert index_plan(2000, "vector")[0] == "direct" and index_plan(2001, "vector")[0] == "halfvec"
    assert index_plan(4000, "halfvec")[0] == "direct" and index_plan(4000, "vector")[0] == "halfvec"
    assert index_plan(4001, "vector")[0] == "bit" and index_plan(16000, "halfvec")[0] == "bit"
    with pytest.raises(InputError, match="16,001-dimensional vectors: pgvector stores at most 16,000"):
        index_plan(16001, "vector")
