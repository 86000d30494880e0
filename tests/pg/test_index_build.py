"""The HNSW build: memory sized to the graph, workers by the cores, a partitioned table's partitions built side by
side and adopted by the table's index, on a real server."""

from __future__ import annotations

import numpy as np
import psycopg
from psycopg import sql

from embedfleet.pg.binary_code import thresholds
from embedfleet.pg.ddl import ensure_table, ensure_vector, finish_table, index_key, index_of, indexes_of
from embedfleet.pg.index_build import build_index, build_plan, graph_mb, rebuild_index
from embedfleet.query.search import Searcher


def test_memory_holds_the_graph_and_the_cores_are_shared_among_builds():
    one = build_plan([1_000_000], "direct", 384, "vector", cores=16, memory_mb=64_000)
    # a million 384-dim elements take ~2 GB in pgvector's graph: more than the 1 GB it used to be given
    assert one.memory_mb == graph_mb(1_000_000, "direct", 384, "vector") and 2_000 < one.memory_mb < 4_000
    assert one.workers == 15 and one.side_by_side == 1
    parts = build_plan([125_000] * 8, "direct", 384, "vector", cores=16, memory_mb=64_000)
    assert parts.side_by_side == 4 and parts.workers == 3 and parts.memory_mb < one.memory_mb / 4
    tight = build_plan([125_000] * 8, "direct", 384, "vector", cores=16, memory_mb=700)
    assert tight.side_by_side == 2 and tight.side_by_side * tight.memory_mb <= 700
    assert build_plan([10] * 8, "direct", 384, "vector", cores=2, memory_mb=1000) == (64, 0, 2)
    assert build_plan([0], "direct", 8, "vector", cores=1, memory_mb=1000) == (64, 0, 1)
    # the binary-quantized index's values are 48 bytes, not 1,544: a far smaller graph
    assert graph_mb(1_000_000, "bit", 384, "vector") < graph_mb(1_000_000, "direct", 384, "vector") / 2
    assert graph_mb(1_000_000, "halfvec", 3000, "vector") < graph_mb(1_000_000, "direct", 3000, "vector")


def _loaded(conn, table: str, partitions: int | None, rows: int = 2000) -> np.ndarray:
    ensure_vector(conn)
    ensure_table(conn, table, [], 8, "vector", partitions)
    vecs = np.random.default_rng(7).standard_normal((rows, 8)).astype(np.float32)
    from psycopg import sql

    from embedfleet.pg.ddl import table_sql

    with conn.cursor().copy(sql.SQL("COPY {} (id, content, embedding) FROM STDIN").format(table_sql(conn, table))) as copy:
        for i, v in enumerate(vecs):
            copy.write_row([f"r{i}", f"text {i}", "[" + ",".join(map(str, v)) + "]"])
    return vecs


def _leaf_indexes(conn, table: str, n: int) -> list[list[tuple[str, str]]]:
    return [indexes_of(conn, f"{table}_p{i}") for i in range(n)]


def _attached(conn, index: str) -> int:
    return conn.execute("SELECT count(*) FROM pg_inherits WHERE inhparent = %s::regclass", [index]).fetchone()[0]


