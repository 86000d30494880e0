"""Writer's routing of units to its threads (the transaction itself is tested against PostgreSQL in
tests/ingest/test_ingest.py)."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest

from embedfleet.ingest.commit import Writer
from embedfleet.ingest.stages import Embedded, Unit
from embedfleet.ledger import Claim
from embedfleet.pg.copyin import EncodedRows


class RecordingSink:
    """Stands in for TableSink: notes which thread committed which unit; chunk 0 takes a second to commit."""

    def __init__(self, log: list):
        self.log = log
        self.conn = self  # close() stands in for the connection's

    def close(self) -> None:
        self.log.append(("closed", self))

    def commit_once(self, item: Embedded) -> int:
        unit = item.unit
        if unit.claim.chunk < 0:
            raise RuntimeError("this chunk fails")
        if unit.claim.chunk == 0:
            time.sleep(1.0)
        self.log.append((threading.current_thread().name, unit.claim.chunk, unit.cursor_line))
        return unit.rows.n


class Server:
    """Stands in for `Reconnect`: hands out connections while it has some free."""

    def __init__(self, free: int = 99):
        self.free = free

    def first(self):
        if self.free == 0:
            raise RuntimeError("sorry, too many clients already")
        self.free -= 1
        return object()

    def __call__(self, err):
        raise err


def failures(writer: Writer) -> list:
    out = []
    while not writer.failures.empty():
        out.append(writer.failures.get())
    return out


def unit(chunk: int, cursor: int, last: bool, token: uuid.UUID | None = None) -> Embedded:
    """An embedded unit of no rows, as the commit stage hands it to the writer."""
    claim = Claim("job", chunk, "f.jsonl", "jsonl", 0, 1, 1, None, 0, token or uuid.uuid4())
    return Embedded(Unit(claim, EncodedRows(b"", np.zeros(1, np.int64)), 0, [], cursor, last), None)


def test_units_avoid_a_busy_thread_and_a_chunks_units_stay_in_order():
    log: list = []
    writer = Writer(lambda conn: RecordingSink(log), Server(), threads=3, depth=2)
    writer.submit(unit(0, 1, True))  # a slow commit holds one thread for a second
    t0 = time.perf_counter()
    for chunk in range(1, 13):  # single-unit chunks: with fixed turns every third would queue behind chunk 0
        writer.submit(unit(chunk, 1, True))
        time.sleep(0.02)  # units arrive one at a time, as from the GPU loop
    submitted_s = time.perf_counter() - t0
    token = uuid.uuid4()
    for cursor in (10, 20, 30, 40):  # one chunk in four units: the same thread, in order
        writer.submit(unit(99, cursor, cursor == 40, token))
    writer.close()
    assert not failures(writer)
    assert submitted_s < 0.6  # none of the twelve waited for the slow commit
    assert {c for _, c, _ in log[:12]} == set(range(1, 13))  # all of them committed while chunk 0 still was
    chunk99 = [(name, cursor) for name, c, cursor in log if c == 99]
    assert [c for _, c in chunk99] == [10, 20, 30, 40] and len({name for name, _ in chunk99}) == 1
    assert sorted(c for _, c, _ in log) == [0, *range(1, 13), 99, 99, 99, 99]


def test_a_chunk_that_fails_midway_leaves_no_routing_behind():
    log: list = []
    writer = Writer(lambda conn: RecordingSink(log), Server(), threads=2)
    writer.submit(unit(-1, 10, False))  # the first of several units; the worker sends no more once it fails
    writer.close()
    (failure,) = failures(writer)  # a value for the worker's loop to record, not a callback from this thread
    assert failure.claim.chunk == -1 and "fails" in str(failure.error)
    assert log == [] and writer._chunk_thread == {}


def test_a_server_out_of_connections_part_way_leaves_fewer_writers_not_none():
    log: list = []
    made: list = []

    def sink(conn):
        made.append(RecordingSink(log))
        return made[-1]

    writer = Writer(sink, Server(free=2), threads=6)
    assert writer.connections == 2 and not log
    for chunk in range(1, 9):
        writer.submit(unit(chunk, 1, True))
    writer.close()
    assert sorted(c for _, c, _ in log) == list(range(1, 9))  # every unit committed, on the two
    # `spare` connections go back to the server for what the caller opens later, but never the last
    for spare, kept in ((1, 3), (5, 1)):
        log.clear()
        made.clear()
        writer = Writer(sink, Server(free=4), threads=6, spare=spare)
        assert writer.connections == kept and log == [("closed", s) for s in reversed(made[kept:])]
        writer.close()

    with pytest.raises(RuntimeError, match="too many clients"):  # not even one: the worker cannot write at all
        Writer(sink, Server(free=0), threads=6)
