"""BERT WordPiece on clean ASCII text, many texts at once, without a Python object per word.

For a BERT tokenizer (BertNormalizer, BertPreTokenizer, WordPiece) on ASCII text without control
characters, the normalizer only lowercases and the pre-tokenizer only splits words from
punctuation. So a slice of texts is joined by a separator and lowercased; numpy finds the words
(a table of byte classes) and hashes each one (two 64-bit polynomial hashes from prefix sums); each
hash is looked up in an open-addressing table whose entries hold the word's pieces; [CLS] … [SEP],
truncation and packing are array operations. Only words the table lacks become Python strings, and
all of a slice's new words are split into pieces at once, by WordPiece's own greedy longest match
walked over a trie of the vocabulary (`PieceTrie`).

Several times faster than the library's own WordPiece, which builds a Python object per piece
(docs/decisions/wordpiece-tokenizer.md; `bench/tokenize_cpu.py` measures it).

`tokenize._Tokenizer` decides which texts come here and checks at load that the ids agree with the
library's.
"""

from __future__ import annotations

import re

import numpy as np

from embedfleet.encode.batching import cumulative

# What BertPreTokenizer makes of clean ASCII text: runs of letters and digits, and every other
# printable character (all ASCII punctuation to it) on its own; whitespace separates. (The numpy
# split below does the same; tests count words with this.)
WORDS = re.compile(r"[A-Za-z0-9]+|[^A-Za-z0-9 \t\n\r]")
_SEP = "\x01"  # joins a slice's texts: a control character, so never inside a text this path takes
_SLICE = 256  # texts per pass, and at most _SLICE_CHARS of them: the pass's arrays stay in the CPU's cache
_SLICE_CHARS = 1 << 18
LONGEST_TEXT = 1 << 16  # longer texts take the library's path: this one's arrays grow with a pass's length

