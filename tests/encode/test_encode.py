"""The encoder against sentence-transformers on the same weights (CPU, float32)."""

import json
import threading

import numpy as np
import pytest

st_mod = pytest.importorskip("sentence_transformers")

from embedfleet.encode import encoder as encoder_mod  # noqa: E402
from embedfleet.encode import tokenize as tokenize_mod  # noqa: E402
from embedfleet.encode.encoder import Encoder  # noqa: E402
from embedfleet.encode.models import bundled_model_dir  # noqa: E402
from embedfleet.encode.packed import OnDevice  # noqa: E402
from embedfleet.encode.shapes import build_random_model  # noqa: E402
from embedfleet.errors import ModelError  # noqa: E402
from embedfleet.synth import review_texts  # noqa: E402

TEXTS = review_texts(40, seed=5) + ["word " * 600, "", "a", "Short one."]


def _st(path, texts=TEXTS, prompt=None, dim=None):
    model = st_mod.SentenceTransformer(str(path), device="cpu", truncate_dim=dim)
    out = model.encode(texts, prompt_name=prompt, convert_to_numpy=True)
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def _close(ours, ref, tol=0.9999):
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    assert (ours * ref).sum(1).min() >= tol


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "bert-cls": build_random_model("bert-base", root / "bert", tiny=True, pooling="cls"),
        "qwen3": build_random_model("qwen3-0.6b", root / "qwen3", tiny=True),
        "qwen3-mean": build_random_model("qwen3-0.6b", root / "qwen3m", tiny=True, pooling="mean"),
        "electra": build_random_model("minilm-l6", root / "electra", tiny=True, model_type="electra"),
        "modernbert": _sharpened(build_random_model("modernbert-base", root / "modernbert", tiny=True)),
        "modernbert-cls": _sharpened(build_random_model("modernbert-base", root / "modernbert-cls", tiny=True,
                                                        pooling="cls")),
        "gemma3": _sharpened(build_random_model("gemma3-300m", root / "gemma3", tiny=True), gemma=True),
        "gemma3-last": _sharpened(build_random_model("gemma3-300m", root / "gemma3-last", tiny=True,
                                                     pooling="lasttoken"), gemma=True),
    }


def _sharpened(path, gemma: bool = False):
    """Random weights' attention is near uniform, where a window hardly changes a vector: scale Q, K, V and the
    output projection up (Gemma's q/k norms undo a scale: there its norms' weights), so that which tokens a layer
    attends to matters."""
    from safetensors.numpy import load_file, save_file

    sd = load_file(str(path / "model.safetensors"))
    if gemma:
        sd = {k: v + 6.0 if k.endswith(("q_norm.weight", "k_norm.weight")) else v * 20 if "v_proj" in k else v
              for k, v in sd.items()}
    else:
        sd = {k: v * 40 if "Wqkv" in k else v * 20 if "attn.Wo" in k else v for k, v in sd.items()}
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_real_minilm_matches_st_with_truncation():
    enc = Encoder(device="cpu")
    assert enc.describe()["path"] == "packed" and enc.max_seq_length == 256
    _close(enc.encode(TEXTS), _st(bundled_model_dir()))


def test_real_minilm_matches_st_on_non_ascii_text():
    """Accents, other scripts and emoji: the first call (the library's tokenizer while the word path builds) and a
    later one (the word cache) both embed as sentence-transformers does."""
    from embedfleet.synth import world_texts

    texts = world_texts(80, seed=11)
    enc = Encoder(device="cpu")
    first = enc.encode(texts)
    enc._tok._local._words_for(64)  # built: the next call takes the word cache
    assert enc._tok._local.unicode is not None
    ref = _st(bundled_model_dir(), texts)
    _close(first, ref)
    _close(enc.encode(texts), ref)
    assert len(enc._tok._local.unicode._pieces) > 50  # the second call went through it


def test_weights_move_to_the_device_as_each_is_read():
    import torch

    state = {"a": torch.ones(2, 3), "b": torch.zeros(1)}
    sd = OnDevice(state, torch.device("meta"))  # a device a CPU-only machine has: tensors without storage
    assert "a" in sd and "c" not in sd and list(sd) == ["a", "b"] and len(sd) == 2
    assert sd["a"].device.type == "meta" and state["a"].device.type == "cpu"  # the checkpoint's copy stays
    assert torch.cat([sd["a"], sd["a"]]).device.type == "meta"  # so a model's concatenations run there


