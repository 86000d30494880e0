"""Tokenisation into packed, length-sorted arrays, optionally on a pool of processes.

One fast-tokenizer call is limited by building Python objects under the GIL (about 22k texts/s
however many cores), so big inputs go to a pool of single-threaded processes instead
(`helper_pool.HelperPool`: fresh interpreters that import this module, never the caller's
`__main__`; forking after the tokenizers library has started its threads can deadlock). `Encoder.encode`
uses the pool once it has been started (on a GPU by the Encoder's constructor, `start_background()`;
else by `warmup()`, or by a very long call), each chunk tokenizing here until the helpers are up
(docs/decisions/helper-start-without-main.md). `tokenize(…, pool=True)` called
directly starts the pool for 2,048 texts or more. This module imports no torch so that helpers start
quickly.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import threading
from dataclasses import dataclass

import numpy as np

from embedfleet.encode.batching import cumulative, length_order
from embedfleet.encode.models import _read_json, read_spec, resolve_model
from embedfleet.encode.word_cache import LIBRARY_ONLY, WordCache
from embedfleet.encode.wordpiece import LONGEST_TEXT, AsciiWordPiece
from embedfleet.errors import ModelError
from embedfleet.platform.helpers import HelperPool

log = logging.getLogger(__name__)

DEFAULT_WORD_CACHE = 1 << 18  # Settings.word_cache's default: distinct words a tokenizer remembers
POOL_MIN_TEXTS = 2048  # below this the pool's pickling costs more than it saves
# Characters of a text that can reach the model: past max_length tokens everything is cut anyway, and the
# library tokenizes the whole text first (a huge line took gigabytes). 64 characters a token
# is far more than any prose needs; only runs of whitespace or of 100+-character words could lose tokens.
CHARS_PER_TOKEN = 64
WORD_PATH_MIN_TEXTS = 64  # a query or a few texts go through the library rather than build the word path


@dataclass
class Tokenized:
    """Packed token ids of a list of texts, longest first.

    `ids` holds every sequence back to back in sorted order; `order[i]` is the input index of
    sorted sequence i, and `inverse[j]` is where input j went.
    """

    ids: np.ndarray  # int32 [num_tokens]
    lengths: np.ndarray  # int32 [n], sorted order
    order: np.ndarray  # int64 [n]
    inverse: np.ndarray  # int64 [n]
    prompt_tokens: int = 0  # each sequence's first tokens that its prompt made, as sentence-transformers counts them

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    def __len__(self) -> int:
        return int(self.lengths.shape[0])


def pack_sorted(ids: np.ndarray, lengths: np.ndarray) -> Tokenized:
    """Reorder packed ids (input order) into longest-first order, without a Python loop."""
    lengths = lengths.astype(np.int32, copy=False)
    order = length_order(lengths)
    sorted_len = lengths[order].astype(np.int64)
    src_start = cumulative(lengths)[:-1][order]
    dst_start = cumulative(sorted_len)[:-1]
    gather = np.arange(int(sorted_len.sum()), dtype=np.int64) + np.repeat(src_start - dst_start, sorted_len)
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return Tokenized(ids[gather], sorted_len.astype(np.int32), order, inverse)


# ASCII control characters that BERT's text cleaning deletes (tab, newline and CR it turns into spaces).
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


class _Tokenizer:
    """A model's fast tokenizer, with shortcuts for BERT-style tokenizers on clean ASCII text.

    Tokenizing is most of the CPU a small model's pipeline spends per row. For a BERT tokenizer
    (BertNormalizer, BertPreTokenizer, WordPiece) on ASCII text without control characters, the
    normalizer only lowercases and the pre-tokenizer only splits words from punctuation, so:

    - `words`: such texts go to `wordpiece.AsciiWordPiece` (words found and hashed by numpy, a table
      of their pieces, new words split by WordPiece's longest match over a trie of the vocabulary),
      several times faster than the library (docs/decisions/wordpiece-tokenizer.md). Texts that could hold an
      added token ([MASK], …) skip this path: the library matches those before anything else.
    - `twin`: the library with a normalizer that only lowercases, for those texts (its normalizer's work left out).
    - `unicode`: non-ASCII texts go word by word through `word_cache.WordCache` (each whitespace-separated word's
      pieces from the library once), except those holding a character Python splits at and BERT's normalizer
      deletes, a lone surrogate, or an added token.

    Every other text takes the library's full path. The ids are the same (tests/encode/test_encode.py),
    and a self-check at load turns the word path off should a tokenizer disagree.
    """

    def __init__(self, tokenizer_json: str, max_length: int, shortcuts: bool = True, word_cache: int = DEFAULT_WORD_CACHE):
        from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

        self.word_cache = word_cache
        def load():
            tok = Tokenizer.from_str(tokenizer_json)
            tok.no_padding()
            tok.enable_truncation(max_length)
            return tok

        self.full, self.twin, self.words, self.unicode = load(), None, None, None
        # The word path's table learns new words and its hasher grows: one thread at a time (encode()
        # tokenizes on two threads when there are no helpers, or while they start).
        self._words_lock = threading.Lock()
        self._word_args: tuple | None = None  # set: the word path is built at the first call that pays
        self._building: threading.Thread | None = None
        norm = self.full.normalizer
        if not shortcuts or not isinstance(norm, normalizers.BertNormalizer):
            return
        self.twin = load()
        self.twin.normalizer = normalizers.Lowercase() if norm.lowercase else None
        if isinstance(self.full.pre_tokenizer, pre_tokenizers.BertPreTokenizer) and isinstance(
                self.full.model, models.WordPiece):
            self._word_args = (max_length, norm.lowercase)

    def _words_for(self, n: int, wait: bool = True) -> AsciiWordPiece | None:
        """The word path, its build (a trie of the vocabulary and tables) started by the first call of
        WORD_PATH_MIN_TEXTS texts or more; None before that (the library's ids are the same) and where it does not
        apply. `wait=False`: not waiting for a build under way, whose thread goes on while the library serves."""
        if self._word_args is not None and n >= WORD_PATH_MIN_TEXTS:
            with self._words_lock:
                if self._building is None:
                    self._building = threading.Thread(target=self._build_words, name="embedfleet-words")
                    self._building.start()
            if wait:
                self._building.join()
        return self.words

    def _build_words(self) -> None:
        try:
            words, unicode = self._word_path(*self._word_args)
        except Exception as err:  # noqa: BLE001 - the library's path serves every text, as where none applies
            log.warning("the tokenizer's word path could not be built (%s); the library tokenizes every text", err)
            words = unicode = None
        with self._words_lock:
            self.words, self.unicode, self._word_args = words, unicode, None

    def _word_path(self, max_length: int, lowercase: bool) -> tuple[AsciiWordPiece | None, WordCache | None]:
        """The word path for clean ASCII text and the word cache for the rest, each None where its self-check
        finds ids other than the library's."""
        model = self.full.model
        # The special tokens the post-processor puts around a text ([CLS] … [SEP]), found by example.
        probe = self.twin.encode("hello", add_special_tokens=True).ids
        core = [t.id for t in model.tokenize("hello")]
        at = next((i for i in range(len(probe)) if probe[i : i + len(core)] == core), None)
        if at is None or len(probe) == len(core):  # no [CLS] … [SEP]: an empty text would have no ids
            return None, None
        prefix, suffix = probe[:at], probe[at + len(core) :]
        room = max_length - len(prefix) - len(suffix)
        if room <= 0:
            return None, None
        added = [t.content for t in self.full.get_added_tokens_decoder().values()]
        self._added = re.compile("|".join(map(re.escape, added)), re.IGNORECASE) if added else None
        words = AsciiWordPiece(model, self.full.get_vocab(with_added_tokens=False), lowercase, prefix, suffix, room,
                               self.word_cache)
        check = ["Hello, World! It's $4.99 (ok?) e-mail@x.com", "word " * (max_length + 10), "", "x" * 150]
        if _split(*words.encode(check)) != [e.ids for e in self.twin.encode_batch(check)]:
            words = None  # a tokenizer this reimplementation does not match: the library's path only
        unicode = WordCache(self.full, prefix, suffix, room, self.word_cache)
        check = ["Café crème — naïve ÉTÉ", "日本語のレビュー、とても良い。", "İstanbul ΣΟΦΊΑ straße ǅ", "e\u0301 a\u200bb",
                 "Emoji 🎉👍🏽 ok", "Ｆｕｌｌｗｉｄｔｈ ＡＢＣ", "ü " * (max_length + 10), "ä" * 150, "\u00a0\u3000x\u2028y"]
        if _split(*unicode.encode(check)) != [e.ids for e in self.full.encode_batch(check)]:
            unicode = None
        return words, unicode

    def word_tokens_many(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
        """(starts, ends, pieces) of each text's words by the word path, where it applies to this
        tokenizer and to the text, else None; the texts it takes done together."""
        words = self._words_for(WORD_PATH_MIN_TEXTS)
        out: list = [None] * len(texts)
        if words is None:
            return out
        clean = [i for i, t in enumerate(texts) if t.isascii() and _CONTROL.search(t) is None
                 and (self._added is None or self._added.search(t) is None)]
        with self._words_lock:
            for i, w in zip(clean, words.word_tokens_many([texts[i] for i in clean])):
                out[i] = w
        return out

    def encode(self, texts: list[str], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
        """Packed int32 ids and int32 lengths, in input order; an empty encoding becomes [pad_id]."""
        if self.twin is None:
            return _pack(self.full, texts, range(len(texts)), pad_id)
        words = self._words_for(len(texts), wait=False)  # the first big call's texts do not wait for its build
        unicode = self.unicode
        # each text's route to the library's ids, fastest first: the ASCII word path, the word cache (non-ASCII),
        # the library's twin (no offsets), the library's full tokenizer (what the others cannot take)
        by_words: list[int] = []
        by_cache: list[int] = []
        by_twin: list[int] = []
        by_full: list[int] = []
        added = self._added if words is not None or unicode is not None else None
        for i, t in enumerate(texts):
            if not t.isascii():
                clean = unicode is not None and LIBRARY_ONLY.search(t) is None and (added is None or added.search(t) is None)
                (by_cache if clean else by_full).append(i)
            elif _CONTROL.search(t) is not None:
                by_full.append(i)
            elif words is not None and len(t) <= LONGEST_TEXT and (added is None or added.search(t) is None):
                by_words.append(i)
            else:
                by_twin.append(i)
        if words is not None and len(by_words) == len(texts):
            with self._words_lock:
                return words.encode(texts)
        groups = []
        if by_words:
            with self._words_lock:
                groups.append((by_words, *words.encode([texts[i] for i in by_words])))
        if by_cache:
            groups.append((by_cache, *unicode.encode([texts[i] for i in by_cache])))
        groups += [(idx, *_pack(tok, texts, idx, pad_id)) for tok, idx in ((self.twin, by_twin), (self.full, by_full))
                   if idx]
        return _merge(len(texts), groups)


def _pack(tokenizer, texts: list[str], idx, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The library's ids of texts[i] for i in `idx`, packed."""
    batch = [texts[i] for i in idx]
    try:
        encoded = tokenizer.encode_batch_fast(batch, add_special_tokens=True)
    except TypeError:  # a lone surrogate (a JSON "\ud83d" escape, bytes read with surrogateescape): U+FFFD, as stored
        from embedfleet.sources.records import sanitize

        encoded = tokenizer.encode_batch_fast([sanitize(t) if isinstance(t, str) else t for t in batch],
                                              add_special_tokens=True)
    seqs = [e.ids or [pad_id] for e in encoded]
    lengths = np.fromiter(map(len, seqs), dtype=np.int32, count=len(seqs))
    ids = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int32, count=int(lengths.sum()))
    return ids, lengths


def _merge(n: int, groups: list[tuple[list[int], np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Packed (ids, lengths) of several groups of input indices, as one packing in input order."""
    lengths = np.zeros(n, np.int32)
    for idx, _, lens in groups:
        lengths[idx] = lens
    first = cumulative(lengths)[:-1]
    out = np.empty(int(lengths.sum()), np.int32)
    for idx, ids, lens in groups:
        out[np.repeat(first[idx] - cumulative(lens)[:-1], lens) + np.arange(len(ids))] = ids
    return out, lengths


def _split(ids: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    """Packed ids back into one list per text."""
    return [a.tolist() for a in np.split(ids, cumulative(lengths)[1:-1])] if len(lengths) else []


_WORKER: tuple | None = None


def _worker_init(tokenizer_json: str, max_length: int, pad_id: int, word_cache: int) -> None:
    # One process per core already: threads inside each would oversubscribe the CPU.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    global _WORKER
    _WORKER = (_Tokenizer(tokenizer_json, max_length, word_cache=word_cache), pad_id)


def _worker_encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return _WORKER[0].encode(texts, _WORKER[1])


def default_workers(cores: int | None = None) -> int:
    """Half of `cores` (default: this machine's), at most 8 (measured best on a 32-core host), none
    under 4 cores."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return 0 if cores < 4 else min(8, cores // 2)


@dataclass(frozen=True)
class TokenizerSpec:
    """What it takes to rebuild a model's tokenizer in another process (picklable)."""

    tokenizer_json: str
    max_length: int
    pad_id: int = 0
    lowercase: bool = False
    prefix: str = ""  # the prompt put before every text
    word_cache: int = DEFAULT_WORD_CACHE  # Settings.word_cache of the process that made the spec, carried to helpers

    def build(self, workers: int | None = 0, shortcuts: bool = True) -> "TextTokenizer":
        """The tokenizer, in this process (`workers` 0) or with a pool of processes (None: the default).
        `shortcuts=False`: the library's path alone, the same ids, quicker to build for a few texts."""
        return TextTokenizer(self.tokenizer_json, self.max_length, self.pad_id, workers, lowercase=self.lowercase,
                             shortcuts=shortcuts, word_cache=self.word_cache)


class TextTokenizer:
    """Thread-safe: `tokenize` may run on a prefetch thread while the GPU thread embeds."""

    def __init__(self, tokenizer_json: str, max_length: int, pad_id: int = 0, workers: int | None = None,
                 lowercase: bool = False, shortcuts: bool = True, word_cache: int | None = None):
        self._json, self.max_length, self.pad_id, self.lowercase = tokenizer_json, max_length, pad_id, lowercase
        self.word_cache = word_cache or DEFAULT_WORD_CACHE
        self._local = _Tokenizer(tokenizer_json, max_length, shortcuts, self.word_cache)
        self.workers = default_workers() if workers is None else max(0, int(workers))
        self._pool: HelperPool | None = None
        self.pooled = 0  # chunks the helpers tokenized
        self._prompt_lengths: dict[str, int] = {}
        self._lock = threading.Lock()

    def _start_pool(self) -> HelperPool | None:
        """The pool, its processes started (not waited for) on the first call."""
        with self._lock:
            if self._pool is None and self.workers:
                try:
                    self._pool = HelperPool(self.workers, _worker_init,
                                            (self._json, self.max_length, self.pad_id, self.word_cache), name="tokenizer")
                except OSError as err:  # no interpreter to start (an embedded Python): tokenize here
                    log.warning("tokenizer helpers could not start (%s); tokenizing in this process", err)
                    self.workers = 0
            return self._pool

    def start(self) -> None:
        """Start the pool's processes and wait for them (each imports and loads the tokenizer: a
        fraction of a second), so that the first big batch finds them ready."""
        pool = self._start_pool()
        if pool is not None:
            pool.start()

    def start_background(self) -> None:
        """Start the pool's processes without waiting for them: calls use them once they are up."""
        self._start_pool()

    @property
    def pool_started(self) -> bool:
        return self._pool is not None

    def encode_unsorted(self, texts: list[str], pool: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Packed ids and lengths in input order: on the helpers when `pool` and there are enough
        texts (starting them if need be, here until they are up), else in this process."""
        cap = self.max_length * CHARS_PER_TOKEN
        texts = [t if len(t) <= cap else t[:cap] for t in texts]
        if self.lowercase:
            texts = [t.lower() for t in texts]
        helpers = self._start_pool() if pool and self.workers and len(texts) >= POOL_MIN_TEXTS else None
        if helpers is not None and helpers.broken is not None and not helpers.ready():
            log.warning("tokenizer helpers failed to start (%s); tokenizing in this process", helpers.broken)
            self.close()
            self.workers, helpers = 0, None
        if helpers is None or not helpers.ready():  # small, or the helpers are still starting: here
            return self._local.encode(texts, self.pad_id)
        with self._lock:
            self.pooled += 1
        step = max(256, -(-len(texts) // (self.workers * 4)))
        parts = helpers.map(_worker_encode, [texts[i : i + step] for i in range(0, len(texts), step)])
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def build_word_path(self) -> None:
        """Build the word path now rather than at the first big call: a helper's every call is big,
        and its first unit is one the GPU waits for."""
        self._local._words_for(WORD_PATH_MIN_TEXTS)

    def word_tokens_many(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
        """(starts, ends, pieces) of each text's words by this tokenizer's word path (BERT-style
        tokenizers on clean ASCII text), or None where it does not apply: the passage splitter's cuts.
        Done together: one pass over the texts' new words."""
        return self._local.word_tokens_many(texts)

    def spec(self, prefix: str = "") -> TokenizerSpec:
        """How to rebuild this tokenizer (with a prompt prefix) in another process."""
        return TokenizerSpec(self._json, self.max_length, self.pad_id, self.lowercase, prefix, self.word_cache)

    def tokenize(self, texts: list[str], prefix: str = "", pool: bool = True) -> Tokenized:
        if not prefix:
            return pack_sorted(*self.encode_unsorted(list(texts), pool))
        tok = pack_sorted(*self.encode_unsorted([prefix + t for t in texts], pool))
        tok.prompt_tokens = self.prompt_tokens(prefix)
        return tok

    def prompt_tokens(self, prefix: str) -> int:
        """The tokens `prefix` makes at the start of a sequence: the prompt tokenized alone, less a special token
        that ends it (a [SEP] or an end-of-text), as sentence-transformers counts a prompt it leaves out of a mean."""
        if not prefix:
            return 0
        if prefix not in self._prompt_lengths:
            enc = self._local.full.encode(prefix.lower() if self.lowercase else prefix)
            n = len(enc.ids)
            self._prompt_lengths[prefix] = n - 1 if n and enc.special_tokens_mask[-1] else n
        return self._prompt_lengths[prefix]

    def close(self, wait: bool = True) -> None:
        """End the helpers: after their running calls (`wait`), or at once."""
        with self._lock:
            if self._pool is not None:
                self._pool.close(wait)
                self._pool = None


# What a slow tokenizer is built from: without any, transformers makes one of an empty vocabulary whose every
# word is [UNK], and every text would embed alike.
_VOCAB_FILES = ("vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model", "tokenizer.model")


def _tokenizer_json(spec) -> str:
    for d in (spec.hf_dir, spec.path):
        if (d / "tokenizer.json").exists():
            return (d / "tokenizer.json").read_text(encoding="utf-8")
    from embedfleet.encode.models import remote_code

    custom = spec.custom is not None or remote_code(spec) is not None  # its own code may build one from nothing
    if not custom and not any((d / f).exists() for d in (spec.hf_dir, spec.path) for f in _VOCAB_FILES) and not any(
            spec.hf_dir.glob("*.model")):
        raise ModelError(f"model {spec.path} has no usable tokenizer: none of tokenizer.json, {', '.join(_VOCAB_FILES)} "
                         f"is in {spec.hf_dir}; copy the model's tokenizer files there")

    try:  # a slow-only tokenizer: let transformers convert it
        from transformers import AutoTokenizer

        # a model with code of its own got here only with --trust-remote-code (models.check_remote_code)
        return AutoTokenizer.from_pretrained(str(spec.hf_dir), trust_remote_code=custom).backend_tokenizer.to_str()
    except Exception as err:
        why = " ".join(str(err).split())  # the whole reason, on one line
        raise ModelError(f"model {spec.path} has no usable tokenizer: {why[:300]}") from None


def model_tokenizer(spec, prompt: str | None = None, word_cache: int | None = None) -> TokenizerSpec:
    """The tokenizer of a model directory (a `models.ModelSpec`) as the model's own config sets it up,
    with `prompt` (a name or literal text; None: the model's default) put before every text."""
    st = _read_json(spec.hf_dir / "sentence_bert_config.json") or {}
    pad = spec.config.get("pad_token_id")
    return TokenizerSpec(_tokenizer_json(spec), spec.max_seq_length, pad if isinstance(pad, int) else 0,
                         bool(st.get("do_lower_case")), spec.prompt_text(prompt), word_cache or DEFAULT_WORD_CACHE)


def tokenizer_spec(model=None, prompt: str | None = None, word_cache: int | None = None,
                   default_model: str | None = None) -> TokenizerSpec:
    """`Encoder(model).tokenizer_spec(prompt)` without torch or the weights: a worker's helpers start
    with it while the model loads. `default_model`: the model when none is named (Settings.model)."""
    return model_tokenizer(read_spec(resolve_model(model or default_model)), prompt, word_cache)