def test_partitions_are_indexed_side_by_side_and_the_tables_index_adopts_them(dsn, conn, monkeypatch):
    vecs = _loaded(conn, "parted", 3)
    # a build cut short: one partition has its index already, which the finish keeps rather than builds again
    conn.execute("CREATE INDEX kept ON parted_p1 USING hnsw (embedding vector_cosine_ops)")
    opened, connect = [], psycopg.connect
    monkeypatch.setattr(psycopg, "connect", lambda *a, **kw: opened.append(a) or connect(*a, **kw))
    timings = {}
    name, kind = finish_table(conn, "parted", index=True, timings=timings, dsn=dsn)
    assert (name, kind) == index_of(conn, "parted") and timings["index_build"]["side_by_side"] >= 2
    leaves = _leaf_indexes(conn, "parted", 3)
    assert [len(x) for x in leaves] == [1, 1, 1] and leaves[1] == [("kept", "direct")]
    assert _attached(conn, name) == 3
    # ANALYZE's partitions on their own connections (PostgreSQL 18), then the two partitions left to index
    assert len(opened) == (3 if conn.info.server_version >= 180000 else 0) + 2
    conn.execute("SET enable_seqscan = off")
    plan = "\n".join(r[0] for r in conn.execute(
        "EXPLAIN SELECT id FROM parted ORDER BY embedding <=> %s::vector LIMIT 5", [str(vecs[0].tolist())]))
    assert plan.count("Index Scan") == 3
    found = Searcher(conn, "parted").search(vecs[0], 5)
    assert found[0]["id"] == "r0"
    # rebuilt as binary: each partition's new index built beside, adopted, and the old ones dropped with the table's
    new, built = rebuild_index(conn, "parted", "binary", dsn)
    assert built and index_of(conn, "parted") == (new, "bit") and _attached(conn, new) == 3
    assert [[kind for _, kind in x] for x in _leaf_indexes(conn, "parted", 3)] == [["bit"]] * 3


def test_a_tables_own_parallel_workers_setting_is_put_back_and_a_search_takes_k_past_40(conn):
    vecs = _loaded(conn, "plain", None)
    conn.execute("ALTER TABLE plain SET (parallel_workers = 3)")
    _loaded(conn, "bare", None)
    finish_table(conn, "plain", index=True)
    finish_table(conn, "bare", index=True)
    options = dict(o.split("=") for o in conn.execute(
        "SELECT reloptions FROM pg_class WHERE oid = 'plain'::regclass").fetchone()[0])
    assert options["parallel_workers"] == "3"
    assert not any(o.startswith("parallel_workers") for o in conn.execute(
        "SELECT coalesce(reloptions, '{}') FROM pg_class WHERE oid = 'bare'::regclass").fetchone()[0])
    # pgvector hands over at most hnsw.ef_search rows (40 unless set): 60 asked are 60 found, by the index
    searcher = Searcher(conn, "plain")
    rows = searcher.search(vecs[5], 60)
    assert len(rows) == 60 and searcher.scan == "index" and rows[0]["id"] == "r5"
    exact = np.argsort(1 - (vecs @ vecs[5]) / np.linalg.norm(vecs, axis=1) / np.linalg.norm(vecs[5]))[:60]
    assert len({r["id"] for r in rows} & {f"r{i}" for i in exact}) >= 55


def test_on_a_server_with_cores_to_spare_each_partitions_build_gets_workers_and_the_table_none(dsn, conn, monkeypatch):
    import embedfleet.pg.index_build as index_build

    monkeypatch.setattr(index_build, "server_resources", lambda conn: (4, 1000))
    _loaded(conn, "wide", 2)
    timings = {}
    name, _ = finish_table(conn, "wide", index=True, timings=timings, dsn=dsn)
    assert timings["index_build"] == {"memory_mb": 64, "workers": 1, "side_by_side": 2} and _attached(conn, name) == 2
    for leaf in ("wide_p0", "wide_p1"):  # set for the build, put back before its commit
        assert conn.execute("SELECT reloptions FROM pg_class WHERE oid = %s::regclass", [leaf]).fetchone()[0] == [
            "toast_tuple_target=8160"]


