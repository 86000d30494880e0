"""The code a binary index ranks by: each dimension of a vector compared with a few thresholds, the bits of all
comparisons end to end (docs/decisions/binary-index.md).

One bit a dimension (`binary_quantize(embedding)`, the sign) leaves the true nearest rows of a narrow model
far down the Hamming ranking. With T thresholds at the dimension's quantiles, a dimension reads as T+1 levels
in thermometer code (the bits of the thresholds below it set): the Hamming distance between two codes is the
L1 distance between their levels, summed over the dimensions. A vector gets thresholds until it has about
CODE_BITS bits; one of CODE_BITS dimensions or more keeps one bit a dimension, the sign (pgvector's plain
`binary_quantize(embedding)::bit(D)`, the index of vectors wider than halfvec's), already thousands of bits.

The code is an SQL expression over the stored vector (pgvector's `binary_quantize` of the vector less each
threshold vector, concatenated), so the index computes it for every row that arrives, and a search computes the
query's with the same expression, read back from the index's definition."""

from __future__ import annotations

import math
import re

import numpy as np
import psycopg
from psycopg import sql

__all__ = ["CODE_BITS", "MAX_THRESHOLDS", "SAMPLE_ROWS", "code_bits", "code_expression", "code_words", "is_current",
           "query_code", "thresholds", "thresholds_of"]

CODE_BITS = 2688  # bits a code gets at least, where the thresholds allow: 7 a dimension of a 384-dim vector
MAX_THRESHOLDS = 7  # a dimension in at most 8 levels
SAMPLE_ROWS = 10_000  # rows the thresholds are read from


def thresholds(dim: int) -> int:
    """How many thresholds each dimension of a `dim`-dimensional vector is compared with."""
    return max(1, min(MAX_THRESHOLDS, math.ceil(CODE_BITS / dim)))


def is_current(index_key: str, dim: int) -> bool:
    """Whether an index's key (as the server prints it) codes `dim`-dimensional vectors with as many thresholds
    as this version gives them (an earlier version's had the sign alone)."""
    return index_key.count("binary_quantize") == thresholds(dim)


def code_bits(dim: int) -> int:
    return dim * thresholds(dim)


def quantiles(sample: np.ndarray, count: int) -> np.ndarray:
    """(count, dim) thresholds: each dimension's quantiles at 1/(count+1) … count/(count+1) of `sample`'s rows;
    for one threshold, or no rows, one of zeros (the sign)."""
    dim = sample.shape[1]
    if count == 1 or len(sample) == 0:  # no rows: the sign alone, which a later rebuild replaces
        return np.zeros((1, dim), np.float32)
    return np.quantile(sample, np.arange(1, count + 1) / (count + 1), axis=0).astype(np.float32)


def code_words(dim: int) -> str:
    """The code of a `dim`-dimensional vector, in words."""
    count = thresholds(dim)
    if count == 1:
        return f"binary_quantize(embedding)::bit({dim})"
    return f"binary_quantize(embedding) at {count + 1} levels a dimension, bit({count * dim})"


def code_expression(column: sql.Composable, levels: np.ndarray | None, dim: int, vtype: str) -> sql.Composable:
    """The code of `column` (a `dim`-dimensional `vtype` vector) at `levels` ((T, dim) thresholds), as
    `bit(T·dim)`. None, or one threshold of zeros, is pgvector's plain `binary_quantize(embedding)::bit(dim)`."""
    count = 1 if levels is None else len(levels)
    if levels is None or (count == 1 and not levels.any()):
        return sql.SQL("binary_quantize({})::bit({})").format(column, sql.Literal(dim))
    parts = [sql.SQL("binary_quantize({} - {}::{})::bit({})").format(
        column, sql.Literal("[" + ",".join(f"{x:.7g}" for x in row) + "]"), sql.SQL(vtype), sql.Literal(dim))
        for row in levels]
    return sql.SQL("({})::bit({})").format(sql.SQL(" || ").join(parts), sql.Literal(count * dim))


def thresholds_of(conn: psycopg.Connection, table: sql.Composable, dim: int) -> np.ndarray:
    """The thresholds for `table`'s vectors, read from a sample of SAMPLE_ROWS of its rows: whole pages drawn
    at random (the same ones while the table is unchanged), then rows drawn from those with a fixed seed."""
    from pgvector.psycopg import register_vector

    register_vector(conn)
    count = thresholds(dim)
    if count == 1:
        return quantiles(np.zeros((0, dim), np.float32), 1)
    name = table.as_string(conn)
    rows_sql = ("SELECT coalesce(sum(greatest(c.reltuples, 0)), 0) FROM pg_partition_tree(%s::regclass) t "
                "JOIN pg_class c ON c.oid = t.relid WHERE t.isleaf")
    rows = conn.execute(rows_sql, [name]).fetchone()[0]
    if rows <= 0:  # never analysed: the planner's statistics say how large a share to read
        conn.execute(sql.SQL("ANALYZE {}").format(table))
        rows = conn.execute(rows_sql, [name]).fetchone()[0]
    share = 100.0 if rows <= SAMPLE_ROWS else min(100.0, 150.0 * SAMPLE_ROWS / rows)
    got = conn.execute(sql.SQL("SELECT embedding::vector FROM {} TABLESAMPLE SYSTEM ({}) REPEATABLE (0) "
                               "WHERE embedding IS NOT NULL LIMIT {}").format(
        table, sql.Literal(share), sql.Literal(3 * SAMPLE_ROWS))).fetchall()
    sample = np.stack([r[0].to_numpy() for r in got]).astype(np.float32) if got else np.zeros((0, dim), np.float32)
    if len(sample) > SAMPLE_ROWS:
        sample = sample[np.random.default_rng(0).choice(len(sample), SAMPLE_ROWS, replace=False)]
    return quantiles(sample, count)


def query_code(index_key: str, vtype: str) -> tuple[sql.Composable, sql.Composable]:
    """(the code of the stored vectors, the code of the query `%(q)s`) from an index's key as the server prints
    it (`pg_get_indexdef(index, 1, true)`): the planner matches the first to the index, so it is used as is."""
    key = index_key.replace("%", "%%")
    return sql.SQL(key), sql.SQL(re.sub(r"\bembedding\b", f"%(q)s::{vtype}", key))