def test_tiny_bert_cls(tiny):
    enc = Encoder(str(tiny["bert-cls"]), batch_tokens=300)  # several batches
    assert enc.spec.pooling == "cls"
    _close(enc.encode(TEXTS), _st(tiny["bert-cls"]))


@pytest.mark.parametrize("prompt", [None, "query", "document"])
def test_tiny_qwen3_lasttoken_with_prompts(tiny, prompt):
    enc = Encoder(str(tiny["qwen3"]))
    assert enc.describe()["path"] == "packed" and enc.spec.pooling == "lasttoken"
    _close(enc.encode(TEXTS, prompt=prompt), _st(tiny["qwen3"], prompt=prompt))


def test_query_prompt_changes_vectors_and_literal_prompt(tiny):
    enc = Encoder(str(tiny["qwen3"]))
    q, d = enc.encode(["battery life"], prompt="query"), enc.encode(["battery life"], prompt="document")
    assert (q * d).sum() < 0.9999
    literal = enc.spec.prompts["query"]
    np.testing.assert_allclose(enc.encode(["battery life"], prompt=literal), q, atol=1e-6)


def test_a_word_naming_none_of_a_models_prompts_is_said_and_goes_before_the_text_as_written(tiny):
    """`prompt="Query"` on a model with a `query` prompt was silently the text "Query" glued to each text."""
    import warnings

    enc = Encoder(str(tiny["qwen3"]))
    with pytest.warns(UserWarning, match=r"prompt='Query': .* has no prompt of that name \(query, document\)"):
        typo = enc.encode(["battery life"], prompt="Query")
    np.testing.assert_allclose(typo, enc.encode(["Querybattery life"], prompt=""), atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        enc.encode(["battery life"], prompt="Represent this review: ")  # a text of one's own: nothing to say
        enc.encode(["battery life"], prompt="query")


def test_what_encode_takes_is_said_in_one_line():
    import torch

    enc = Encoder(device="cpu")
    for bad, why in ((None, "not NoneType"), (5, "not int"), (b"battery", "not bytes: decode them first")):
        with pytest.raises(TypeError, match=why):
            enc.encode(bad)
    with pytest.raises(TypeError, match="prompt takes a string"):
        enc.encode(["a"], prompt=3)
    for kwargs, why in (({"dim": "64"}, "whole number"), ({"dim": 64.5}, "whole number"),
                        ({"dtype": torch.int8}, "floating torch dtype")):
        with pytest.raises(ModelError, match=why):
            Encoder(device="cpu", **kwargs)


def test_a_role_prompt_on_a_model_without_prompts_is_said_once_and_changes_nothing():
    """`encode(prompt="query")` on MiniLM (no prompts) was silent: a user believed queries were prefixed."""
    import warnings

    enc = Encoder(device="cpu")
    with pytest.warns(UserWarning, match=r"prompt='query': .* has no prompts, so none is added") as seen:
        q = enc.encode(["battery life — naïve"], prompt="query")
        enc.encode(["again"], prompt="query")
    assert len([w for w in seen if "has no prompts" in str(w.message)]) == 1  # once per name
    np.testing.assert_allclose(q, enc.encode(["battery life — naïve"]), atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        enc.encode(["a literal prefix"], prompt="query: ")  # a text of one's own: nothing to say
    with pytest.warns(UserWarning, match="prompt='document'"):
        Encoder(device="cpu", prompt="document")


def test_tiny_qwen3_mean_and_matryoshka(tiny):
    enc = Encoder(str(tiny["qwen3-mean"]), dim=24)
    assert enc.dim == 24
    _close(enc.encode(TEXTS), _st(tiny["qwen3-mean"], dim=24))


def test_a_kernel_that_cannot_run_falls_back_to_the_torch_path(tiny, caplog):
    """Where the Triton kernel fails (no compiler, an unsupported GPU), the same vectors come from torch."""
    enc = Encoder(str(tiny["qwen3"]))
    want = enc.encode(TEXTS)
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("triton: no compiler for this device")

    enc.model._kernel = broken
    got = enc.encode(TEXTS)
    assert calls and enc.model._kernel is None and "torch path" in caplog.text
    np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("which", ["modernbert", "modernbert-cls"])
def test_tiny_modernbert_packed_with_its_sliding_window(tiny, which):
    """Global and local layers, a window (4 positions each side) shorter than most texts, mean and CLS pooling
    (modernbert-embed and gte-modernbert): the packed path, equal to sentence-transformers' (transformers')."""
    import json

    cfg = json.loads((tiny[which] / "config.json").read_text())
    assert cfg["local_attention"] == 8 and cfg["num_hidden_layers"] == 4
    enc = Encoder(str(tiny[which]), batch_tokens=300)  # several batches
    assert enc.path == "packed" and enc.spec.pooling == ("cls" if which.endswith("cls") else "mean")
    _close(enc.encode(TEXTS), _st(tiny[which]))
    long = ["a sentence about chargers, cables and screens " * 12]  # far past the window
    want = _st(tiny[which], texts=long)
    _close(enc.encode(long), want)
    for L in enc.model.layers:  # the same layers attending to everything: not the model
        L["window"] = None
    assert (enc.encode(long) * want).sum() < 0.99


@pytest.mark.parametrize("which", ["gemma3", "gemma3-last"])
def test_tiny_gemma3_packed_bidirectional_with_its_window_and_dense_modules(tiny, which, tmp_path):
    """EmbeddingGemma's layout: bidirectional Gemma3 (GQA, q/k norms, global and local layers), then Dense
    modules after the pooling: the packed path, equal to sentence-transformers'."""
    import shutil

    import torch
    from sentence_transformers import SentenceTransformer, models

    path = tmp_path / "with-dense"
    st = SentenceTransformer(str(tiny[which]), device="cpu")
    torch.manual_seed(0)
    SentenceTransformer(modules=[st[0], st[1], models.Dense(64, 256, bias=False, activation_function=torch.nn.Identity()),
                                 models.Dense(256, 48, bias=False, activation_function=torch.nn.Identity()), st[2]],
                        device="cpu").save(str(path))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        if (tiny[which] / f).exists() and not (path / f).exists():
            shutil.copy(tiny[which] / f, path / f)
    enc = Encoder(str(path), batch_tokens=300)
    assert enc.path == "packed" and enc.dim == 48 and not enc.model.causal
    long = ["a sentence about chargers, cables and screens " * 12]
    want = _st(path, texts=TEXTS + long)
    _close(enc.encode(TEXTS + long), want)
    for L in enc.model.layers:  # the same layers attending to everything: not the model
        L["window"] = None
    assert (enc.encode(long) * want[-1:]).sum() < 0.99


def test_generic_fallback_for_unknown_architecture(tiny):
    enc = Encoder(str(tiny["electra"]))
    assert enc.describe()["path"] == "generic"
    _close(enc.encode(TEXTS), _st(tiny["electra"]))


def test_tokenize_and_embed_from_two_threads(tiny):
    enc = Encoder(str(tiny["bert-cls"]))
    chunks = [review_texts(30, seed=s) for s in range(6)]
    expected = [enc.encode(c) for c in chunks]
    got, errors, toks = [None] * 6, [], [None] * 6
    ready = [threading.Event() for _ in chunks]

    def producer():
        try:
            for i, c in enumerate(chunks):
                toks[i] = enc.tokenize(c)
                ready[i].set()
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)
            for r in ready:
                r.set()

    t = threading.Thread(target=producer)
    t.start()
    for i in range(len(chunks)):
        ready[i].wait(60)
        got[i] = enc.embed(toks[i])
    t.join()
    assert not errors
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, atol=1e-5)


