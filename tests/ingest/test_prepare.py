"""Unit preparation without a database: the hand-back file, stream grouping, the claim throttle,
and a helper's own step (with the bundled model's tokenizer)."""

from __future__ import annotations

import gzip
import os
import time

import numpy as np

from embedfleet.encode.tokenize import Tokenized
from embedfleet.ingest.claim import stream_tasks, task_sizes
from embedfleet.ingest.flow import Throttle
from embedfleet.ingest.prepare import Prepared, helper_count, spool, unspool
from embedfleet.pg.copyin import EncodedRows
from embedfleet.sources.jsonl import block_records
from embedfleet.sources.plan import ChunkSpec
from embedfleet.sources.records import Reject


def test_a_spooled_unit_reads_back_identical_and_its_file_is_gone(tmp_path):
    rows = EncodedRows(b"\x00\x02abc\x00\x02defgh", np.array([0, 5, 12], dtype=np.int64))
    tok = Tokenized(np.arange(7, dtype=np.int32), np.array([4, 3], dtype=np.int32),
                    np.array([1, 0], dtype=np.int64), np.array([1, 0], dtype=np.int64))
    p = Prepared(rows, tok, seen=3, rejects=[Reject("f", 2, "malformed JSON", "{")], cursor_line=9)
    s = spool(p, str(tmp_path))
    assert list(tmp_path.iterdir()) == [tmp_path / s.path.rsplit("/", 1)[1]]
    back = unspool(s)
    assert not list(tmp_path.iterdir())
    assert bytes(back.rows.blob) == rows.blob and back.rows.offsets.tolist() == [0, 5, 12]
    for name in ("ids", "lengths", "order", "inverse"):
        got, want = getattr(back.tok, name), getattr(tok, name)
        assert got.dtype == want.dtype and got.tolist() == want.tolist()
    assert (back.seen, back.rejects, back.cursor_line) == (3, p.rejects, 9)


def test_a_compressed_stream_is_cut_into_blocks_of_whole_lines_the_last_marked(tmp_path):
    lines = [b'{"text": "%s"}' % (b"x" * 40) for _ in range(10)]  # 53 bytes a line with its newline
    path = tmp_path / "s.jsonl.gz"
    path.write_bytes(gzip.compress(b"\n".join(lines) + b"\n"))
    spec = ChunkSpec(str(path), "stream", 0, -1, 1)

    def lines_of(task):
        return [r.line for r in block_records(spec.source, task.first_line, task.block, task.after_line)
                if task.last_line is None or r.line <= task.last_line]

    tasks = list(stream_tasks(spec, after_line=0, last_line=None, sizes=150))
    assert len(tasks) > 2 and all(t.raws is None and t.block for t in tasks)
    assert [n for t in tasks for n in lines_of(t)] == list(range(1, 11))
    assert [t.cursor_line for t in tasks] == [lines_of(t)[-1] for t in tasks]
    assert [t.last for t in tasks] == [False] * (len(tasks) - 1) + [True]
    # resume after line 7, stop at --limit 9
    tasks = list(stream_tasks(spec, after_line=7, last_line=9, sizes=150))
    assert [n for t in tasks for n in lines_of(t)] == [8, 9] and tasks[-1].last and tasks[-1].cursor_line == 9
    # nothing left still yields one task, so the chunk gets marked done
    (t,) = stream_tasks(spec, after_line=10, last_line=None, sizes=150)
    assert t.raws == [] and t.last and t.cursor_line == 10


