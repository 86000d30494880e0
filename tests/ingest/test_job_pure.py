"""A job's pure pieces: --limit over the inputs, how many workers and writers, the progress and status lines, what bound a run."""

from __future__ import annotations

import gzip
import json
import os
import time
from collections import deque
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedfleet.ingest.job import apply_limit
from embedfleet.ingest.launch import worker_count, writers_each
from embedfleet.ingest.monitor import rate_and_eta
from embedfleet.sources import read_chunk
from embedfleet.sources.plan import ChunkSpec, plan_chunks


def _c(src, first, kind="jsonl"):
    return ChunkSpec(src, kind, 0, 0, first)


def test_limit_counts_a_csv_files_records_not_its_lines(tmp_path):
    """Each review's quoted text ran over two lines: `--limit 5` embedded 3 of them."""
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text("id,text\n" + "".join(f'{i},"review {i}\nits second line — ünï"\n' for i in range(6)))
    b.write_text("id,text\n" + "".join(f"b{i},one line {i}\n" for i in range(4)))
    chunks = plan_chunks([str(a), str(b)])

    def rows(limit):
        out = []
        for spec, cap in apply_limit(chunks, limit):
            out += [r.data["id"] for r in read_chunk(spec) if cap is None or r.line <= cap]
        return out

    assert rows(5) == ["0", "1", "2", "3", "4"]
    assert rows(6) == [str(i) for i in range(6)]
    assert rows(8) == [str(i) for i in range(6)] + ["b0", "b1"]
    assert rows(100) == [str(i) for i in range(6)] + [f"b{i}" for i in range(4)]


def _lines_of(path: Path, n: int, start: int) -> list[str]:
    return [json.dumps({"id": f"{path.name}-{i}", "text": f"line {i}"}) for i in range(start, start + n)]


def test_limit_caps_the_chunk_holding_the_nth_line():
    chunks = [_c("a", 1), _c("a", 101), _c("a", 201), _c("b", 1)]
    lines = {("a", 201): 50, ("b", 1): 1000}  # a file's last chunk is counted (here: known sizes)
    count = lambda c, most: lines[c.source, c.first_line] if lines[c.source, c.first_line] <= most else None  # noqa: E731
    assert apply_limit(chunks, None) == [(c, None) for c in chunks]
    assert apply_limit(chunks, 150, count) == [(chunks[0], 150), (chunks[1], 150)]
    assert apply_limit(chunks, 100, count) == [(chunks[0], 100)]
    assert apply_limit(chunks, 0, count) == []
    # past file a's 250 lines: into b, capped at its 250th line
    assert apply_limit(chunks, 500, count) == [(chunks[0], 500), (chunks[1], 500), (chunks[2], 500), (chunks[3], 250)]
    assert apply_limit(chunks, 250, count) == [(chunks[0], 250), (chunks[1], 250), (chunks[2], 250)]
    # a file with more lines than are left: the cap falls inside it and planning stops
    assert apply_limit(chunks, 500, lambda c, most: None) == [(chunks[0], 500), (chunks[1], 500), (chunks[2], 500)]


