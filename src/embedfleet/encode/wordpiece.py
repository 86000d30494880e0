"""BERT WordPiece on clean ASCII text, many texts at once, with one dict lookup per word.

For a BERT tokenizer (BertNormalizer, BertPreTokenizer, WordPiece) on ASCII text without control
characters, the normalizer only lowercases and the pre-tokenizer only splits words from
punctuation. So a slice of texts is joined by a separator, lowercased and split by one regex; each
word's pieces come from a table that the library's own WordPiece fills; and [CLS] … [SEP],
truncation and packing are array operations. The Python work left per word is one dict lookup,
run by `map` in C rather than by a loop. `bench/tokenize_cpu.py` on the 2-core VM, long-tailed review
texts: 12.6–15.4 µs a text once every word is known (the per-word loop before it: 16.0–16.3), 30 µs
with the default 32,768-word table (34 before), where learning new words from the library's
WordPiece (~10 a text, ~1.5 µs each) is half of it; the library alone takes ~90.

`tokenize._Tokenizer` decides which texts come here and checks at load that the ids agree with the
library's.
"""

from __future__ import annotations

import itertools
import re

import numpy as np

from embedfleet.encode.batching import cumulative

# What BertPreTokenizer makes of clean ASCII text: runs of letters and digits, and every other
# printable character (all ASCII punctuation to it) on its own; whitespace separates.
WORDS = re.compile(r"[A-Za-z0-9]+|[^A-Za-z0-9 \t\n\r]")
_SEP = "\x01"  # joins a slice's texts: a control character, so never inside a text this path takes
_SLICE = 256  # texts per pass: a pass's words (Python strings) stay small enough for the CPU's cache


class WordTable:
    """word → entry number; entry → its piece ids, a slice of one flat array. Entry 0 is the
    separator (no pieces). Entries are numbered in the order words were met, and a table past
    `max_words` keeps its older half: the words met first, which are mostly the frequent ones
    (Zipf). The bound is soft: one slice's new words are always added whole."""

    def __init__(self, wordpiece, max_words: int):
        self._model, self.max_words = wordpiece, max_words
        self.index: dict[str, int] = {_SEP: 0}
        self.start = np.zeros(1024, np.int64)  # entry → first piece in `pieces`
        self.count = np.zeros(1024, np.int64)  # entry → number of pieces
        self.pieces = np.zeros(4096, np.int32)
        self._used = 0  # pieces in use

    def __len__(self) -> int:
        return len(self.index)

    def lookup(self, words: list[str]) -> np.ndarray:
        """The entry of every word, learning the ones the table does not hold."""
        entries = self._get(words)
        missing = np.flatnonzero(entries < 0)
        if not len(missing):
            return entries
        unknown = list(map(words.__getitem__, missing.tolist()))
        new = list(dict.fromkeys(unknown))
        if len(self.index) + len(new) > self.max_words:
            self._keep(max(1, self.max_words // 2))
            self._add([w for w in dict.fromkeys(words) if w not in self.index])  # entries just dropped too
            return self._get(words)
        self._add(new)
        entries[missing] = np.fromiter(map(self.index.__getitem__, unknown), np.int64, len(unknown))
        return entries

    def _get(self, words: list[str]) -> np.ndarray:
        return np.fromiter(map(self.index.get, words, itertools.repeat(-1)), np.int64, len(words))

    def _add(self, words: list[str]) -> None:
        """Learn words from the library's WordPiece (~3.5 µs each)."""
        ids = [[t.id for t in self._model.tokenize(w)] for w in words]
        counts = np.fromiter(map(len, ids), np.int64, len(ids))
        first, total = len(self.index), int(counts.sum())
        if first + len(words) > len(self.start):
            size = 2 * (first + len(words))
            self.start, self.count = np.resize(self.start, size), np.resize(self.count, size)
        if self._used + total > len(self.pieces):
            self.pieces = np.resize(self.pieces, 2 * (self._used + total))
        self.start[first : first + len(words)] = self._used + cumulative(counts)[:-1]
        self.count[first : first + len(words)] = counts
        self.pieces[self._used : self._used + total] = np.fromiter(itertools.chain.from_iterable(ids), np.int32, total)
        self._used += total
        self.index.update(zip(words, range(first, first + len(words))))

    def _keep(self, entries: int) -> None:
        """Forget every entry from `entries` on."""
        entries = min(entries, len(self.index))
        self.index = {w: e for w, e in self.index.items() if e < entries}
        self._used = int(self.start[entries - 1] + self.count[entries - 1])


class AsciiWordPiece:
    """Ids of clean ASCII texts, `prefix` + their pieces (truncated to `room`) + `suffix`, packed."""

    def __init__(self, wordpiece, lowercase: bool, prefix: list[int], suffix: list[int], room: int,
                 max_words: int):
        self.table = WordTable(wordpiece, max_words)
        self.lowercase, self.prefix, self.suffix, self.room = lowercase, prefix, suffix, room

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Packed int32 ids and int32 lengths, in input order."""
        parts = [self._encode_slice(texts[i : i + _SLICE]) for i in range(0, len(texts), _SLICE)]
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return np.zeros(0, np.int32), np.zeros(0, np.int32)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def _encode_slice(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        joined = _SEP.join(texts)
        words = WORDS.findall(joined.lower() if self.lowercase else joined)
        entries = self.table.lookup(words)
        per_word = self.table.count[entries]
        # The text of each word: separators (no pieces) count the texts before it.
        found = np.bincount(np.cumsum(entries == 0), weights=per_word, minlength=len(texts)).astype(np.int64)
        total = int(found.sum())
        tokens = self.table.pieces[np.repeat(self.table.start[entries] - cumulative(per_word)[:-1], per_word)
                                   + np.arange(total)]
        pos = np.arange(total) - np.repeat(cumulative(found)[:-1], found)  # each token's place in its text
        kept = np.minimum(found, self.room)
        pre, suf = len(self.prefix), len(self.suffix)
        lengths = kept + pre + suf
        first = cumulative(lengths)[:-1]
        out = np.empty(int(lengths.sum()), np.int32)
        for k, t in enumerate(self.prefix):
            out[first + k] = t
        for k, t in enumerate(self.suffix):
            out[first + pre + kept + k] = t
        keep = pos < self.room
        out[(np.repeat(first + pre, found) + pos)[keep]] = tokens[keep]
        return out, lengths.astype(np.int32)