def test_csv_goes_to_helpers_as_parsed_records_in_groups(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text("id,text\n" + "".join(f"{i},review number {i}\n" for i in range(1, 21)))
    spec = ChunkSpec(str(path), "csv", 0, -1, 1)
    tasks = list(stream_tasks(spec, after_line=0, last_line=None, sizes=200))
    assert len(tasks) > 1 and all(t.block is None for t in tasks)
    assert [r.data["text"] for t in tasks for r in t.raws] == [f"review number {i}" for i in range(1, 21)]
    assert [t.cursor_line for t in tasks] == [t.raws[-1].line for t in tasks] and tasks[-1].last


def test_throttle_follows_whether_the_gpu_waited():
    t = Throttle(8)
    assert t.limit == 18  # every helper busy, as many units ready and two queued
    for _ in range(20):
        t.feedback(False, backlog=1, wait_s=0.0, cycle_s=1.0)  # one unit ready ahead is no backlog
    assert t.limit == 18
    for _ in range(30):
        t.feedback(False, backlog=2, wait_s=0.0, cycle_s=1.0)  # units pile up for a busy GPU: claim less
    assert t.limit == 2
    t.feedback(True, wait_s=0.01, cycle_s=0.1)
    t.feedback(True, wait_s=0.01, cycle_s=0.1)
    assert t.limit == 4
    for _ in range(20):
        t.feedback(True, wait_s=0.05, cycle_s=0.1)
    assert t.limit == 18
    assert 2 < t.mean < 18
    assert Throttle(8, most=5).limit == 5
    inline = Throttle(0)  # no helpers: each unit is prepared when it is needed
    inline.feedback(True)
    assert inline.limit == 0


def test_throttle_keeps_helpers_busy_when_they_are_the_bottleneck():
    """A small model: the GPU loop waits most of the time, and a burst of units finishing together
    must not shrink the window (that idled helpers on the GPU host, bench/NOTES.md runs 16 and 21)."""
    t = Throttle(8)
    for _ in range(50):
        t.feedback(True, backlog=0, wait_s=0.08, cycle_s=0.1)
        for _ in range(8):  # a burst: every helper's unit ready back to back
            t.feedback(False, backlog=2, wait_s=0.0, cycle_s=0.01)
    assert t.limit == 18


def test_prefetch_backlog_counts_the_item_its_producer_holds():
    import threading

    from embedfleet.ingest.flow import Prefetch

    release = threading.Event()

    def gen():
        yield from range(3)
        release.wait(5)

    ahead = Prefetch(gen(), depth=1)
    deadline = time.monotonic() + 5
    while ahead.backlog() < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ahead.backlog() == 2  # 0 queued, 1 held by the producer waiting for room
    items = iter(ahead)
    assert next(items) == 0
    release.set()
    assert list(items) == [1, 2]


def test_a_helper_spools_its_unit_and_falls_back_to_the_pipe_when_it_cannot(tmp_path, monkeypatch):
    from embedfleet.encode.encoder import Encoder
    from embedfleet.ingest import prepare as units
    from embedfleet.synth import write_amazon_reviews

    src = write_amazon_reviews(tmp_path / "r.jsonl", 50)
    ctx = units.PrepareContext("amazon-reviews", None, None, None, Encoder(device="cpu", tokenizer_workers=0).tokenizer_spec())
    prepare = units.Preparer(ctx)
    task = units.Task(ChunkSpec(str(src), "jsonl", 0, src.stat().st_size, 1), 0, None)
    direct = prepare(task)
    assert direct.rows.n == direct.seen == len(direct.tok) == 50 and direct.cursor_line == 50

    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(units, "_HELPER", (prepare, str(shm)))
    out = units._helper_prepare(task)
    assert isinstance(out, units.Spooled)
    back = unspool(out)
    assert bytes(back.rows.blob) == direct.rows.blob and back.tok.ids.tolist() == direct.tok.ids.tolist()

    # No room for the file (a full /dev/shm): the unit comes back whole, through the pipe.
    monkeypatch.setattr(units, "_HELPER", (prepare, str(tmp_path / "missing")))
    out = units._helper_prepare(task)
    assert isinstance(out, Prepared) and out.rows.blob == direct.rows.blob


def test_helpers_per_worker_come_from_its_share_of_the_cores():
    # 32 cores, 2 GPUs: 16 each -> 8 helpers; 16 cores, 2 GPUs: 4 each; a 2-core share: inline
    assert [helper_count(c) for c in (64, 16, 8, 4, 3, 1)] == [8, 8, 4, 2, 0, 0]


def test_helpers_leave_when_their_worker_is_killed(tmp_path):
    """kill -9 of a worker must not leave its helper processes waiting for work forever."""
    import subprocess
    import sys
    import time

    import psutil

    script = tmp_path / "worker.py"
    script.write_text(
        "import os, time, psutil\n"
        "from embedfleet.encode.tokenize import TokenizerSpec\n"
        "from embedfleet.ingest.prepare import PrepareContext, UnitPool\n"
        "from embedfleet.encode.models import resolve_model\n"
        "if __name__ == '__main__':\n"
        "    tok = (resolve_model(None) / 'tokenizer.json').read_text()\n"
        "    pool = UnitPool(PrepareContext('generic', None, 'text', None, TokenizerSpec(tok, 128)), 2)\n"
        "    pool.start()\n"
        "    print(*[c.pid for c in psutil.Process().children()], flush=True)\n"
        "    time.sleep(600)\n"
    )
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pids = [int(x) for x in p.stdout.readline().split()]
    assert len(pids) >= 2
    p.kill()
    p.wait()

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.time() + 15
    while any(alive(pid) for pid in pids) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in pids)