_SPACE, _ALNUM, _SINGLE = 0, 1, 2
_CLASS = np.full(256, _SINGLE, np.uint8)  # byte → what it is to the pre-tokenizer
_CLASS[np.frombuffer(b" \t\n\r", np.uint8)] = _SPACE
_CLASS[np.frombuffer(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", np.uint8)] = _ALNUM

# Two independent polynomial hashes modulo 2**64 (odd bases, so each has an inverse): a word's hash
# is (H[end] - H[start]) * base**-start from one prefix sum over the slice. Together 128 bits: two
# distinct words of at most `max_input_chars_per_word` (100) bytes share both with a chance of
# ~1e-38 a pair (equal-length collisions built on purpose need thousands of bytes; longer words are
# [UNK] without a lookup).
_BASES = (0x100000001B3, 0x9E3779B97F4A7C15)
_FIB = np.uint64(0x9E3779B97F4A7C15)  # spreads a hash's high bits over the slot number


def _inverse(base: int) -> int:
    """base**-1 modulo 2**64 (Newton's iteration; base odd)."""
    inv = base
    for _ in range(6):
        inv = inv * (2 - base * inv) % (1 << 64)
    return inv


def _powers(base: int, n: int) -> np.ndarray:
    factors = np.full(n, base, np.uint64)
    factors[0] = 1
    with np.errstate(over="ignore"):
        return np.cumprod(factors, dtype=np.uint64)


class _Hasher:
    """Both hashes of byte ranges of one buffer; base powers grow as longer buffers come."""

    def __init__(self):
        self._size = 0
        self._grow(1 << 16)

    def _grow(self, n: int) -> None:
        self._size = n
        self._pow = [_powers(b, n) for b in _BASES]
        self._inv = [_powers(_inverse(b), n) for b in _BASES]

    def __call__(self, data: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = len(data)
        if n + 1 > self._size:
            self._grow(n + 1)
        values = data.astype(np.uint64)
        out = []
        with np.errstate(over="ignore"):
            for pw, inv in zip(self._pow, self._inv):
                prefix = np.zeros(n + 1, np.uint64)
                np.cumsum(values * pw[:n], out=prefix[1:])
                out.append((prefix[ends] - prefix[starts]) * inv[starts])
        out[0] |= np.uint64(1)  # 0 marks an empty slot
        return out[0], out[1]


def split_words(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and end (exclusive) of every word in ASCII bytes, as `WORDS` finds them."""
    if not len(data):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    kind = _CLASS[data]
    alnum = kind == _ALNUM
    single = kind == _SINGLE
    before = np.concatenate([[False], alnum[:-1]])
    after = np.concatenate([alnum[1:], [False]])
    return np.flatnonzero((alnum & ~before) | single), np.flatnonzero((alnum & ~after) | single) + 1


class PieceTrie:
    """WordPiece's split of many words at once: the library's greedy longest match, walked over a trie.

    At each place in a word WordPiece takes the longest vocabulary piece that starts there (after
    the first, pieces with the `##` prefix), and a word with a place where none does is the unknown
    token. Every word here walks the trie of the vocabulary's pieces a character per round, all words
    together in numpy, remembering the last piece it passed; where it can go no further that piece is
    taken and the walk starts again after it. The library, asked word by word, is slower (its own Rust
    loop tries every shorter substring, and a Python object per piece comes back). Only pieces of
    letters and digits are in the trie: a word with any other character (a punctuation mark, once)
    goes to the library."""

    _WORD_START, _GOING_ON = 1, 2  # the two roots; node 0 is "no way on"

    def __init__(self, wordpiece, vocab: dict[str, int]):
        self._library = wordpiece
        self.unk = wordpiece.token_to_id(wordpiece.unk_token)
        going_on = wordpiece.continuing_subword_prefix
        plain = re.compile(r"[A-Za-z0-9]+")
        pieces = []  # (root, characters, id)
        for piece, i in vocab.items():
            root = self._WORD_START
            if going_on and piece.startswith(going_on) and len(piece) > len(going_on):
                root, piece = self._GOING_ON, piece[len(going_on) :]
            if plain.fullmatch(piece):
                pieces.append((root, piece, i))
        chars = sorted({c for _, piece, _ in pieces for c in piece})
        self._cols = len(chars) + 1  # the last column, any other byte, leads nowhere
        self._column = np.full(256, len(chars), np.intp)
        self._column[np.frombuffer("".join(chars).encode("ascii"), np.uint8)] = np.arange(len(chars))
        child: dict[tuple[int, str], int] = {}
        piece_id = [-1, -1, -1]  # node → the piece ending there, -1 if none
        for root, piece, i in pieces:
            node = root
            for c in piece:
                node = child.setdefault((node, c), len(piece_id))
                if node == len(piece_id):
                    piece_id.append(-1)
            piece_id[node] = i
        self._piece = np.array(piece_id, np.int32)
        self._next = np.zeros(len(piece_id) * self._cols, np.intp)  # node × column → next node
        if child:
            at = np.array([node * self._cols + self._column[ord(c)] for node, c in child], np.intp)
            self._next[at] = np.fromiter(child.values(), np.intp, len(child))

    def __call__(self, words: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The piece ids of every word (ASCII, no whitespace), one word after another, and how many each has."""
        n = len(words)
        data = np.frombuffer(("\x00".join(words) + "\x00").encode("ascii"), np.uint8)  # a stop after each word
        lengths = np.fromiter(map(len, words), np.intp, n)
        starts = cumulative(lengths + 1)[:-1]
        column = self._column[data]
        # Words with a character no piece has (the stop after each counts once) go to the library.
        library = np.add.reduceat(column == self._cols - 1, starts) > 1 if n else np.zeros(0, bool)
        w = np.flatnonzero(~library)  # the words still walking, and for each:
        at, end = starts[w], starts[w] + lengths[w]  # the next character, the word's end
        node = np.full(len(w), self._WORD_START)  # where it is in the trie
        last_end, last_node = at.copy(), np.zeros(len(w), np.intp)  # the last piece passed (node 0: none yet)
        k = np.zeros(len(w), np.intp)  # pieces the word has so far
        found: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (word, its k-th piece, node), round by round
        unknown = library.copy()  # words that are one [UNK] (or the library's)
        piece_of, cols = self._piece, self._cols
        while len(w):
            node = self._next[node * cols + column[at]]
            on = node != 0
            at += on
            passed = piece_of[node] >= 0
            last_end = np.where(passed, at, last_end)
            last_node = np.where(passed, node, last_node)
            if on.all():
                continue
            stop = np.flatnonzero(~on)
            got = stop[last_node[stop] != 0]
            unknown[w[stop[last_node[stop] == 0]]] = True  # no piece starts here: the whole word is [UNK]
            found.append((w[got], k[got], last_node[got]))
            at[got] = last_end[got]
            again = got[at[got] < end[got]]  # go on after the piece taken
            node[again], last_node[again], k[again] = self._GOING_ON, 0, k[again] + 1
            if len(again) < len(stop):
                keep = np.ones(len(w), bool)
                keep[stop] = False
                keep[again] = True
                w, at, end, node, last_end, last_node, k = (
                    a[keep] for a in (w, at, end, node, last_end, last_node, k))
        fw, fk, fnode = (np.concatenate(a) for a in zip(*found)) if found else [np.zeros(0, np.intp)] * 3
        keep = ~unknown[fw]  # an [UNK] word drops the pieces it had found before
        fw, fk, fnode = fw[keep], fk[keep], fnode[keep]
        odd = {i: ([t.id for t in self._library.tokenize(words[i])] if library[i] else [self.unk])
               for i in np.flatnonzero(unknown).tolist()}
        counts = np.bincount(fw, minlength=n)
        counts[list(odd)] = [len(p) for p in odd.values()]
        first = cumulative(counts)
        ids = np.empty(int(first[-1]), np.int32)
        ids[first[fw] + fk] = piece_of[fnode]
        for i, p in odd.items():
            ids[first[i] : first[i] + len(p)] = p
        return ids, counts


class WordTable:
    """A word's two hashes → its entry; entry → its piece ids, a slice of one flat array.

    Open addressing (linear probing, at most half full) over numpy arrays. Entry 0 is the separator
    (no pieces), entry 1 the unknown token (for words over the model's length limit). Entries are
    numbered in the order words were met, and a table past `max_words` keeps its older half: the
    words met first, which are mostly the frequent ones (Zipf). The bound is soft: one slice's new
    words are always added whole."""

    def __init__(self, pieces: PieceTrie, max_words: int, separator: tuple[int, int]):
        self._pieces, self.max_words = pieces, max_words
        self._slots(1 << max(10, (2 * max_words - 1).bit_length()))
        self.keys = np.zeros((1024, 2), np.uint64)  # entry → its key, to rebuild the slots
        self.start = np.zeros(1024, np.int32)  # entry → first piece in `pieces`
        self.count = np.zeros(1024, np.int32)  # entry → number of pieces
        self.pieces = np.zeros(4096, np.int32)
        self._len = self._used = 0  # entries, pieces in use
        self._append(np.array([separator], np.uint64), np.zeros(0, np.int32), np.zeros(1, np.int64))
        unk = np.array([pieces.unk], np.int32)
        self._append(np.zeros((1, 2), np.uint64), unk, np.ones(1, np.int64))  # no key: never found by a lookup
        self._insert(np.array([separator], np.uint64), np.array([0]))

    def __len__(self) -> int:
        return self._len

    def lookup(self, text: str, starts: np.ndarray, ends: np.ndarray, k1: np.ndarray, k2: np.ndarray) -> np.ndarray:
        """The entry of every word (text[starts[i]:ends[i]], keys k1, k2), learning those not held."""
        def unknown():
            """Entries, where they are missing, those words, and each new word once with one of its places."""
            entries = self._find(k1, k2)
            missing = np.flatnonzero(entries < 0)
            words = [text[s:e] for s, e in zip(starts[missing].tolist(), ends[missing].tolist())]
            return entries, missing, words, dict(zip(words, missing.tolist()))

        entries, missing, words, first = unknown()
        if not words:
            return entries
        if self._len + len(first) > self.max_words:
            self._keep(max(2, self.max_words // 2))
            entries, missing, words, first = unknown()  # entries just dropped are missing again
        at = np.fromiter(first.values(), np.int64, len(first))
        keys = np.stack([k1[at], k2[at]], axis=1)
        new = self._len + np.arange(len(first))
        self._append(keys, *self._pieces(list(first)))
        if 2 * self._len > len(self._k1):  # a slice's new words overran the bound: keep probing short
            self._slots(1 << (2 * self._len).bit_length())
            self._rehash()
        else:
            self._insert(keys, new)
        number = dict(zip(first, new.tolist()))
        entries[missing] = np.fromiter(map(number.__getitem__, words), np.int64, len(words))
        return entries

    def _slots(self, n: int) -> None:
        self._shift = np.uint64(64 - n.bit_length() + 1)
        self._k1 = np.zeros(n, np.uint64)  # slot → key (0: empty)
        self._k2 = np.zeros(n, np.uint64)
        self._entry = np.zeros(n, np.int32)

    def _rehash(self) -> None:
        """Slots for entries 0 … len-1 (the unknown token has no key)."""
        self._k1[:] = 0
        self._k2[:] = 0
        held = np.arange(self._len)
        held = held[held != 1]
        self._insert(self.keys[held], held)

    def _home(self, k1: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return ((k1 * _FIB) >> self._shift).astype(np.int64)

    def _find(self, k1: np.ndarray, k2: np.ndarray) -> np.ndarray:
        """Entry of each key, -1 where absent: all keys probe together, one slot further a round."""
        out = np.full(len(k1), -1, np.int64)
        todo, slot = np.arange(len(k1)), self._home(k1)
        mask = len(self._k1) - 1
        while len(todo):
            held = self._k1[slot]
            hit = (held == k1[todo]) & (self._k2[slot] == k2[todo])
            out[todo[hit]] = self._entry[slot[hit]]
            more = ~hit & (held != 0)  # a different key here: look in the next slot
            todo, slot = todo[more], (slot[more] + 1) & mask
        return out

    def _insert(self, keys: np.ndarray, entries: np.ndarray) -> None:
        """Put keys (not held yet, distinct) in free slots; where several want one slot, the first wins."""
        todo, slot = np.arange(len(keys)), self._home(keys[:, 0])
        mask = len(self._k1) - 1
        while len(todo):
            free = self._k1[slot] == 0
            taken = np.zeros(len(todo), bool)
            _, winner = np.unique(slot[free], return_index=True)
            winner = np.flatnonzero(free)[winner]
            taken[winner] = True
            s, w = slot[winner], todo[winner]
            self._k1[s], self._k2[s], self._entry[s] = keys[w, 0], keys[w, 1], entries[w]
            todo, slot = todo[~taken], (slot[~taken] + 1) & mask

    def _append(self, keys: np.ndarray, ids: np.ndarray, counts: np.ndarray) -> None:
        """New entries (numbered from len(self)) with their keys, and their piece ids: `counts[i]` of
        them for the i-th, one after another in `ids`."""
        n, first, total = len(counts), self._len, len(ids)
        if first + n > len(self.start):
            size = 2 * (first + n)
            self.start, self.count = np.resize(self.start, size), np.resize(self.count, size)
            self.keys = np.resize(self.keys, (size, 2))
        if self._used + total > len(self.pieces):
            self.pieces = np.resize(self.pieces, 2 * (self._used + total))
        self.keys[first : first + n] = keys
        self.start[first : first + n] = self._used + cumulative(counts)[:-1]
        self.count[first : first + n] = counts
        self.pieces[self._used : self._used + total] = ids
        self._len, self._used = first + n, self._used + total

    def _keep(self, entries: int) -> None:
        """Forget every entry from `entries` on (the separator and the unknown token stay)."""
        self._len = entries = min(entries, self._len)
        self._used = int(self.start[entries - 1] + self.count[entries - 1])
        self._rehash()


class AsciiWordPiece:
    """Ids of clean ASCII texts, `prefix` + their pieces (truncated to `room`) + `suffix`, packed."""

    def __init__(self, wordpiece, vocab: dict[str, int], lowercase: bool, prefix: list[int], suffix: list[int],
                 room: int, max_words: int):
        self._hash = _Hasher()
        sep = np.frombuffer(_SEP.encode(), np.uint8)
        k1, k2 = self._hash(sep, np.array([0]), np.array([1]))
        self.table = WordTable(PieceTrie(wordpiece, vocab), max_words, (int(k1[0]), int(k2[0])))
        self.longest = wordpiece.max_input_chars_per_word  # longer words are the unknown token
        self.lowercase, self.prefix, self.suffix, self.room = lowercase, prefix, suffix, room

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Packed int32 ids and int32 lengths, in input order."""
        parts = [self._encode_slice(texts[i:j]) for i, j in _slices(texts)]
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return np.zeros(0, np.int32), np.zeros(0, np.int32)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def word_tokens(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each word of one clean ASCII text: its start and end (exclusive) in `text`, and its number of
        pieces (tokens) — what the passage splitter cuts between."""
        joined = text.lower() if self.lowercase else text  # ASCII: lowercasing keeps every position
        data = np.frombuffer(joined.encode("ascii"), np.uint8)
        starts, ends = split_words(data)
        entries = self._entries(joined, data, starts, ends)  # first: learning new words may grow the table
        return starts, ends, self.table.count[entries]

    def word_tokens_many(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """word_tokens of each of many clean ASCII texts, their new words learnt in one pass (a pass per
        text spent most of a passage helper's time in numpy's per-call costs on a few dozen new words).
        Joined by spaces: no word crosses one, so each word is found as in its own text."""
        if not texts:
            return []
        starts, ends, pieces = self.word_tokens(" ".join(texts))
        base = cumulative(np.fromiter(map(len, texts), np.int64, len(texts)) + 1)[:-1]
        cut = np.searchsorted(starts, base)  # the first word of each text
        bounds = np.append(cut, len(starts))
        return [(starts[a:b] - o, ends[a:b] - o, pieces[a:b])
                for a, b, o in zip(bounds[:-1].tolist(), bounds[1:].tolist(), base.tolist())]

    def _entries(self, joined: str, data: np.ndarray | None = None, starts: np.ndarray | None = None,
                 ends: np.ndarray | None = None) -> np.ndarray:
        """Every word's table entry, the separators (entry 0) included."""
        if data is None:
            data = np.frombuffer(joined.encode("ascii"), np.uint8)
            starts, ends = split_words(data)
        long = (ends - starts) > self.longest
        if long.any():  # [UNK] without a lookup (and without hashing what could be made to collide)
            entries = np.ones(len(starts), np.int64)
            short = np.flatnonzero(~long)
            entries[short] = self._entries_of(joined, data, starts[short], ends[short])
            return entries
        return self._entries_of(joined, data, starts, ends)

    def _entries_of(self, joined: str, data: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        k1, k2 = self._hash(data, starts, ends)
        return self.table.lookup(joined, starts, ends, k1, k2)

    def _encode_slice(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        joined = _SEP.join(texts)
        entries = self._entries(joined.lower() if self.lowercase else joined)
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


def _slices(texts: list[str]) -> list[tuple[int, int]]:
    """Consecutive (start, end) ranges of at most _SLICE texts and about _SLICE_CHARS characters."""
    out, start, chars = [], 0, 0
    for i, t in enumerate(texts):
        if i > start and (i - start == _SLICE or chars + len(t) > _SLICE_CHARS):
            out.append((start, i))
            start, chars = i, 0
        chars += len(t)
    if texts:
        out.append((start, len(texts)))
    return out