def test_tokenizer_pool_matches_in_process(tiny, monkeypatch):
    monkeypatch.setattr(tokenize_mod, "POOL_MIN_TEXTS", 10)
    enc = Encoder(str(tiny["qwen3"]), tokenizer_workers=2)
    texts = review_texts(300, seed=9)
    try:
        enc.warmup()  # starts the helpers and waits for them
        assert enc._tok._pool.ready()
        a = enc.tokenize(texts)
    finally:
        enc.close()
    b = Encoder(str(tiny["qwen3"]), tokenizer_workers=0).tokenize(texts)
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.inverse, b.inverse) and a.num_tokens == b.num_tokens


def test_chunks_start_small_and_double_up_to_the_size():
    """encode()'s chunks: the device waits only for a small first one; each next is twice the last up to the size,
    and together they cover every text once, in order."""
    cuts = encoder_mod.chunk_bounds(20_000, 2_500)
    sizes = np.diff(cuts)
    assert cuts[0] == 0 and cuts[-1] == 20_000 and (sizes > 0).all()
    assert list(sizes[:6]) == [128, 256, 512, 1024, 2048, 2500] and sizes.max() == 2500
    assert encoder_mod.chunk_bounds(100, 64, first=128) == [0, 64, 100]  # never above the size
    assert encoder_mod.chunk_bounds(0, 64) == [0]