def test_helpers_start_in_the_background_with_the_encoders_own_tokenizer(tmp_path):
    """A worker starts its helpers before torch and the model load: from a tokenizer spec read without
    the weights, which must be exactly the encoder's (prompt included), and the start reports its time."""
    from embedfleet.encode.encoder import Encoder
    from embedfleet.encode.tokenize import tokenizer_spec
    from embedfleet.ingest import prepare as units
    from embedfleet.synth import write_amazon_reviews

    spec = tokenizer_spec(None, "query: ")
    assert spec == Encoder(device="cpu", tokenizer_workers=0).tokenizer_spec("query: ")
    src = write_amazon_reviews(tmp_path / "r.jsonl", 30)
    pool = units.UnitPool(units.PrepareContext("amazon-reviews", None, None, None, spec), 2)
    try:
        started = pool.start_in_background()
        assert started.result(timeout=120) > 0
        task = units.Task(ChunkSpec(str(src), "jsonl", 0, src.stat().st_size, 1), 0, None)
        out = pool.result(pool.submit(task))
        assert out.rows.n == 30 and len(out.tok) == 30
    finally:
        pool.close()


def test_a_workers_helpers_run_at_the_priority_its_settings_give_them():
    """EMBEDFLEET_HELPER_NICE: a worker's helpers run that much below it in the CPU's queue, so on a
    short host the database's backends and the GPU's loop are served first; 0 keeps them level."""
    import psutil

    from embedfleet.encode.tokenize import tokenizer_spec
    from embedfleet.ingest import prepare as units

    ours = os.nice(0)
    ctx = units.PrepareContext("generic", None, "text", None, tokenizer_spec(None))
    for nice in (7, 0):  # Settings.helper_nice, as the worker hands it to its pool
        pool = units.UnitPool(ctx, 2, nice)
        try:
            pool.start()
            assert [psutil.Process(p).nice() for p in pool._pool.pids] == [min(19, ours + nice)] * 2
        finally:
            pool.close()


