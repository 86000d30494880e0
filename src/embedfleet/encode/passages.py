"""Passages: a long text cut into pieces of at most N tokens of the model's own tokenizer, so that every
part of a Wikipedia article is embedded, not only its first 256 tokens (`ingest --passages 200:32`).

Cuts fall on sentence ends where one is near, else between words, and only inside a word when a single
word is longer than a passage; consecutive passages share OVERLAP tokens. A passage's text is exactly a
slice of the record's text. `spans` is pure (token offsets in, character ranges out); `Splitter` holds
the tokenizer and checks each passage against the limit as the embedding will see it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import numpy as np

from embedfleet.errors import InputError
from embedfleet.sources.records import Column, Record

__all__ = ["COLUMNS", "parse_passages", "room", "spans", "piece_offsets", "Splitter", "expand"]

# What a passage row has besides its record's columns: the record it came from and its place in it.
COLUMNS = (Column("parent_id", "text"), Column("passage", "integer"))
_SENTENCE_END = re.compile(r"[.!?。！？…]['\"”’)\]]*$")
_SENTENCE_TAIL = ".!?。！？…'\"”’)]"  # a token that ends a sentence ends with one of these
_IS_TAIL = np.zeros(1 << 16, bool)  # by code point (any above the table's end is none of them)
_IS_TAIL[[ord(c) for c in _SENTENCE_TAIL]] = True
# Chinese and Japanese write no spaces between words or after a sentence's end: next to one of their characters
# (kana, ideographs, their punctuation and full-width forms) a token starts a word as if a space were there.
_NO_SPACES = np.zeros(1 << 16, bool)
for _a, _b in ((0x3000, 0x30FF), (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0xFF00, 0xFFEF)):
    _NO_SPACES[_a:_b + 1] = True
_WINDOW_CHARS = 100_000  # a long text is tokenized a window at a time, each cut at whitespace
# A slice tokenized on its own differs from its tokens in context only at its two ends (a word cut in two,
# a BPE word without its leading space): a token or so each. Only pieces this near the limit are checked.
EDGE = 4


def parse_passages(value: str | None) -> tuple[int, int] | None:
    """"256:32" → (256, 32); "256" → (256, 0); None → None. One-line errors for anything else."""
    if value is None:
        return None
    tokens, _, overlap = str(value).partition(":")
    if not tokens.strip().isdigit() or (overlap and not overlap.strip().isdigit()):
        raise InputError(f"--passages {value!r}: use TOKENS or TOKENS:OVERLAP, e.g. 200:32")
    size, over = int(tokens), int(overlap or 0)
    if size < 8:
        raise InputError(f"--passages {value!r}: a passage needs at least 8 tokens")
    if over >= size // 2:
        raise InputError(f"--passages {value!r}: the overlap must be less than half a passage")
    return size, over


def room(tokenizer_json: str, max_length: int, prefix: str = "") -> int:
    """Tokens left for a passage once the model's special tokens and the prompt are in: what a passage
    may hold for the embedding to see all of it."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    tok.no_truncation()
    tok.no_padding()
    specials = len(tok.encode("", add_special_tokens=True).ids)
    prompt = len(tok.encode(prefix, add_special_tokens=False).ids) if prefix else 0
    return max_length - specials - prompt


class _Bounds:
    """A text's token boundaries as arrays, so each cut is a lookup, not a walk over tokens (the walk
    was a large share of a passage helper's time: docs/decisions/passage-splitting.md). Token c "starts a word" when whitespace (or nothing the
    tokenizer kept) lies between it and token c-1, or either is Chinese or Japanese, or c is 0; it "starts a
    sentence" when it starts a word and token c-1 ends a sentence."""

    def __init__(self, offsets, text: str):
        o = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
        self.n = n = len(o)
        idx = np.arange(n)
        chars = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)  # one per character
        last_char = np.minimum(chars[o[:-1, 1] - 1], len(_IS_TAIL) - 1)  # of each token but the last
        word = np.ones(n, bool)
        word[1:] = (o[1:, 0] > o[:-1, 1]) | _NO_SPACES[last_char] | _NO_SPACES[np.minimum(chars[o[1:, 0]], 0xFFFF)]
        sentence = np.zeros(n, bool)
        tail = np.zeros(n, bool)
        tail[1:] = _IS_TAIL[last_char]
        for c in np.flatnonzero(word & tail).tolist():  # a token ending in . ! ? (and their kin), then a gap
            sentence[c] = _SENTENCE_END.search(text[o[c - 1, 0]:o[c - 1, 1]]) is not None
        self.word = word
        self.last_word = np.maximum.accumulate(np.where(word, idx, -1))  # the last word start at or before c
        self.last_sentence = np.maximum.accumulate(np.where(sentence, idx, -1))
        nxt = np.where(word, idx, n)
        self.next_word = np.minimum.accumulate(nxt[::-1])[::-1]  # the first word start at or after c

    def cut(self, start: int, end: int) -> int:
        """Where to end a passage that may hold tokens [start, end) (end < n): after a sentence in its
        second half, else between two words there, else in its first half, else (one word longer than
        a passage) at `end`."""
        half = start + max(1, (end - start) // 2)
        if self.last_sentence[end] >= half:
            return int(self.last_sentence[end])
        if self.last_word[end] >= half:
            return int(self.last_word[end])
        if self.last_word[half - 1] > start:
            return int(self.last_word[half - 1])
        return end

    def word_start(self, at: int, limit: int) -> int:
        """The first token at or after `at` (before `limit`) that begins a word; `at` if none does."""
        c = int(self.next_word[at])
        return c if c < limit else at

    def whole_words(self, a: int, b: int) -> bool:
        return bool(self.word[a]) and (b == self.n or bool(self.word[b]))


def spans(offsets, text: str, size: int, overlap: int,
          fits: Callable[[str], bool] | None = None, words_stay: bool = False) -> list[tuple[int, int]]:
    """(start, end) character ranges of the passages of `text`, from its tokens' character `offsets`
    (pairs, or an (n, 2) array; without special tokens): at most `size` tokens each, the next starting
    `overlap` tokens before the previous one's end (at a word's start where the overlap holds one).
    `fits(piece)`, if given, has the last word on pieces within EDGE tokens of the limit: a piece it
    refuses is cut shorter. `words_stay`: the tokenizer splits a slice cut between words into the same
    tokens as in context (WordPiece after BERT's pre-tokenizer), so such pieces need no check."""
    o = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    b = _Bounds(o, text)
    n, out, start = b.n, [], 0
    first, last = o[:, 0].tolist(), o[:, 1].tolist()
    while start < n:
        limit = min(start + size, n)
        while True:
            cut = b.cut(start, limit) if limit < n else n
            if (fits is None or cut - start <= max(1, size - EDGE) or (words_stay and b.whole_words(start, cut))
                    or fits(text[first[start]:last[cut - 1]])):
                break
            limit = cut - 1
        out.append((first[start], last[cut - 1]))
        if cut >= n:
            break
        start = b.word_start(max(cut - overlap, start + 1), cut) if overlap else cut
    return out


def piece_offsets(starts: np.ndarray, ends: np.ndarray, pieces: np.ndarray) -> np.ndarray:
    """Token offsets ((n, 2) array) from words (start, end, number of pieces): a word's pieces are
    contiguous spans inside it, the last one ending where the word ends. Exact at every word boundary,
    which is all the cuts use (a cut inside a word, for a word longer than a passage, is checked by `fits`)."""
    keep = pieces > 0
    starts, ends, pieces = starts[keep], ends[keep], pieces[keep].astype(np.int64)
    k = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)  # place in its word
    first = np.repeat(starts, pieces) + k
    last = np.where(k == np.repeat(pieces, pieces) - 1, np.repeat(ends, pieces), first + 1)
    return np.stack([first, last], axis=1)