def test_helpers_serve_the_chunks_that_begin_once_they_are_up(tiny, monkeypatch):
    """An ordinary call on a CPU never starts the helpers. Once started (on a GPU the constructor starts them),
    every chunk that begins after they are up goes to them, mid-call too, and the vectors are the same."""
    monkeypatch.setattr(tokenize_mod, "POOL_MIN_TEXTS", 10)
    monkeypatch.setattr(encoder_mod, "MIN_CHUNK", 64)
    enc = Encoder(str(tiny["bert-cls"]), tokenizer_workers=2)
    texts = review_texts(3000, seed=3)
    try:
        first = enc.encode(texts)
        assert enc._tok._pool is None and not enc._tok.pool_started  # not started by an ordinary call on a CPU
        enc._tok.start_background()
        pool = enc._tok._pool
        pool.start()  # up for real; told below to say so only from the third chunk that asks
        asked = []
        pool.ready = lambda: bool(asked.append(1)) or len(asked) > 2
        mid = enc.encode(texts)
        assert len(asked) > 3 and enc._tok.pooled == len(asked) - 2  # two chunks here, the rest on the helpers
        del pool.ready
    finally:
        enc.close()
    np.testing.assert_allclose(first, mid, atol=1e-5)


def test_a_constructor_that_fails_ends_the_helpers_it_started(tiny, monkeypatch):
    """Where the helpers start with the constructor (on a GPU), a constructor that then fails (here a --dim out of
    range, a user's error) ends them rather than leave them running with the half-built encoder."""
    monkeypatch.setattr(encoder_mod, "_helpers_at_start", lambda dev: True)
    pools = []
    start = tokenize_mod.TextTokenizer.start_background
    monkeypatch.setattr(tokenize_mod.TextTokenizer, "start_background",
                        lambda self: (start(self), pools.append(self._pool)))
    with pytest.raises(ModelError, match="--dim 100000 is out of range"):
        Encoder(str(tiny["bert-cls"]), tokenizer_workers=2, dim=100_000)
    assert len(pools) == 1 and len(pools[0].pids) == 2
    for h in pools[0]._helpers:
        assert h.proc.wait(timeout=30) is not None


def test_unresolvable_models_raise_model_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="not found"):
        Encoder(str(tmp_path / "missing"))
    with pytest.raises(ModelError, match="--model"):
        Encoder("no-such-org/no-such-model")


def test_empty_input_and_describe(tiny):
    enc = Encoder(str(tiny["bert-cls"]))
    assert enc.encode([]).shape == (0, enc.dim)
    d = enc.describe()
    assert {"model", "architecture", "path", "dtype", "device", "batch_tokens", "dim"} <= set(d)


def _minilm_tokenizer(lowercase: bool, max_length: int):
    """MiniLM's tokenizer.json (its normalizer lowercasing or not), and the library's tokenizer of it, truncating."""
    import json

    from tokenizers import Tokenizer

    from embedfleet.encode.models import read_spec, resolve_model
    from embedfleet.encode.tokenize import _tokenizer_json

    spec = json.loads(_tokenizer_json(read_spec(resolve_model(None))))
    spec["normalizer"]["lowercase"] = lowercase
    tj = json.dumps(spec)
    reference = Tokenizer.from_str(tj)
    reference.no_padding()
    reference.enable_truncation(max_length)
    return tj, reference


