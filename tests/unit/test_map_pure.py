"""The map's pure pieces: legend categories and the page's hover columns (no database, no UMAP)."""

from __future__ import annotations

import base64
from datetime import date

import numpy as np

from embedfleet.viz.map import GREY, MAX_CATEGORIES, NUMERIC_BINS, PALETTE, SEQUENTIAL, _hover_json, categories


def test_few_values_one_entry_each_most_frequent_first():
    labels, colours, codes = categories(["b", "a", "b", None, True, "b", True])
    assert labels == ["b", "true", "a", "(none)"]
    assert colours[:3] == list(PALETTE[:3])
    assert [labels[c] for c in codes] == ["b", "a", "b", "(none)", "true", "b", "true"]


def test_many_text_values_keep_the_most_frequent_and_call_the_rest_other():
    values = [f"v{i}" for i in range(50) for _ in range(50 - i)]  # v0 most frequent
    labels, colours, codes = categories(values)
    assert len(labels) == MAX_CATEGORIES and labels[:2] == ["v0", "v1"]
    assert labels[-1] == f"other ({50 - (MAX_CATEGORIES - 1)} values)" and colours[-1] == GREY
    assert labels[codes[values.index("v30")]] == labels[-1] and labels[codes[0]] == "v0"


def test_many_numbers_fall_into_ordered_bins():
    rng = np.random.default_rng(0)
    values = rng.normal(size=1000).tolist() + [None]
    labels, colours, codes = categories(values)
    assert len(labels) == NUMERIC_BINS + 1 and labels[-1] == "(none)" and codes[-1] == NUMERIC_BINS
    assert colours[0] == SEQUENTIAL[0] and colours[NUMERIC_BINS - 1] == SEQUENTIAL[-1]
    order = np.argsort(values[:-1])
    assert (np.diff(codes[:-1][order].astype(int)) >= 0).all()  # bins follow the values
    assert np.bincount(codes[:-1]).min() >= 100  # quantile bins: about the same size each
    dates = [date(2020, 1, 1 + i % 28) for i in range(300)]
    labels, _, codes = categories(dates)
    assert labels[0].startswith("2020-01-01 – ") and codes.max() < NUMERIC_BINS


def test_hover_columns_are_cut_and_dictionary_encoded_when_repetitive():
    unique = _hover_json("content", ["x" * 400, "short", None])
    assert unique["codes"] is None and unique["values"] == ["x" * 300 + "…", "short", None]
    repetitive = _hover_json("topic", ["a", "b", "a", "a", None, "a"])
    codes = np.frombuffer(base64.b64decode(repetitive["codes"]), dtype="<u4")
    assert [repetitive["values"][c] for c in codes] == ["a", "b", "a", "a", None, "a"]
    assert _hover_json("rating", [1.5, 2.0])["values"] == ["1.5", "2"]
