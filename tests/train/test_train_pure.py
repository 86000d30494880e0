"""Binary COPY parsing, ids, class indices, metrics and the tier choice: no database."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from embedfleet.errors import InputError
from embedfleet.pg.copybin import (
    SIGNATURE,
    TRAILER,
    check_rows,
    chunk_count,
    chunk_rows,
    header_length,
    row_dtype,
    scalar_field,
    vector_field,
)
from embedfleet.train.dataset import choose_tier, host_take, make_put, resolve_dtype
from embedfleet.train.metrics import classify_metrics, regress_metrics
from embedfleet.train.read import Ids, Split, class_index


def _rows(vtype: str, vecs: np.ndarray, labels, ids: list[str], null_label_at: int | None = None) -> bytes:
    """What PostgreSQL sends for COPY (SELECT ctid, label::float8, vec, id) TO STDOUT (FORMAT BINARY)."""
    elem = ">f4" if vtype == "vector" else ">f2"
    out = bytearray(SIGNATURE + (0).to_bytes(4, "big") + (4).to_bytes(4, "big") + b"ext!")
    for i, (v, y, rid) in enumerate(zip(vecs, labels, ids)):
        out += (4).to_bytes(2, "big")
        out += (6).to_bytes(4, "big") + (i // 3).to_bytes(4, "big") + (i % 3 + 1).to_bytes(2, "big")
        if i == null_label_at:
            out += (-1).to_bytes(4, "big", signed=True)
        else:
            out += (8).to_bytes(4, "big") + np.array(y, ">f8").tobytes()
        body = np.array(v, elem).tobytes()
        out += (4 + len(body)).to_bytes(4, "big") + len(v).to_bytes(2, "big") + b"\0\0" + body
        b = rid.encode()
        out += len(b).to_bytes(4, "big") + b
    return bytes(out + TRAILER)


def _split(buf: bytes, fixed: int, n: int) -> tuple[np.ndarray, list[bytes]]:
    """Rows the way copy_rows hands them on: fixed prefixes packed, the rest of each row aside."""
    pos = header_length(buf)
    prefix, rest = bytearray(), []
    for _ in range(n):
        idlen = int.from_bytes(buf[pos + fixed - 4:pos + fixed], "big")
        prefix += buf[pos:pos + fixed]
        rest.append(buf[pos + fixed:pos + fixed + idlen])
        pos += fixed + idlen
    assert buf[pos:] == TRAILER
    return np.frombuffer(bytes(prefix), np.uint8), rest


@pytest.mark.parametrize("vtype", ["vector", "halfvec"])
def test_fixed_width_rows_parse_with_one_frombuffer(vtype):
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((7, 5)).astype(np.float16 if vtype == "halfvec" else np.float32)
    ids = ["a", "bé", "ccc", "", "d|e|f", "x" * 40, "7"]
    fields = [scalar_field("tid", "tid"), scalar_field("label", "float8"), vector_field("vec", vtype, 5)]
    dtype = row_dtype(fields, trailing_text=True)
    raw, rest = _split(_rows(vtype, vecs, range(7), ids), dtype.itemsize, 7)
    rows = np.frombuffer(raw, dtype)
    assert check_rows(rows, fields, True, np.array([len(r) for r in rest])) is None
    assert np.array_equal(rows["vec"]["values"].astype(vecs.dtype), vecs)
    assert rows["label"].tolist() == list(range(7))
    assert rows["tid"]["block"].tolist() == [0, 0, 0, 1, 1, 1, 2] and rows["tid"]["offset"].tolist()[:4] == [1, 2, 3, 1]
    assert [r.decode() for r in rest] == ids
    # what make_put does with the big-endian view: native values in the destination
    dst = torch.zeros((7, 5), dtype=torch.float32)
    make_put(dst)(0, rows["vec"]["values"])
    assert torch.equal(dst, torch.from_numpy(vecs.astype(np.float32)))
    bf = torch.zeros((7, 5), dtype=torch.bfloat16)
    make_put(bf)(0, rows["vec"]["values"])
    assert torch.equal(bf, torch.from_numpy(vecs.astype(np.float32)).bfloat16())


def test_a_null_or_another_dimension_is_reported():
    fields = [scalar_field("tid", "tid"), scalar_field("label", "float8"), vector_field("vec", "vector", 3)]
    dtype = row_dtype(fields, trailing_text=True)
    raw, _ = _split(_rows("vector", np.ones((2, 3)), [1, 2], ["a", "b"]), dtype.itemsize, 2)
    rows = np.frombuffer(raw, dtype).copy()
    rows["label_len"][1] = -1
    assert "(NULL)" in check_rows(rows, fields, True)
    rows = np.frombuffer(raw, dtype).copy()
    rows["vec"]["dim"][0] = 4
    assert "dimension 4" in check_rows(rows, fields, True)
    rows = np.frombuffer(raw, dtype).copy()
    rows["nfields"][0] = 3
    assert "fields" in check_rows(rows, fields, True)
    with pytest.raises(ValueError):
        header_length(b"NOTPGCOPY" + bytes(20))


def _chunk(labels: list[float], vectors: list[np.ndarray], ids: list[bytes], elem: str) -> bytes:
    """A chunk as the server sends it: count, label float8[], the vectors' send bytes end to end, id lengths, ids."""
    def field(b: bytes) -> bytes:
        return len(b).to_bytes(4, "big") + b

    def array(values: list[bytes]) -> bytes:  # one dimension, no NULLs
        head = (1).to_bytes(4, "big") + bytes(4) + bytes(4) + len(values).to_bytes(4, "big") + (1).to_bytes(4, "big")
        return head + b"".join(field(v) for v in values)

    sent = b"".join(len(v).to_bytes(2, "big") + bytes(2) + v.astype(elem).tobytes() for v in vectors)
    return (5).to_bytes(2, "big") + (field(len(labels).to_bytes(8, "big"))
            + field(array([np.array([x], ">f8").tobytes() for x in labels])) + field(sent)
            + field(array([len(i).to_bytes(4, "big") for i in ids])) + field(b"".join(ids)))


