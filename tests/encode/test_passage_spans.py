"""Passage spans (pure): cuts at sentence ends, then between words, inside a word only when it must."""

from __future__ import annotations

import numpy as np
import pytest

from embedfleet.encode.passages import parse_passages, spans
from embedfleet.errors import InputError


def words(text: str) -> list[tuple[int, int]]:
    """One token per whitespace-separated word (and a trailing '.' as its own token), with offsets."""
    out, pos = [], 0
    for w in text.split(" "):
        if w.endswith(".") and len(w) > 1:
            out += [(pos, pos + len(w) - 1), (pos + len(w) - 1, pos + len(w))]
        else:
            out.append((pos, pos + len(w)))
        pos += len(w) + 1
    return out


def test_cuts_prefer_a_sentence_end_in_the_second_half_of_a_passage():
    text = "a b c. d e f g h. i j k"
    got = [text[s:e] for s, e in spans(words(text), text, 8, 0)]
    assert got == ["a b c.", "d e f g h.", "i j k"]  # not "a b c. d e f g": the sentence end wins


def test_a_word_longer_than_a_passage_is_cut_inside_and_nothing_is_lost():
    offsets = [(0, 3), (3, 6), (6, 9), (9, 12), (13, 14)]  # "abcdefghijkl m": one word of 4 tokens, then "m"
    text = "abcdefghijkl m"
    got = [text[s:e] for s, e in spans(offsets, text, 3, 0)]
    assert "".join(got).replace(" ", "") == text.replace(" ", "") and all(len(g) <= 9 for g in got)


@pytest.mark.parametrize("size, overlap", [(4, 0), (4, 1), (6, 2), (10, 4)])
def test_overlap_and_coverage(size, overlap):
    text = " ".join(f"w{i}" for i in range(50))
    offsets = words(text)
    got = spans(offsets, text, size, overlap)
    assert got[0][0] == 0 and got[-1][1] == len(text)
    for (s0, e0), (s1, e1) in zip(got, got[1:]):
        assert s1 > s0 and e1 > e0
        shared = sum(1 for a, b in offsets if s1 <= a and b <= e0)
        assert shared == overlap if overlap else text[e0:s1].strip() == ""
    assert all(sum(1 for a, b in offsets if s <= a and b <= e) <= size for s, e in got)


def test_fits_has_the_last_word():
    text = " ".join(f"w{i}" for i in range(20))
    got = spans(words(text), text, 8, 0, fits=lambda piece: len(piece.split()) <= 5)
    assert all(len(text[s:e].split()) <= 5 for s, e in got) and got[-1][1] == len(text)


@pytest.mark.parametrize("value, expected", [("256:32", (256, 32)), ("128", (128, 0)), (None, None)])
def test_parse(value, expected):
    assert parse_passages(value) == expected


@pytest.mark.parametrize("value", ["abc", "256:x", "4", "64:40", "-3:1"])
def test_bad_values_are_one_line_errors(value):
    with pytest.raises(InputError, match="--passages"):
        parse_passages(value)


def test_word_path_offsets_cut_like_the_librarys_on_clean_ascii():
    """The splitter's token offsets from the word path (words and their piece counts) give the same
    passages as the library's offsets, and the library's own token counts at every word boundary."""
    from embedfleet.encode.models import resolve_model
    from embedfleet.encode.passages import Splitter
    from embedfleet.encode.tokenize import tokenizer_spec
    from embedfleet.synth import long_tail_texts

    spec = tokenizer_spec(resolve_model(None), None)
    fast = Splitter(spec.tokenizer_json, 64, 8, words=spec.build().word_tokens_many)
    library = Splitter(spec.tokenizer_json, 64, 8)
    odd = ["Dr. Smith's e-mail (x@y.org) cost $4.99!", "unbelievably-hyphenated-compound-words", "x" * 130,
           "Tokenization " * 3 + "antidisestablishmentarianism" * 4, "a,b;c:d?e!f", "  leading   spaces  "]
    texts = [t for t in long_tail_texts(40, seed=5, median_words=700) if t.isascii()][:12] + odd + [" ".join(odd * 9)]
    assert len(texts) > 14
    for text in texts:
        words = fast.words([text])[0]
        assert words is not None  # these texts take the word path
        got, want = fast._offsets(text, words), library._offsets(text)
        assert len(got) == len(want)  # the same number of tokens
        gaps = [c for c in range(1, len(want)) if want[c][0] > want[c - 1][1]]
        assert gaps == [c for c in range(1, len(got)) if got[c][0] > got[c - 1][1]]  # words begin at the same tokens
        assert all(got[c][0] == want[c][0] and got[c - 1][1] == want[c - 1][1] for c in gaps)
        assert fast.split(text) == library.split(text)


