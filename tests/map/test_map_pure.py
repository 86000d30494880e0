"""The map's pure pieces: legend categories and the page's hover columns (no database, no UMAP)."""

from __future__ import annotations

import base64
from datetime import date

import numpy as np

from embedfleet.map import (
    GREY,
    MAX_CATEGORIES,
    NUMERIC_BINS,
    PALETTE,
    SEQUENTIAL,
    _hover_json,
    categories,
)


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


def test_few_numbers_are_listed_in_their_own_order():
    labels, _, codes = categories([5, 1, 1, 1, 3, None, 5])  # 1 the most frequent: still after nothing
    assert labels == ["1", "3", "5", "(none)"]
    assert [labels[c] for c in codes] == ["5", "1", "1", "1", "3", "(none)", "5"]
    assert categories([2.5, 0.5, 0.5])[0] == ["0.5", "2.5"]


def test_a_small_table_is_laid_out_by_t_sne_in_seconds():
    from embedfleet.map import SMALL_LAYOUT, layout

    rng = np.random.default_rng(1)
    centers = rng.normal(size=(2, 32))
    x = np.concatenate([c + 0.05 * rng.normal(size=(60, 32)) for c in centers]).astype(np.float32)
    coords, method = layout(x, seed=0)
    assert method == "t-sne" and coords.shape == (120, 2) and np.isfinite(coords).all() and 120 <= SMALL_LAYOUT
    a, b = coords[:60].mean(0), coords[60:].mean(0)
    spread = max(coords[:60].std(0).max(), coords[60:].std(0).max())
    assert np.linalg.norm(a - b) > 3 * spread  # the two clusters land apart