@pytest.mark.parametrize("lowercase", [True, False])
def test_bert_ascii_shortcuts_give_the_librarys_ids(lowercase, monkeypatch):
    """MiniLM's tokenizer splits clean ASCII text into cached words (or skips BertNormalizer on it);
    every id must match the library's full path (also for a cased BERT, which does not lowercase)."""


    from embedfleet.encode.wordpiece import LONGEST_TEXT, WORDS
    from embedfleet.synth import long_tail_texts, review_texts

    tj, reference = _minilm_tokenizer(lowercase, 256)
    fast = tokenize_mod._Tokenizer(tj, 256)
    few = ["Battery DIES after a WEEK!!", "[MASK] and [CLS] typed by a user", "Café crème — naïve", ""]
    assert tokenize_mod._split(*fast.encode(few, pad_id=0)) == [e.ids for e in reference.encode_batch(few)]
    assert fast.words is None  # a few texts: the library's path, the word path not built for them
    first = review_texts(200, seed=8)  # a first big call: the library serves it while the word path builds aside
    assert tokenize_mod._split(*fast.encode(first, pad_id=0)) == [e.ids for e in reference.encode_batch(first)]
    assert fast._building is not None
    assert fast.twin is not None and fast._words_for(tokenize_mod.WORD_PATH_MIN_TEXTS)  # both shortcuts are on
    tricky = ["Battery DIES after a WEEK!!", "tab\there\r\nCRLF  and   spaces", "[MASK] and [CLS] typed by a user",
              "[mask] lower", "Café crème — naïve", "日本語のレビュー", "vertical\x0btab", "form\x0cfeed", "del\x7fchar",
              "bell\x07", "emoji 🎉 ok", "", "   ", "MiXeD 123 $4.99 e-mail@x.com", "word " * 400,
              "a" * 101 + " and " + "b" * 100, "supercalifragilisticexpialidocious don't!!! 3.14e-3 ~x^2",
              "#tag @user http://example.com/p?q=1&r=[2] {x|y} `code` \\back", "ALLCAPS qwzxv xyzzyq",
              "long " * (LONGEST_TEXT // 5 + 1)]  # past the word path's length limit: the library's path
    texts = tricky + review_texts(300, seed=3) + long_tail_texts(300, seed=4)
    want = [e.ids for e in reference.encode_batch(texts)]

    def ids(tok, batch):
        return tokenize_mod._split(*tok.encode(batch, pad_id=0))

    assert ids(fast, texts) == want  # a mixed batch: all three paths, input order kept
    ascii_texts = [t for t in texts if t.isascii()]
    assert ids(fast, ascii_texts) == [w for t, w in zip(texts, want) if t.isascii()]
    assert ids(fast, texts[::-1]) == want[::-1]  # the word table, now full of these words, gives the same
    assert ids(fast, []) == [] and ids(fast, [""]) == [reference.encode("").ids]
    no_words = tokenize_mod._Tokenizer(tj, 256)
    no_words.words = no_words._word_args = None  # a BERT tokenizer whose self-check failed: twin and full paths
    assert ids(no_words, texts) == want and ids(no_words, []) == []
    # a table too small for the texts' words keeps its older half each time it fills: same ids
    fresh = tokenize_mod._Tokenizer(tj, 256, word_cache=64)
    fresh._words_for(tokenize_mod.WORD_PATH_MIN_TEXTS)  # built before the calls (a first call does not wait for it)
    distinct = len({w for t in ascii_texts for w in WORDS.findall(t.lower() if lowercase else t)})
    assert ids(fresh, texts) == want
    assert ids(fresh, texts) == want and len(fresh.words.table) < distinct / 2  # it did forget words


@pytest.mark.parametrize("lowercase", [True, False])
def test_non_ascii_words_give_the_librarys_ids(lowercase):
    """Non-ASCII text through a BERT tokenizer goes word by word through a cache (`word_cache.py`): the ids must be
    the library's on every script, mark and space Unicode has, cut where the library cuts; texts holding what
    str.split() and BERT's normalizer disagree on (a C0/C1 control), a lone surrogate or an added token keep the
    library's path."""


    from embedfleet.synth import world_texts

    tj, reference = _minilm_tokenizer(lowercase, 128)
    fast = tokenize_mod._Tokenizer(tj, 128)
    fast._words_for(tokenize_mod.WORD_PATH_MIN_TEXTS)
    assert fast.unicode is not None  # its self-check passed
    tricky = ["Café crème — naïve ÉTÉ «bien» „gut“", "e\u0301t\u0301e\u0301 combining marks", "a\u200bb zero\u200dwidth",
              "soft\u00adhyphen and\u00a0no-break\u3000ideographic\u2028line\u2029para\u202fnarrow", "İstanbul ΣΟΦΊΑ straße ǅ ﬁ",
              "日本語のレビュー、とても良い。" * 8, "中文评论很好 mixed 中English文", "ภาษาไทยไม่มีช่องว่าง", "मराठी हिंदी", "عربي ممتاز",
              "👨‍👩‍👧 🏴󠁧󠁢󠁳󠁣󠁴󠁿 🇯🇵 👍🏽 ❤️", "Ｆｕｌｌｗｉｄｔｈ ＡＢＣ １２３", "𝐁𝐨𝐥𝐝 𝔉𝔯𝔞𝔨𝔱𝔲𝔯", "ü" * 120 + " after", "ä " * 300,
              "Ωmega\ttab\nnew\rline", "é\x85nel", "é\x1cgroup\x1fsep", "é\x0bvt\x0cff", "é\x7fdel\x9fapc", "é [MASK] ü",
              "é [mask] lower", "\ufeffbom ü", "\ufffd replacement ü", "é", " ü ", "ü" + "\u0300" * 20]
    texts = tricky + world_texts(400, seed=6)
    want = [e.ids for e in reference.encode_batch(texts)]

    def ids(tok, batch):
        return tokenize_mod._split(*tok.encode(batch, pad_id=0))

    assert ids(fast, texts) == want
    assert ids(fast, texts[::-1]) == want[::-1]  # now from the cache
    assert len(fast.unicode._pieces) > 100
    small = tokenize_mod._Tokenizer(tj, 128, word_cache=50)  # a full cache tokenizes later new words each time
    small._words_for(tokenize_mod.WORD_PATH_MIN_TEXTS)
    assert ids(small, texts) == want and ids(small, texts) == want and len(small.unicode._pieces) <= 50
    surrogate = "lone \ud83d here ü"
    assert ids(fast, [surrogate]) == ids(tokenize_mod._Tokenizer(tj, 128), [surrogate])  # the library's path, sanitized


def test_piece_trie_splits_words_as_the_librarys_wordpiece():
    """Many words at once, the same pieces as the library's WordPiece word by word: MiniLM's vocabulary
    on long-tailed and random words, and a tiny cased one where words end up [UNK] (no piece starts at
    some place) or hold a character no piece has (the library's own answer)."""
    from tokenizers import Tokenizer, models

    from embedfleet.encode.models import resolve_model
    from embedfleet.encode.wordpiece import WORDS, PieceTrie
    from embedfleet.synth import long_tail_texts

    def check(model, vocab, words):
        ids, counts = PieceTrie(model, vocab)(words)
        want = [[t.id for t in model.tokenize(w)] for w in words]
        assert counts.tolist() == list(map(len, want)) and ids.tolist() == [i for p in want for i in p]

    full = Tokenizer.from_file(str(resolve_model(None) / "tokenizer.json"))
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz0123456789"))
    random_words = ["".join(rng.choice(letters, k)) for k in rng.integers(1, 40, 500)]
    tail = list(dict.fromkeys(w for t in long_tail_texts(500, seed=9) for w in WORDS.findall(t.lower())))
    check(full.model, full.get_vocab(with_added_tokens=False), tail + random_words + ["!", "$", "a" * 100])

    vocab = {"[UNK]": 0, "a": 1, "b": 2, "ab": 3, "##b": 4, "##c": 5, "##bc": 6, "C": 7, "##A": 8, "9": 9, "##é": 10}
    tiny = models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100)
    check(tiny, vocab, ["abc", "abbc", "ba", "c", "Cab", "CA", "ca", "a!", "9", "99", "abx", "b", "abcbc", "x"])
    check(tiny, vocab, [])


def test_word_path_slices_hold_few_enough_texts_and_characters():
    from embedfleet.encode.wordpiece import _SLICE, _SLICE_CHARS, _slices

    texts = ["x" * 1000] * 700 + ["y" * (_SLICE_CHARS + 5)] + ["z"] * 300
    ranges = _slices(texts)
    assert ranges[0][0] == 0
    assert [a for a, _ in ranges[1:]] == [b for _, b in ranges[:-1]] and ranges[-1][1] == len(texts)  # all, in order
    for a, b in ranges:
        assert 0 < b - a <= _SLICE
        assert b - a == 1 or sum(map(len, texts[a:b])) <= _SLICE_CHARS  # one text may pass the limit alone
    assert (700, 701) in ranges and _slices([]) == []


def test_word_split_is_the_pre_tokenizers_on_any_ascii():
    """numpy's split of a pass (texts joined by the separator) finds exactly the words the regex does."""
    from embedfleet.encode.wordpiece import WORDS, split_words

    rng = np.random.default_rng(0)
    alphabet = np.frombuffer(b"aZ09 \t\n\r\x01.,!'-$([{~\\" + bytes(range(32, 127)), np.uint8)
    for size in [0, 1, 2, 3, 17, 1000, 20000]:
        text = rng.choice(alphabet, size).tobytes().decode("ascii")
        starts, ends = split_words(np.frombuffer(text.encode("ascii"), np.uint8))
        assert list(zip(starts.tolist(), ends.tolist())) == [m.span() for m in WORDS.finditer(text)]


def test_bench_puts_each_tool_at_its_best_on_the_device(monkeypatch):
    from embedfleet.encode import bench

    assert bench.best_settings("cuda") == {"dtype": None, "st_dtype": "bfloat16", "st_batch": 256}
    for native, dtype in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(bench, "cpu_has_bf16", lambda native=native: native)
        assert bench.best_settings("cpu") == {"dtype": dtype, "st_dtype": dtype, "st_batch": 32}


@pytest.mark.parametrize("window", [None, 4096, 8])
def test_tiny_mistral_is_the_llama_path_unless_its_window_is_shorter_than_the_texts(tmp_path, window):
    """e5-mistral's family: Llama's layers, whose attention a sliding window bounds. Where the window is at least
    the longest text embedfleet keeps it cannot matter, and the packed path serves it; a shorter one goes to the
    generic path, which applies it."""
    path = _sharpened(build_random_model("qwen3-0.6b", tmp_path / "mistral", tiny=True, model_type="mistral"))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "sliding_window": window, "architectures": ["MistralModel"]}))
    enc = Encoder(str(path))
    assert enc.path == ("generic" if window == 8 else "packed")
    for prompt in (None, "query"):
        _close(enc.encode(TEXTS, prompt=prompt), _st(path, prompt=prompt))


