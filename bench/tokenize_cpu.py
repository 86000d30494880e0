"""The tokenizer alone, in one process: µs a text on the ingest benchmark's texts.

    python bench/tokenize_cpu.py [--n 20000] [--words 32768,262144,1048576] [--model DIR] [--texts long-tail|world]

Texts are `synth.long_tail_texts` (what `bench/ingest.py`'s reviews contain), or `synth.world_texts` (non-ASCII:
accents, other scripts, emoji; the word cache's path, `encode/word_cache.py`). For each word-table size
(Settings.word_cache) a fresh tokenizer makes two passes over the same texts: `cold` learns their words
as a helper does at the start of a job; `warm` finds every word the table kept (all of them when it is
big enough), and how many words a text it learned (split into pieces by the trie) and what that cost.
`library` is the tokenizers library's own path on the same texts, for scale.

Also runs against an older checkout, to compare with the code before it:
`PYTHONPATH=<checkout>/src python bench/tokenize_cpu.py` (uses its `ids` where there is no `encode`).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # single-threaded, as in a helper


class _Learning:
    """Counts the words the word table learns and the time it takes to split them into pieces."""

    def __init__(self):
        self.words, self.seconds = 0, 0.0
        try:
            from embedfleet.encode import wordpiece
        except ImportError:  # older code: no word table to count
            return
        if hasattr(wordpiece, "PieceTrie"):  # new words split by the trie
            owner, name = wordpiece.PieceTrie, "__call__"
        else:  # by the library, word by word (`_add`: before the hashed table)
            owner = wordpiece.WordTable
            name = "_learn" if hasattr(owner, "_learn") else "_add"
        learn = getattr(owner, name)

        def counted(table, words):
            t0 = time.perf_counter()
            out = learn(table, words)
            self.words, self.seconds = self.words + len(words), self.seconds + time.perf_counter() - t0
            return out

        setattr(owner, name, counted)


def _timed(f, texts: list[str]) -> float:
    t0 = time.perf_counter()
    f(texts)
    return (time.perf_counter() - t0) / len(texts) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--words", default="32768,262144,1048576")
    ap.add_argument("--model", default=None)
    ap.add_argument("--texts", default="long-tail", choices=("long-tail", "world"))
    a = ap.parse_args()
    from embedfleet.encode import tokenize
    from embedfleet.synth import long_tail_texts, world_texts

    spec = tokenize.tokenizer_spec(a.model)
    texts = (world_texts if a.texts == "world" else long_tail_texts)(a.n, seed=7)
    learning = _Learning()
    for words in a.words.split(","):
        tok = tokenize._Tokenizer(spec.tokenizer_json, spec.max_length, word_cache=int(words))
        if hasattr(tok, "_words_for"):  # built at the first big call now: before the clock, as it was
            tok._words_for(1 << 30)
        run = (lambda t: tok.encode(t, spec.pad_id)) if hasattr(tok, "encode") else tok.ids
        learning.words, learning.seconds = 0, 0.0
        cold = _timed(run, texts)
        learned = (f", learned {learning.words / a.n:4.1f} words a text at {learning.seconds / learning.words * 1e6:.2f} µs "
                   "each" if learning.words else "")
        warm = _timed(run, texts)
        print(f"{int(words):>9,} words: cold {cold:5.1f} µs a text{learned}; warm {warm:5.1f}", flush=True)
    library = _timed(lambda t: [e.ids for e in tok.full.encode_batch_fast(t, add_special_tokens=True)], texts)
    print(f"library path: {library:5.1f} µs a text ({a.n:,} texts)")


if __name__ == "__main__":
    main()
