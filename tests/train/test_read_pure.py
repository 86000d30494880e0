"""How a training read takes its rows."""

from __future__ import annotations

from embedfleet.sources.plan import ChunkSpec
from embedfleet.train.read import use_chunks


def _c(src, first, kind="jsonl"):
    return ChunkSpec(src, kind, 0, 0, first)


def test_one_connection_takes_a_message_a_row_where_the_client_has_cores_to_spare():
    assert not use_chunks(180000, 1, cores=16) and not use_chunks(140000, 1, cores=4)
    assert use_chunks(180000, 1, cores=2)  # client and server share two cores: chunks cost the client less
    assert use_chunks(180000, 4, cores=64)  # several connections' clients share one GIL
    assert not use_chunks(130000, 4, cores=2)  # PostgreSQL 13 has no TID range scan