class Splitter:
    """Cuts texts into passages with a model's tokenizer (tokenizer.json), none longer than `size` tokens.
    `words`: a tokenizer's `word_tokens_many` (TextTokenizer), which gives each text's words and their
    pieces where its word path applies — the same word table the texts are then tokenized with."""

    def __init__(self, tokenizer_json: str, size: int, overlap: int,
                 words: Callable[[list[str]], list[tuple | None]] | None = None):
        from tokenizers import Tokenizer, models, pre_tokenizers

        self.size, self.overlap = size, overlap
        self.tok = Tokenizer.from_str(tokenizer_json)
        self.tok.no_truncation()
        self.tok.no_padding()
        self.words_stay = isinstance(self.tok.model, models.WordPiece) and isinstance(
            self.tok.pre_tokenizer, pre_tokenizers.BertPreTokenizer)
        self._words = words if self.words_stay else None

    def _offsets(self, text: str, words: tuple | None = None):
        """Token offsets of the whole text: from its `words` and their piece counts where the tokenizer's
        word path takes the text (clean ASCII, a BERT tokenizer: the library's encode was most of a
        helper's time per passage), else from the library, a window at a time (cut at whitespace) so
        that a huge document never becomes one huge encoding."""
        if words is not None:
            return piece_offsets(*words)
        out, base = [], 0
        while base < len(text):
            end = len(text) if len(text) - base <= _WINDOW_CHARS else (text.rfind(" ", base, base + _WINDOW_CHARS) + 1
                                                                          or base + _WINDOW_CHARS)
            enc = self.tok.encode(text[base:end], add_special_tokens=False)
            out.extend((base + s, base + e) for s, e in enc.offsets if e > s)
            base = end
        return out

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def words(self, texts: list[str]) -> list[tuple | None]:
        """Each text's words and piece counts by the word path, or None (the library's offsets)."""
        return self._words(texts) if self._words is not None else [None] * len(texts)

    def split(self, text: str, words: tuple | None = None) -> list[str]:
        """`text`'s passages; `words`: its entry of `words([...])`, if asked already."""
        offsets = self._offsets(text, words if words is not None else self.words([text])[0])
        if len(offsets) == 0:
            return [text]
        # Tokenized on its own a piece can take a token more than in context (a word cut in two, a BPE
        # word without its leading space): each is checked as the embedding will see it.
        return [text[s:e] for s, e in spans(offsets, text, self.size, self.overlap,
                                            fits=lambda piece: self.count(piece) <= self.size,
                                            words_stay=self.words_stay)]


def expand(records: list[Record], splitter: Splitter) -> list[Record]:
    """Each record as its passages: id `<record id>#<n>`, `parent_id`, `passage` n (0-based), the
    passage's text as content, and the record's other values. Of records sharing an id, the last only: an
    earlier one's passages past the last one's count would stay beside them."""
    records = [records[i] for i in sorted({r.id: i for i, r in enumerate(records)}.values())]
    out = []
    words = splitter.words([r.content for r in records])  # the unit's new words learnt in one pass
    for r, w in zip(records, words):
        for n, piece in enumerate(splitter.split(r.content, w)):
            out.append(dataclasses.replace(r, id=f"{r.id}#{n}", content=piece,
                                           values={**r.values, "parent_id": r.id, "passage": n}))
    return out