@pytest.mark.parametrize("which", ["bert-cls", "electra"])
def test_weights_missing_a_parameter_are_refused_in_one_line_not_filled_at_random(tiny, tmp_path, which):
    """Packed or generic, a weights file without one of the model's tensors (another model's file, one saved
    incompletely) is refused, naming what it lacks: transformers alone would fill it with random values."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from embedfleet.errors import ModelError

    path = tmp_path / which
    shutil.copytree(tiny[which], path)
    sd = load_file(str(path / "model.safetensors"))
    gone = next(k for k in sorted(sd) if k.endswith("attention.output.dense.weight"))
    save_file({k: v for k, v in sd.items() if k != gone}, str(path / "model.safetensors"))
    with pytest.raises(ModelError, match=r"its weights lack .*attention\.output\.dense\.weight") as e:
        Encoder(str(path))
    assert "\n" not in str(e.value)


def test_one_string_is_one_vector_and_a_lone_surrogate_encodes_as_the_replacement_character(tiny):
    """`encode("a text")` gives that text's vector (it gave one per character); a lone surrogate (a JSON
    "\\ud83d" escape) encodes as U+FFFD, as ingest stores it; an item that is not a string is named."""
    enc = Encoder(str(tiny["bert-cls"]))
    one = enc.encode("a charger that stopped working")
    assert one.shape == (enc.dim,)
    np.testing.assert_array_equal(one, enc.encode(["a charger that stopped working"])[0])
    odd = enc.encode(["\ud83d broke", "fine"])
    np.testing.assert_allclose(odd, enc.encode(["\ufffd broke", "fine"]), atol=1e-6)
    with pytest.raises(TypeError, match="item 1 is NoneType"):
        enc.encode(["fine", None])


def test_a_wrong_dtype_or_device_and_a_closed_encoder_are_said_in_one_line(tiny):
    from embedfleet.errors import ModelError

    with pytest.raises(ModelError, match="dtype 'int8': use one of float32"):
        Encoder(str(tiny["bert-cls"]), dtype="int8")
    with pytest.raises(ModelError, match="device 'gpu': use auto, cpu, cuda or cuda:N"):
        Encoder(str(tiny["bert-cls"]), device="gpu")
    enc = Encoder(str(tiny["bert-cls"]), device="cpu")
    enc.close()
    with pytest.raises(ModelError, match="this Encoder is closed"):
        enc.encode(["after close"])