def test_limit_counts_lines_across_inputs_of_every_kind(tmp_path):
    """--limit N keeps the first N lines over all the inputs in order, whatever each file's kind."""
    plain = tmp_path / "a.jsonl"
    plain.write_text("\n".join(_lines_of(plain, 30, 0)) + "\n\n")  # a blank line counts as a line
    packed = tmp_path / "b.jsonl.gz"
    packed.write_bytes(gzip.compress("\n".join(_lines_of(packed, 20, 0)).encode()))  # no final newline
    table = tmp_path / "c.csv"
    table.write_text("id,text\n" + "".join(f'c-{i},"row\n{i}"\n' for i in range(25)))  # quoted newlines
    columns = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": [f"d-{i}" for i in range(40)], "text": ["x"] * 40}), columns, row_group_size=8)
    chunks = plan_chunks([str(p) for p in (plain, packed, table, columns)], chunk_bytes=200)
    assert len({c.source for c in chunks}) == 4 and len(chunks) > 6

    def kept(limit):
        return [(Path(r.source).suffix, r.line) for c, last in apply_limit(chunks, limit)
                for r in read_chunk(c) if last is None or r.line <= last]

    # past the first three files, into the Parquet file's third row group; each CSV record spans two lines
    # (its quoted newline) and counts once, numbered by the line it starts on as an editor shows it
    got = kept(31 + 20 + 25 + 17)
    assert len(got) == 30 + 20 + 25 + 17  # a.jsonl's blank 31st line holds no record
    assert [line for ext, line in got if ext == ".csv"] == list(range(2, 52, 2))
    assert [line for ext, line in got if ext == ".parquet"] == list(range(1, 18))
    assert len(kept(31 + 20 + 9)) == 30 + 20 + 9  # the CSV's first 9 records
    assert kept(40) == [(".jsonl", i) for i in range(1, 31)] + [(".gz", i) for i in range(1, 10)]
    assert len(kept(10_000)) == 30 + 20 + 25 + 40


