"""Synthetic review-length texts and Amazon-review-format corpora.

Benchmarks and GPU runs need realistic *lengths* (speed depends on tokens, not meaning), and the
machines that run them have no internet. Lengths are lognormal with a median of 40 words, like
product reviews. `review_texts` (what `embedfleet bench` embeds) draws from a small fixed vocabulary
of ordinary English; the review corpora (`write_amazon_reviews`, what ingest benchmarks read) draw
from a long-tailed one, common words first and then a million made-up ones, so that the tokenizer's
word cache meets rare words about as often as it would in real reviews (or more).
"""

from __future__ import annotations

import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from embedfleet.errors import ModelError

_WORDS = (
    "the a and it this is for with my was but not phone case battery screen charger great good "
    "works well after week month day quality product price cheap fast slow broke broken return "
    "refund love like hate recommend would buy again bought use used using cable fits fit perfect "
    "perfectly color black white blue red size small large bigger smaller light heavy sturdy "
    "flimsy plastic metal glass protector scratch scratches drop dropped dies died charge charging "
    "hours minutes seconds time times received arrived shipping package box seller amazon star "
    "stars five one two three four easy hard install installed button buttons sound volume "
    "speaker headphones bluetooth wireless connection connect connected pair paired signal "
    "really very so too much more less than then also just only even still already however "
    "because since while when where what which who how why all any some every each no yes "
    "excellent terrible awful amazing okay fine decent solid nice beautiful ugly cute happy sad "
    "disappointed satisfied surprised impressed expected described advertised picture looks"
).split()


def review_lengths(n: int, seed: int = 0, median_words: int = 40, sigma: float = 0.8) -> np.ndarray:
    """Word counts drawn lognormally (median `median_words`), clipped to [1, 2000]."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(median_words), sigma, n).astype(np.int64), 1, 2000)


def review_texts(n: int, seed: int = 0, median_words: int = 40) -> list[str]:
    """`n` review-length texts, deterministic for a seed."""
    rng = np.random.default_rng(seed + 1)
    lengths = review_lengths(n, seed, median_words)
    return _sentences(np.array(_WORDS), rng.integers(0, len(_WORDS), int(lengths.sum())), lengths)


def _sentences(words: np.ndarray, picks: np.ndarray, lengths: np.ndarray) -> list[str]:
    """One text per length: that many consecutive `picks` (indices into `words`), as a sentence."""
    out, pos = [], 0
    for k in lengths:
        out.append(" ".join(words[picks[pos : pos + k]]).capitalize() + ".")
        pos += k
    return out


_SYLLABLES = "ka lo mi ne ru ta vo shi ber xen qu pha gh ly ion ing ed er".split()


def _made_up(rank: int) -> str:
    """A deterministic made-up word for a rank: its digits in base len(_SYLLABLES), as syllables."""
    out = []
    while True:
        rank, d = divmod(rank, len(_SYLLABLES))
        out.append(_SYLLABLES[d])
        if rank == 0:
            return "".join(out)


def _english_words() -> list[str]:
    """About 20,000 English words, roughly most frequent first: the whole words of the bundled
    model's WordPiece vocabulary (its package is a dependency; without it, made-up words only)."""
    from embedfleet.encode.models import resolve_model

    try:
        vocab = (resolve_model(None) / "vocab.txt").read_text(encoding="utf-8").split()
    except (ModelError, OSError):
        return []
    return [w for w in vocab if len(w) > 1 and w.isascii() and w.isalpha()]


def long_tail_texts(n: int, seed: int = 0, median_words: int = 40, lexicon: int = 1_000_000,
                    exponent: float = 1.1) -> list[str]:
    """Like `review_texts`, with words drawn from a Zipf law over `lexicon` ranks: the common review
    words, then English words, then made-up ones (several word pieces each). With these defaults the
    200 most frequent words make 58% of the text, made-up words 14%, and 7% of it lies beyond the
    131,072 most frequent words (real English is less spread out)."""
    rng = np.random.default_rng(seed + 1)
    lengths = review_lengths(n, seed, median_words)
    p = (np.arange(lexicon) + 1.0) ** -exponent
    picks = rng.choice(lexicon, int(lengths.sum()), p=p / p.sum())
    used, index = np.unique(picks, return_inverse=True)  # only the words drawn get spelled out
    known = _WORDS + _english_words()
    words = np.array([known[r] if r < len(known) else _made_up(r) for r in used.tolist()])
    return _sentences(words, index, lengths)