def test_the_words_of_many_texts_at_once_are_each_texts_own():
    """word_tokens_many (one pass over many texts' new words) gives each text what word_tokens gives it
    alone, None where the word path does not take a text (non-ASCII), and nothing for an empty one."""
    from embedfleet.encode.models import resolve_model
    from embedfleet.encode.tokenize import tokenizer_spec
    from embedfleet.synth import long_tail_texts

    spec = tokenizer_spec(resolve_model(None), None)
    texts = long_tail_texts(30, seed=11, median_words=300)
    texts[3:3] = ["", "Café crème, naïve — ok", "end.", "  spaced   out  ", "x" * 130]
    alone, together = spec.build(), spec.build()  # separate word tables: new words learnt either way
    many = together.word_tokens_many(texts)
    assert len(many) == len(texts) and sum(w is not None for w in many) == len(texts) - 1  # all but the café
    for text, got in zip(texts, many):
        (want,) = alone.word_tokens_many([text])
        if want is None:
            assert got is None and not text.isascii()
            continue
        assert all(np.array_equal(a, b) for a, b in zip(got, want)), text[:40]
    assert len(many[3][0]) == 0  # the empty text has no words


def _plain_spans(offsets, text, size, overlap, fits=None):
    """The cut rules as a walk over the tokens, the way they read: the reference for `spans`."""
    import re

    sentence_end = re.compile(r"[.!?。！？…]['\"”’)\]]*$")
    no_spaces = re.compile("[\u3000-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef]")  # CJK
    n = len(offsets)

    def gap(c):  # whitespace between tokens c-1 and c, or either of them Chinese or Japanese
        return c == 0 or offsets[c][0] > offsets[c - 1][1] or bool(
            no_spaces.match(text[offsets[c - 1][1] - 1]) or no_spaces.match(text[offsets[c][0]]))

    def cut(start, end):
        half = start + max(1, (end - start) // 2)
        word = None
        for c in range(end, half - 1, -1):
            if gap(c) and sentence_end.search(text[offsets[c - 1][0]:offsets[c - 1][1]]):
                return c
            if gap(c) and word is None:
                word = c
        if word is not None:
            return word
        return next((c for c in range(half - 1, start, -1) if gap(c)), end)

    out, start = [], 0
    while start < n:
        limit = min(start + size, n)
        while True:
            c = cut(start, limit) if limit < n else n
            if fits is None or c - start <= max(1, size - 4) or fits(text[offsets[start][0]:offsets[c - 1][1]]):
                break
            limit = c - 1
        out.append((offsets[start][0], offsets[c - 1][1]))
        if c >= n:
            break
        at = max(c - overlap, start + 1)
        start = next((k for k in range(at, c) if gap(k)), at) if overlap else c
    return out


@pytest.mark.parametrize("seed", range(40))
def test_spans_cut_where_a_walk_over_the_tokens_would(seed):
    """The cuts as array lookups against the rules walked token by token: random tokens (several to a
    word, punctuation, sentence ends with closing quotes, non-ASCII), sizes, overlaps and checks."""
    rng = np.random.default_rng(seed)
    pieces = ["ab", "c", "déf", "g.", "h!", "i?”", "j.)", "k", "。", "x…", "'"]
    text, offsets = "", []
    for _ in range(int(rng.integers(1, 400))):
        if text and rng.random() < 0.6:
            text += " " * int(rng.integers(1, 3))
        tok = pieces[int(rng.integers(len(pieces)))]
        offsets.append((len(text), len(text) + len(tok)))
        text += tok
    size = int(rng.integers(8, 40))
    overlap = int(rng.integers(0, size // 2))
    fits = (lambda piece: len(piece) <= 3 * size) if seed % 2 else None
    assert spans(offsets, text, size, overlap, fits) == _plain_spans(offsets, text, size, overlap, fits)


@pytest.mark.parametrize("joiner", ["\n\n", ". "])
def test_japanese_and_chinese_text_is_cut_at_its_sentence_ends_not_into_scraps(joiner):
    """No spaces between their words or after a sentence: a heading before such text gave passages of the
    heading's words alone ("Chapter 12", "12", "."), and cuts fell mid-sentence. Now each passage but the last
    ends a sentence, and none is a scrap."""
    from embedfleet.encode.models import resolve_model
    from embedfleet.encode.passages import Splitter
    from embedfleet.encode.tokenize import tokenizer_spec

    spec = tokenizer_spec(resolve_model(None), None)
    japanese = "東京の天気は晴れで、多くの人が公園を散歩していました。" + "新しい駅が来年に開業する予定です。"
    chinese = "这家餐厅的菜很好吃，服务也很周到。" + "我们下周还会再来这里吃饭！"
    for body in (japanese * 12, chinese * 12):
        text = "Chapter 12" + joiner + body
        passages = Splitter(spec.tokenizer_json, 128, 16).split(text)
        assert len(passages) > 1 and all(len(p) >= 20 for p in passages), passages
        assert all(p.endswith(("。", "！")) for p in passages[:-1]), passages
        assert passages[0].startswith("Chapter 12") and all(p in text for p in passages)