def test_limit_goes_on_past_a_damaged_stream(tmp_path):
    """A truncated .gz counts no lines (its reader says where it is damaged): the inputs after it are planned."""
    before, after = tmp_path / "a.jsonl", tmp_path / "c.jsonl"
    for path in (before, after):
        path.write_text("\n".join(_lines_of(path, 10, 0)) + "\n")
    whole = gzip.compress("\n".join(_lines_of(before, 50, 0)).encode())
    (tmp_path / "b.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    chunks = plan_chunks([str(tmp_path / n) for n in ("a.jsonl", "b.jsonl.gz", "c.jsonl")])
    assert [(Path(c.source).name, last) for c, last in apply_limit(chunks, 15)] == [
        ("a.jsonl", 15), ("b.jsonl.gz", 5), ("c.jsonl", 5)]


def test_rate_and_eta_from_samples():
    h = deque([(0.0, 0, 0, 0), (10.0, 1000, 50000, 5)])
    rows, toks, eta = rate_and_eta(h, total_chunks=15)
    assert (rows, toks, eta) == (100.0, 5000.0, 20.0)
    assert rate_and_eta(deque([(0.0, 0, 0, 0)]), 3) == (0.0, 0.0, None)


def test_writer_connections_fit_what_the_server_has_free():
    assert writers_each(12, 2, free=290, others_each=3) == 12  # the embedded server: room for all
    assert writers_each(12, 8, free=90, others_each=3) == 8  # 8 GPUs on a stock server (100 connections)
    assert 8 * (writers_each(12, 8, free=90, others_each=3) + 3) <= 90
    assert writers_each(12, 8, free=90, others_each=3 + 8) == 1  # --meta: a connection per helper too
    assert writers_each(3, 2, free=4, others_each=3) == 1  # never none: the worker could not write at all


def test_a_worker_compiles_first_only_for_work_that_pays_for_it():
    from embedfleet.ingest.embed import (
        COMPILE_MIN_BYTES,
        SMALL_COMPILE_MIN_BYTES,
        compile_pays,
    )

    # a big model: a short job leaves it to the encoder's rule (None), a long one compiles at once
    assert compile_pays(0) is None and compile_pays(4000) is None and compile_pays(COMPILE_MIN_BYTES - 1) is None
    assert compile_pays(COMPILE_MIN_BYTES) is True and compile_pays(10 ** 10) is True
    assert compile_pays(None) is True  # Parquet, compressed or CSV input: its size in text is not known
    # a small model (MiniLM): its loop is host-bound, so only a long job pays for the compile; others never
    assert compile_pays(COMPILE_MIN_BYTES, small=True) is False
    assert compile_pays(SMALL_COMPILE_MIN_BYTES - 1, small=True) is False and compile_pays(None, small=True) is False
    assert compile_pays(SMALL_COMPILE_MIN_BYTES, small=True) is True


def test_no_more_workers_than_chunks_left_to_claim():
    assert worker_count(4, {"pending": 1, "running": 0, "done": 0, "failed": 0}) == 1  # 10 questions, 4 GPUs
    assert worker_count(4, {"pending": 2, "running": 1, "done": 5, "failed": 1}) == 3
    assert worker_count(4, {"pending": 40, "running": 0, "done": 0, "failed": 0}) == 4
    assert worker_count(4, {"pending": 0, "running": 0, "done": 9, "failed": 0}) == 1  # one reports it done


def test_the_final_progress_line_shows_rows_over_the_runs_own_time():
    import io

    from embedfleet.ingest.monitor import Monitor

    clock = iter([0.0, 5.0, 60.0, 190.0, 195.0])  # start-up, then the rows arrive in bursts of commits
    rows = iter([0, 0, 5000, 19000, 20000])
    out = io.StringIO()
    mon = Monitor("j", stream=out, clock=lambda: next(clock))
    for i in range(5):
        n = next(rows)
        mon.update({"rows_seen": n, "tokens": 10 * n, "chunks_done": i, "chunks_total": 4, "rejected": 0,
                    "chunks_failed": 0, "workers": []}, force=i == 4)
    last = out.getvalue().strip().splitlines()[-1]
    assert "(103/s, 1,026 tok/s over 195 s)" in last  # 20,000 rows / 195 s, not the last window's burst


def test_status_fits_80_columns_without_cutting_names_or_dates():
    from rich.console import Console

    from embedfleet.ingest.monitor import status_table

    name = "amazon_reviews_2023_cell_phones_accessories_part1"
    jobs = [{"job": name, "table": name, "state": "failed", "chunks_done": 3, "chunks_total": 4,
             "rows_written": 123456, "rejected": 2, "started": "2026-11-26T20:17:05+00:00",
             "finished": "2026-11-26T20:19:05+00:00", "error": "1 chunks failed",
             "failures": [{"chunk": 3, "source": "/data/bad.jsonl.gz", "error": "InputError: unreadable after line 9"}]}]
    console = Console(width=80, record=True)
    console.print(status_table(jobs))
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= 80
    assert name in "".join(line.split()[0] for line in text.splitlines()[1:4])  # wrapped, whole
    assert "11-26 20:17–20:19" in text  # started, and finished the same day
    assert "chunk 3 (bad.jsonl.gz) failed: InputError: unreadable after line 9" in " ".join(text.split())


def test_time_shares_count_a_loops_last_wait_as_the_databases_only_for_its_own_commits():
    from embedfleet.ingest.bound import time_shares

    # Two workers' loops: the last wait of each moves out of input — its own last commits to the database,
    # the rest (another worker's last chunk) to neither.
    a = {"wall_s": 10.0, "embed_s": 6.0, "input_wait_s": 3.0, "end_wait_s": 2.0, "tail_wait_s": 0.0, "sink_wait_s": 0.5}
    b = {"wall_s": 10.0, "embed_s": 7.0, "input_wait_s": 2.0, "end_wait_s": 0.0, "tail_wait_s": 1.0, "sink_wait_s": 1.5}
    assert time_shares([a, b]) == {"embedding": 0.65, "input": 0.1, "database": 0.2}
    assert time_shares([{**a, "wall_s": 4.0}]) is None  # mostly start-up: nothing to say
    # only this run's workers: an earlier run's summaries (same job) are left out
    assert time_shares([{**a, "started_at": 100.0}, {**b, "started_at": 50.0}], since=90.0) == {
        "embedding": 0.6, "input": 0.1, "database": 0.25}
    assert time_shares([{**a, "started_at": 50.0}], since=90.0) is None
    assert time_shares([]) is None


def test_the_bound_line_names_the_database_or_the_input_only_when_it_stands_out():
    from embedfleet.ingest.bound import bound_line

    db = bound_line({"embedding": 0.7, "input": 0.05, "database": 0.2})
    assert db.startswith("devices' time: 70% embedding, 5% waiting for input, 20% waiting for the database")
    assert "the database is this job's bound" in db and "--dtype half" in db and "--partitions" not in db
    assert "a new table made with --partitions 8" in bound_line({"embedding": 0.7, "input": 0.05, "database": 0.2}, None, True)
    assert "--partitions" not in bound_line({"embedding": 0.9, "input": 0.05, "database": 0.05}, None, True)
    stored_half = bound_line({"embedding": 0.7, "input": 0.05, "database": 0.2}, None, True, stores_half=True)
    assert "the database is this job's bound" in stored_half and "--dtype half" not in stored_half  # has it already
    assert "--partitions 8" in stored_half and stored_half.endswith("a faster disk helps")
    fed = bound_line({"embedding": 0.6, "input": 0.3, "database": 0.02})
    assert "input is this job's bound" in fed and "database is" not in fed
    busy = bound_line({"embedding": 0.95, "input": 0.02, "database": 0.01})
    assert "bound" not in busy


def test_the_bound_line_says_when_the_hypervisor_took_the_hosts_cpu():
    from embedfleet.ingest.bound import bound_line, host_shares, host_ticks

    # /proc/stat's first line: user nice system idle iowait irq softirq steal guest guest_nice
    before = host_ticks("cpu  1000 0 500 8000 100 0 0 400 300 0")
    after = host_ticks("cpu  1600 0 700 8400 100 0 0 600 450 0")  # 1,400 ticks: 400 idle, 200 stolen
    assert (before.busy, before.total, before.stolen) == (1900, 10000, 400)  # guest time is in user already
    host = host_shares(before, after)
    assert host == {"busy": round(1000 / 1400, 3), "stolen": round(200 / 1400, 3)}
    db = bound_line({"embedding": 0.7, "input": 0.05, "database": 0.2}, host)
    assert "the database is this job's bound" in db and "hypervisor took 14% of its CPU" in db
    calm = bound_line({"embedding": 0.7, "input": 0.05, "database": 0.2}, {"busy": 0.6, "stolen": 0.02})
    assert "hypervisor" not in calm
    assert host_shares(None, after) is None and host_shares(after, after) is None
    if os.path.exists("/proc/stat"):  # this machine's own, over a fifth of a second this thread keeps busy
        t0, end = host_ticks(), time.monotonic() + 0.2
        while time.monotonic() < end:
            pass
        live = host_shares(t0, host_ticks())
        assert live is not None and 0 < live["busy"] <= 1 and 0 <= live["stolen"] <= live["busy"]


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="needs Linux's schedstats")
def test_run_queue_seconds_counts_time_ready_without_a_cpu():
    """This thread spins beside two spinning processes per core: it spends much of those 1.5 s ready to
    run while another holds the core, and that shows in its run-queue seconds and its process's."""
    import subprocess
    import sys
    import threading
    import time

    from embedfleet.ingest.bound import run_queue_seconds

    me = threading.get_native_id()
    before, mine = run_queue_seconds(), run_queue_seconds(me)
    spinners = [subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 1.5\nwhile time.time() < t: pass"])
                for _ in range(2 * (os.cpu_count() or 1))]
    until = time.perf_counter() + 1.5
    while time.perf_counter() < until:
        sum(range(1000))
    for p in spinners:
        p.wait()
    assert run_queue_seconds(me) - mine > 0.1
    assert run_queue_seconds() - before >= run_queue_seconds(me) - mine - 0.01  # the process's has its threads'
    assert run_queue_seconds(2**31 - 1) is None  # no such thread


def test_status_watch_counts_a_table_once_in_its_interval(monkeypatch):
    """`status --watch` redraws each second; a sync job's count(*) reads its whole table, so it is reused for a while."""
    from embedfleet.ingest import monitor

    now = [100.0]
    monkeypatch.setattr(monitor.time, "monotonic", lambda: now[0])
    counted: list[str] = []
    count = monitor.counted_every(10.0, lambda conn, table: counted.append(table) or len(counted))
    assert [count("conn", "a"), count("conn", "a"), count("conn", "b")] == [1, 1, 2]
    now[0] += 10.5
    assert count("conn", "a") == 3 and counted == ["a", "b", "a"]