def test_a_tokenizer_spec_needs_no_torch():
    """So helpers can start while the worker is still importing torch."""
    import subprocess
    import sys

    code = ("import sys; from embedfleet.encode.tokenize import tokenizer_spec; tokenizer_spec(None); "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_throttle_keeps_enough_in_preparation_for_units_slower_to_prepare_than_to_embed():
    """Passages of long documents: a unit takes a helper 0.48 s and the GPU 0.05 s. Even with the GPU the
    bottleneck and units queued for it, the limit stays at the 11 the GPU uses up while one is
    prepared (Little's law: 9.6, up to 10, plus one), not two. Cycles that embedded nothing (a
    failure, a skipped unit) do not count as the GPU's time a unit."""
    t = Throttle(14)
    for _ in range(100):
        t.prepared(0.48)
        t.feedback(False, backlog=3, wait_s=0.0, cycle_s=0.05)
        t.feedback(False, backlog=3, wait_s=0.0, cycle_s=0.0001, embedded=False)
    assert t.floor == 11 and t.limit == 11
    quick = Throttle(14)  # reviews: units quicker to prepare than to embed shrink to two, as before
    for _ in range(100):
        quick.prepared(0.01)
        quick.feedback(False, backlog=3, wait_s=0.0, cycle_s=0.05)
    assert quick.limit == 2


def test_a_streams_first_tasks_start_small_and_grow(tmp_path):
    """`task_sizes`: the first task is about that big, each next one `growth` times the last, up to
    chunk_bytes; the tasks still hold every row once, in order."""
    path = tmp_path / "r.csv"
    path.write_text("id,text\n" + "".join(f"{i},review number {i:04d} {'x' * 30}\n" for i in range(1, 401)))
    spec = ChunkSpec(str(path), "csv", 0, -1, 1)
    tasks = list(stream_tasks(spec, after_line=0, last_line=None, sizes=task_sizes(3200, 400, growth=2)))
    sizes = [sum(len(r.raw) + 1 for r in t.raws) for t in tasks]
    assert [n for t in tasks for n in (r.line for r in t.raws)] == list(range(2, 402))  # the header is line 1
    assert sizes[0] < 500 and 800 <= sizes[1] < 900 and 1600 <= sizes[2] < 1700
    assert all(3200 <= s < 3300 for s in sizes[3:-1])


def test_a_compressed_streams_first_blocks_start_small_also_on_resume(tmp_path):
    """The same ramp for a .jsonl.gz read as blocks of lines; blocks skipped on resume take none of it."""
    import gzip

    path = tmp_path / "r.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(f'{{"id": "{i}", "text": "review number {i:04d} {"x" * 30}"}}\n' for i in range(1, 401))
    spec = ChunkSpec(str(path), "stream", 0, -1, 1)
    for after in (0, 200):
        tasks = list(stream_tasks(spec, after_line=after, last_line=None, sizes=task_sizes(3200, 400, growth=2)))
        sizes = [len(t.block) for t in tasks]
        assert tasks[0].first_line <= after + 1 and tasks[-1].last
        assert sizes[0] < 500 and 700 <= sizes[1] < 900 and 1500 <= sizes[2] < 1700, (after, sizes[:4])


def test_by_tenth_says_where_in_the_loop_the_waits_were():
    from embedfleet.ingest.flow import by_tenth

    waits = [(0.0, 0.5), (0.05, 0.1), (4.99, 0.2), (9.5, 0.3), (10.0, 0.05)]  # the last: at the very end
    assert by_tenth(waits, 10.0) == [0.6, 0.0, 0.0, 0.0, 0.2, 0.0, 0.0, 0.0, 0.0, 0.35]
    assert by_tenth(waits, 10.0, parts=2) == [0.8, 0.35]
    assert by_tenth([], 0.0) == [0.0] * 10 and by_tenth([(0.0, 0.2)], 0.0) == [0.2] + [0.0] * 9


def test_task_sizes_grow_gently_from_a_small_first_task_to_a_full_unit():
    from itertools import islice

    from embedfleet.ingest.claim import FIRST_TASK_BYTES, RAMP

    sizes = list(islice(task_sizes(2 << 20), 200))
    assert sizes[0] == FIRST_TASK_BYTES and sizes[-1] == 2 << 20
    ramp = sizes[: sizes.index(2 << 20)]
    assert len(ramp) > 50 and all(b > a and b <= a * RAMP + 1 for a, b in zip(ramp, ramp[1:]))
    assert set(sizes[len(ramp):]) == {2 << 20}
    assert list(islice(task_sizes(3200, None), 3)) == [3200] * 3


def test_a_workers_ramp_goes_on_across_its_chunks(tmp_path):
    """One sizes iterator shared by two chunks (as a worker's claims share it): the second chunk's first
    task continues the ramp, it does not start small again."""
    path = tmp_path / "r.csv"
    path.write_text("id,text\n" + "".join(f"{i},review number {i:04d} {'x' * 30}\n" for i in range(1, 401)))
    sizes = task_sizes(3200, 100, growth=1.2)
    first = list(stream_tasks(ChunkSpec(str(path), "csv", 0, -1, 2), 0, 200, sizes))
    second = list(stream_tasks(ChunkSpec(str(path), "csv", 0, -1, 2), 200, None, sizes))
    measure = [sum(len(r.raw) + 1 for r in t.raws) for t in first + second]
    assert [r.line for t in first + second for r in t.raws] == list(range(2, 402))  # the header is line 1
    assert measure[len(first)] > max(measure[: len(first) - 1])  # the first chunk's last task may be short
    assert measure[0] < 200 and max(measure) >= 3200


def _csv_units(tmp_path, hungry):
    """The prepare stage over one CSV chunk's 20 tasks, prepared inline: how many tasks had been read from
    the claim stage when the first unit came out, and the units' rows in order."""
    import uuid

    from embedfleet.encode.tokenize import tokenizer_spec
    from embedfleet.ingest.prepare import PrepareContext, PrepareStage, UnitPool
    from embedfleet.ledger import Claim

    path = tmp_path / "r.csv"
    path.write_text("id,text\n" + "".join(f"{i},review number {i}\n" for i in range(1, 201)))
    spec = ChunkSpec(str(path), "csv", 0, -1, 2)
    claim = Claim("j", 1, str(path), "csv", 0, -1, 2, None, 0, uuid.uuid4())
    pulled, started = [0], []

    def tasks():
        for task in stream_tasks(spec, 0, None, 200):
            pulled[0] += 1
            task.claim = claim
            yield task

    pool = UnitPool(PrepareContext("generic", None, "text", "id", tokenizer_spec(None)), workers=0)
    throttle = Throttle(8)  # room for 18 tasks ahead
    units, first_at = [], None
    for unit in PrepareStage(pool, throttle, started.append, hungry=hungry)(tasks()):
        first_at = pulled[0] if first_at is None else first_at
        units.append(unit)
    return first_at, units, started


def test_a_prepared_unit_goes_to_a_hungry_gpu_loop_before_the_window_fills(tmp_path):
    first_at, units, started = _csv_units(tmp_path, hungry=lambda: True)
    assert first_at == 1
    full_at, full_units, _ = _csv_units(tmp_path, hungry=lambda: False)
    assert full_at == Throttle(8).limit + 1  # not hungry: units wait for the window to fill, as before
    rows = [[bytes(u.rows.blob)] for u in units]
    assert rows == [[bytes(u.rows.blob)] for u in full_units] and sum(u.rows.n for u in units) == 200
    assert len(started) == 1 and [u.last for u in units] == [False] * (len(units) - 1) + [True]


def test_a_preparer_builds_its_word_path_at_start_not_in_the_first_unit(tmp_path):
    """A helper's first unit is one the GPU waits for: the word path (trie and tables, the costly part
    of that unit) is built when the helper starts; the unit then uses it and gives the library's ids."""
    from embedfleet.encode.tokenize import tokenizer_spec
    from embedfleet.ingest import prepare as units
    from embedfleet.sources import read_chunk
    from embedfleet.sources.presets import get_preset
    from embedfleet.sources.records import to_records
    from embedfleet.synth import write_amazon_reviews

    spec = tokenizer_spec(None)
    prepare = units.Preparer(units.PrepareContext("amazon-reviews", None, None, None, spec))
    local = prepare.tokenizer._local
    assert local.words is not None and local._word_args is None  # built in the constructor
    words, calls = local.words, []
    encode = words.encode
    words.encode = lambda *a, **k: calls.append(1) or encode(*a, **k)  # instance attribute: counts its uses
    src = write_amazon_reviews(tmp_path / "r.jsonl", 100)  # a unit big enough for the word path
    out = prepare(units.Task(ChunkSpec(str(src), "jsonl", 0, src.stat().st_size, 1), 0, None))
    assert prepare.tokenizer._local.words is words and calls  # the table built at start, used, not rebuilt
    assert out.rows.n == 100 and len(out.tok) == 100
    texts = [r.content for r in to_records(list(read_chunk(ChunkSpec(str(src), "jsonl", 0, src.stat().st_size, 1))),
                                           get_preset("amazon-reviews"))[0]]
    library = spec.build(shortcuts=False).tokenize(texts)  # the tokenizers library's own path
    assert np.array_equal(out.tok.ids, library.ids) and np.array_equal(out.tok.order, library.order)
