"""Non-ASCII text through a BERT tokenizer, a word at a time. Each whitespace-separated word's pieces come from
the library once, then from a dict.

BERT's normalizer works a character at a time. It drops control characters, turns whitespace into a space, puts
spaces around CJK ideographs, strips accents after NFD, and lowercases. Its pre-tokenizer splits at whitespace and
punctuation. So a text's pieces are its whitespace-separated words' pieces, one word after another. Python's
`str.split()` cuts at the same characters as the library's whitespace, with one exception: the control characters
that the normalizer drops, where Python cuts (U+001C–U+001F, U+0085 and the other C0/C1 controls but tab, newline
and carriage return). Texts holding one of those, a lone surrogate, or an added token such as [MASK], stay on the
library's path (`tokenize._Tokenizer` decides).

A multilingual corpus repeats its words as an English one does, so most words are a lookup. A new word costs one
library call, batched with the other new words of its call.
"""

from __future__ import annotations

import itertools
import re

import numpy as np

# Characters that keep a text on the library's path: what str.split() cuts at but BERT's normalizer deletes (C0 and
# C1 controls but tab, newline and carriage return), and lone surrogates, which the library refuses.
LIBRARY_ONLY = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")
LONGEST_KEPT = 48  # characters: a longer word (a sentence of unspaced CJK) is tokenized each time, never kept


class WordCache:
    """Ids of texts without `LIBRARY_ONLY` characters: `prefix`, then their words' pieces truncated to `room`,
    then `suffix`, packed. `library`: the model's own tokenizer, with its normalizer. At most `max_words` words are
    remembered; later new words are tokenized each time they come."""

    def __init__(self, library, prefix: list[int], suffix: list[int], room: int, max_words: int):
        self._library = library
        self.prefix, self.suffix, self.room, self.max_words = prefix, suffix, room, max_words
        self._pieces: dict[str, list[int]] = {}

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Packed int32 ids and int32 lengths, in input order."""
        split = [t.split() for t in texts]
        pieces = self._pieces
        new = list({w for words in split for w in words if w not in pieces})
        found: dict[str, list[int]] = {}
        if new:
            # a word of more than max_length pieces comes back cut there: past `room` either way
            found = dict(zip(new, (e.ids for e in self._library.encode_batch_fast(new, add_special_tokens=False))))
            space = self.max_words - len(pieces)
            if space > 0:
                pieces.update(itertools.islice(((w, p) for w, p in found.items() if len(w) <= LONGEST_KEPT), space))
        get, fresh = pieces.get, found.get
        head, tail, most = self.prefix, self.suffix, self.room
        seqs = [head + list(itertools.islice(itertools.chain.from_iterable(
            get(w) or fresh(w, ()) for w in words), most)) + tail for words in split]
        lengths = np.fromiter(map(len, seqs), np.int32, len(seqs))
        ids = np.fromiter(itertools.chain.from_iterable(seqs), np.int32, int(lengths.sum()))
        return ids, lengths