@pytest.mark.parametrize("vtype, elem", [("vector", ">f4"), ("halfvec", ">f2")])
def test_a_chunk_parses_its_packed_vectors_in_place(vtype, elem):
    fields = [scalar_field("label", "float8"), vector_field("vec", vtype, 3)]
    dtype = row_dtype(fields, trailing_text=True)
    vectors = [np.array([i, -i, 0.5], np.float32) for i in range(5)]
    msg = _chunk([1.0, 2.0, 3.0, 4.0, 5.0], vectors, [b"a", b"\xc3\xa9t\xc3\xa9", b"", b"ccc", b"d"], elem)
    assert chunk_count(msg) == 5
    out = np.zeros(7, dtype)
    rows, ids, lengths = chunk_rows(msg, fields, dtype, out=out[1:6])
    assert check_rows(rows, fields, True, lengths) is None
    assert rows["label"].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert np.array_equal(out["vec"]["values"][1:6].astype(np.float32), np.stack(vectors))
    assert ids == "aétécccd".encode() and lengths.tolist() == [1, 5, 0, 3, 1]
    assert out["nfields"][0] == 0 and out["nfields"][6] == 0  # only its own rows written


@pytest.mark.parametrize("vtype, elem, want", [("vector", ">f4", "16 bytes where 12"), ("halfvec", ">f2", "10 bytes where 8")])
def test_a_packed_vector_of_another_dimension_is_named(vtype, elem, want):
    fields = [scalar_field("label", "float8"), vector_field("vec", vtype, 2)]
    dtype = row_dtype(fields, trailing_text=True)
    msg = _chunk([1.0, 2.0], [np.ones(2, np.float32), np.ones(3, np.float32)], [b"a", b"b"], elem)
    with pytest.raises(ValueError, match=f"vec: a value of {want} were expected \\(a vector of another dimension"):
        chunk_rows(msg, fields, dtype)
    # lengths that add up by chance (dimensions 1 and 3 where 2): parsed, then refused by check_rows
    msg = _chunk([1.0, 2.0], [np.ones(1, np.float32), np.ones(3, np.float32)], [b"a", b"b"], elem)
    rows, _, lengths = chunk_rows(msg, fields, dtype)
    assert check_rows(rows, fields, True, lengths) == "vec: vectors of dimension 1 among dimension 2"


def test_ids_keep_order_take_and_pickle():
    parts = [Ids(b"abcd", np.array([1, 4])), Ids(), Ids("é|z".encode(), np.array([4]))]
    ids = Ids.concat(parts)
    assert ids.tolist() == ["a", "bcd", "é|z"] and ids[2] == "é|z" and ids[-1] == "é|z" and len(ids) == 3
    assert ids.take(np.array([2, 0])).tolist() == ["é|z", "a"] and ids.take(np.array([], int)).tolist() == []
    assert pickle.loads(pickle.dumps(ids)) == ids and ids[0:2] == ["a", "bcd"]