def test_a_partitioned_table_whose_name_needs_quotes_is_indexed_and_a_rebuild_cut_short_is_finished(dsn, conn):
    vecs = _loaded(conn, "Reviews", 2)  # partitions "Reviews_p0", "Reviews_p1": names PostgreSQL quotes
    name, _ = finish_table(conn, "Reviews", index=True, dsn=dsn)
    assert _attached(conn, f'public."{name}"') == 2
    # a rebuild cut short after its new index was built, before the old one was dropped: the next finishes it
    build_index(conn, "Reviews", "binary", dsn)
    assert sorted(k for _, k in indexes_of(conn, "Reviews")) == ["bit", "direct"]
    new, built = rebuild_index(conn, "Reviews", "binary", dsn)
    assert not built and indexes_of(conn, "Reviews") == [(new, "bit")]
    assert Searcher(conn, "Reviews").search(vecs[3], 3)[0]["id"] == "r3"
    # an earlier version's binary index (the sign alone) is rebuilt with the levels, and searched through them
    conn.execute(sql.SQL("DROP INDEX {}").format(sql.Identifier(new)))
    conn.execute('CREATE INDEX old_sign ON "Reviews" USING hnsw ((binary_quantize(embedding)::bit(8)) bit_hamming_ops)')
    new, built = rebuild_index(conn, "Reviews", "binary", dsn)
    assert built and new != "old_sign" and indexes_of(conn, "Reviews") == [(new, "bit")]
    assert _attached(conn, f'public."{new}"') == 2 and [len(x) for x in _leaf_indexes(conn, "Reviews", 2)] == [1, 1]
    assert index_key(conn, "Reviews", new).count("binary_quantize") == thresholds(8)
    assert Searcher(conn, "Reviews").search(vecs[3], 3)[0]["id"] == "r3"


def test_k_past_what_the_index_hands_over_is_measured_exactly(conn):
    vecs = _loaded(conn, "many", None, rows=1500)
    finish_table(conn, "many", index=True)
    searcher = Searcher(conn, "many")
    rows = searcher.search(vecs[0], 1200)  # hnsw.ef_search stops at 1,000: the index hands over no more
    exact = np.argsort(1 - (vecs @ vecs[0]) / np.linalg.norm(vecs, axis=1) / np.linalg.norm(vecs[0]))[:1200]
    assert len(rows) == 1200 and rows[0]["id"] == "r0"
    assert len({r["id"] for r in rows} & {f"r{i}" for i in exact}) >= 1190


def test_a_binary_build_cut_short_resumes_with_the_thresholds_its_partitions_have(dsn, conn):
    """A partition indexed by a build cut short keeps its index, the others get its code (though the rows grew
    since, and a fresh sample would draw other thresholds), the table's index adopts all three, and another
    code's index left on a partition is dropped."""
    from embedfleet.pg.binary_code import thresholds_of
    from embedfleet.pg.ddl import _index_expression, table_sql

    vecs = _loaded(conn, "coded", 3)
    conn.execute("ANALYZE coded")
    first = sql.SQL("hnsw ({})").format(_index_expression("bit", 8, "vector", thresholds_of(conn, table_sql(conn, "coded"), 8)))
    conn.execute(sql.SQL("CREATE INDEX cut ON coded_p0 USING {}").format(first))
    conn.execute('CREATE INDEX old_sign ON coded_p2 USING hnsw ((binary_quantize(embedding)::bit(8)) bit_hamming_ops)')
    with conn.cursor().copy("COPY coded (id, content, embedding) FROM STDIN") as copy:
        for i, v in enumerate(np.random.default_rng(8).standard_normal((3000, 8)).astype(np.float32) * 3 + 1):
            copy.write_row([f"s{i}", "more", "[" + ",".join(map(str, v)) + "]"])
    conn.execute("ANALYZE coded")
    build_index(conn, "coded", "binary", dsn)
    name, kind = index_of(conn, "coded")
    assert kind == "bit" and _attached(conn, name) == 3
    leaves = _leaf_indexes(conn, "coded", 3)
    assert [len(x) for x in leaves] == [1, 1, 1] and leaves[0] == [("cut", "bit")]  # old_sign went
    key = index_key(conn, "coded_p0", "cut")
    assert all(index_key(conn, f"coded_p{i}", leaves[i][0][0]) == key for i in range(3))
    assert Searcher(conn, "coded").search(vecs[5], 3)[0]["id"] == "r5"
