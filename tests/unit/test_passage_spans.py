"""Passage spans (pure): cuts at sentence ends, then between words, inside a word only when it must."""

from __future__ import annotations

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