def test_class_index_marks_unknown_and_null():
    classes = np.array([1.0, 2.5, 5.0])
    # NULL (NaN) -1; a value not among the classes UNSEEN_CLASS (-2)
    assert class_index(classes, np.array([5.0, 1.0, np.nan, 3.0, 2.5, 9.0])).tolist() == [2, 0, -1, -2, 1, -2]


def test_split_rule():
    keys = np.array([0, 429496729, 429496730, 2 ** 32 - 1], np.uint32)
    assert Split.is_val(keys, 0.1).tolist() == [True, True, False, False]
    assert Split.key_of("abc") == int("900150983cd24fb0d6963f7d28e17f72"[:8], 16)
    with pytest.raises(InputError):
        Split("test")
    with pytest.raises(InputError):
        Split("val", 1.0)


def test_classify_metrics_from_a_confusion_matrix():
    # class 2 is predicted but never true (F1 0); class 3 neither occurs nor is predicted (left out)
    c = np.array([[3, 1, 0, 0], [0, 2, 2, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    m = classify_metrics(c)
    assert m["accuracy"] == 5 / 8
    f1 = [2 * 3 / (4 + 3), 2 * 2 / (4 + 3), 0.0]
    assert m["macro_f1"] == pytest.approx(sum(f1) / 3) and m["confusion"] == c.tolist() and m["rows"] == 8
    assert classify_metrics(np.zeros((2, 2)))["accuracy"] is None
    r = regress_metrics(6.0, 20.0, 4)
    assert r["mae"] == 1.5 and r["rmse"] == pytest.approx(5 ** 0.5) and regress_metrics(0, 0, 0)["mae"] is None


def test_tier_choice_without_cuda():
    cpu = torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="needs a CUDA device"):
            choose_tier("gpu", cpu, 10)
    with pytest.raises(InputError):
        choose_tier("disk", cpu, 10)
    assert choose_tier("auto", cpu, 1000) == "ram"
    assert choose_tier("auto", cpu, 1 << 60) == "stream"
    assert choose_tier("stream", cpu, 10) == "stream"
    assert resolve_dtype(None, "halfvec") == torch.float16 and resolve_dtype("bf16", "vector") == torch.bfloat16
    with pytest.raises(InputError):
        resolve_dtype("int8", "vector")


def test_host_take_matches_indexing_for_every_dtype():
    x = torch.arange(40, dtype=torch.float32).view(10, 4)
    idx = np.array([9, 0, 3, 3])
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        assert torch.equal(host_take(x.to(dt), idx), x.to(dt)[torch.from_numpy(idx)])


def test_a_read_that_fails_puts_no_block_after_and_keeps_the_puts_error_beside_its_own():
    import threading

    from embedfleet.train.read import Handoff

    put, started, gate = [], threading.Event(), threading.Event()

    def on_block(i):
        started.set()
        gate.wait(5)  # the loop gives two blocks and fails while the first is being put
        put.append(i)
        raise ValueError("the put failed")

    with pytest.raises(KeyError) as e:
        with Handoff(on_block, ahead=True) as hand:
            hand.give(hand.slot(), 0)
            hand.give(hand.slot(), 1)
            assert started.wait(5)
            gate.set()
            raise KeyError("the loop failed")
    assert put == [0]  # block 1 was only handed back
    assert isinstance(e.value.__context__, ValueError)



def test_the_default_batch_takes_at_least_eight_steps_an_epoch():
    from embedfleet.train.trainer import MAX_AUTO_BATCH, auto_batch

    assert [auto_batch(n) for n in (1, 7, 8, 169, 180, 1000)] == [1, 1, 1, 16, 16, 64]
    assert auto_batch(10**6) == MAX_AUTO_BATCH == 4096
    assert all(-(-n // auto_batch(n)) >= 8 for n in range(8, 40_000, 7))


def test_the_default_learning_rate_is_raised_only_for_short_runs():
    from embedfleet.train.trainer import auto_lr

    assert auto_lr(140) == 0.01 and auto_lr(1) == 0.01  # a few steps: at most 0.01
    assert auto_lr(1000) == pytest.approx(0.002)
    assert auto_lr(2000) == auto_lr(100_000) == 0.001  # AdamW's usual rate for a run of any length