def write_amazon_reviews(path: str | Path, n: int, seed: int = 0, products: int = 1000) -> Path:
    """Write `n` reviews in the Amazon Reviews 2023 JSONL layout (one object a line), texts from
    `long_tail_texts`."""
    path = Path(path)
    rng = np.random.default_rng(seed + 2)
    texts = long_tail_texts(n, seed)
    ratings = rng.integers(1, 6, n)
    prods = rng.integers(0, products, n)
    votes = rng.poisson(1.0, n)
    with path.open("w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            title = " ".join(text.split()[:5]).rstrip(".")
            rec = {
                "rating": float(ratings[i]),
                "title": title,
                "text": text,
                "images": [],
                "asin": f"B{prods[i]:09d}",
                "parent_asin": f"P{prods[i]:09d}",
                "user_id": f"U{seed:03d}{i:010d}",
                "timestamp": 1_600_000_000_000 + i * 1000,
                "helpful_vote": int(votes[i]),
                "verified_purchase": bool(i % 3),
            }
            f.write(json.dumps(rec) + "\n")
    return path


def write_amazon_meta(path: str | Path, products: int = 1000, seed: int = 0) -> Path:
    """Product metadata for `write_amazon_reviews`' parent_asins, in the meta_*.jsonl layout."""
    path = Path(path)
    rng = np.random.default_rng(seed + 3)
    with path.open("w", encoding="utf-8") as f:
        for p in range(products):
            rec = {
                "main_category": "Cell Phones & Accessories",
                "title": f"Product {p} " + " ".join(rng.choice(_WORDS, 6)),
                "average_rating": round(float(rng.uniform(1, 5)), 1),
                "rating_number": int(rng.integers(0, 5000)),
                "features": [" ".join(rng.choice(_WORDS, 5)) for _ in range(2)],
                "description": [],
                "price": round(float(rng.uniform(3, 80)), 2) if p % 4 else None,
                "images": [],
                "videos": [],
                "store": f"Store {p % 37}",
                "categories": ["Cell Phones & Accessories", "Cases"],
                "details": {"Brand": f"Brand{p % 11}"},
                "parent_asin": f"P{p:09d}",
                "bought_together": None,
            }
            f.write(json.dumps(rec) + "\n")
    return path


def _write_once(path: Path, write) -> Path:
    """`write(partial)` unless `path` exists, then rename `partial` to `path`: a run stopped while
    writing (a time limit) or another process still writing never leaves a short file under `path`."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        try:
            write(partial)
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
    return path


def _cached(path: Path, n: int, seed: int = 0) -> Path:
    """`n` reviews of `seed` (5,000 products) at `path`, written once and reused by later runs."""
    return _write_once(path, lambda partial: write_amazon_reviews(partial, n, seed=seed, products=5000))


def cached_reviews(directory: str | Path, n: int) -> Path:
    """`directory`/reviews_long_tail_<n>.jsonl, written once and reused by later runs."""
    return _cached(Path(directory) / f"reviews_long_tail_{n}.jsonl", n)  # the name changes whenever the texts do


def cached_review_shards(directory: str | Path, n: int, shards: int) -> list[Path]:
    """`n` reviews as `shards` files, written side by side by one process each and reused like
    `cached_reviews`; shard i (from 0) has seed i, so its texts and ids are its own. For runs long
    enough that the workers' start-up weighs little: one process alone would take minutes over millions."""
    sizes = [n // shards + (i < n % shards) for i in range(shards)]
    paths = [Path(directory) / f"reviews_long_tail_{n}_{i + 1}of{shards}.jsonl" for i in range(shards)]
    missing = [i for i, path in enumerate(paths) if not path.exists()]
    if missing:
        spawn = multiprocessing.get_context("spawn")  # the caller may hold threads: no fork
        with ProcessPoolExecutor(min(len(missing), os.cpu_count() or 1), mp_context=spawn) as pool:
            list(pool.map(_cached, [paths[i] for i in missing], [sizes[i] for i in missing], missing))
    return paths


# Words of a world-wide review site: accented Latin, CJK (no spaces between characters), Hangul,
# Cyrillic, Greek, Arabic, Devanagari, emoji, curly quotes, dashes — what the tokenizer's ASCII
# shortcut never takes (it falls back to the library for a text with any of these).
_WORLD = (
    "café crème naïve résumé über schön größe très bien déçu reçu problème qualité función batería "
    "cargador pantalla rápido lento também não ótimo preço điện thoại pin sạc tốt "
    "電池 充電 画面 ケース 保護 とても 良い 悪い すぐ 壊れた 手机 电池 充电器 屏幕 质量 很好 不错 "
    "배터리 충전 화면 좋아요 별로 телефон батарея экран отлично плохо быстро μπαταρία οθόνη καλό "
    "بطارية شاشة ممتاز बैटरी स्क्रीन अच्छा 👍 😂 ❤️ 🔋 📱 🚀 👎 ✨ 🙏 — – … “great” “meh” ‘ok’ «bien» „gut“"
).split()


def world_texts(n: int, seed: int = 0, median_words: int = 40, long_share: float = 0.01) -> list[str]:
    """`n` review-like texts mixing English with other scripts, accents, emoji and curly quotes (about
    half the words from `_WORLD`), lengths like `review_texts` except that `long_share` of the texts
    (1%) reach 1,000 to 3,000 words; deterministic for a seed."""
    rng = np.random.default_rng(seed + 2)
    lengths = review_lengths(n, seed, median_words)
    long = rng.random(n) < long_share
    lengths[long] = rng.integers(1001, 3001, int(long.sum()))
    vocab = np.array(_WORDS + _WORLD)
    weights = np.r_[np.full(len(_WORDS), 1.0 / len(_WORDS)), np.full(len(_WORLD), 1.0 / len(_WORLD))]
    picks = rng.choice(len(vocab), int(lengths.sum()), p=weights / weights.sum())
    return _sentences(vocab, picks, lengths)


def write_articles(path: str | Path, n: int, seed: int = 0, median_words: int = 700,
                   row_group: int = 2000, first_id: int = 1) -> Path:
    """`n` Wikipedia-length articles (median ~700 words, long-tailed vocabulary) as a Parquet file in the
    Hugging Face wikimedia/wikipedia layout: id, url, title, text; ids from `first_id` on (shards of one
    corpus take consecutive ranges). Written a row group at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    schema = pa.schema([("id", pa.string()), ("url", pa.string()), ("title", pa.string()), ("text", pa.string())])
    with pq.ParquetWriter(path, schema) as w:
        for start in range(0, n, row_group):
            m = min(row_group, n - start)
            texts = long_tail_texts(m, seed=seed + start, median_words=median_words)
            titles = [" ".join(t.split()[:3]).rstrip(".").title() for t in texts]
            ids = [str(first_id + start + i) for i in range(m)]
            w.write_table(pa.table({"id": ids, "url": [f"https://en.wikipedia.org/wiki?curid={i}" for i in ids],
                                    "title": titles, "text": texts}, schema=schema))
    return path
