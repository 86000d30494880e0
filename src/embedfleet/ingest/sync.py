"""`embedfleet sync`: a target table made equal to its source table, and kept so.

    install the queue (once) ─► backfill: an ingest job like any other ─► drain: batch after batch,
    claim queued keys (SKIP LOCKED) → read their rows as they are now → embed the rows whose text changed →
    upsert them, delete the rows that are gone → forget the claimed keys; with --follow, wait on the queue's
    channel when it is empty

The queue is installed before the backfill's snapshot is taken, so a change made while the backfill runs is
queued: the drain finds it, and a row the backfill already embedded as it is now costs a comparison, not an
embedding. Where the queue and the target share a database, a batch's rows and the deletion of its keys commit
in one transaction; across databases the target commits first, and a batch repeated after a crash changes
nothing (each write is the row as it is now).
"""

from __future__ import annotations

import hashlib
import logging
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import orjson
import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from embedfleet.errors import InputError
from embedfleet.ingest.commit import TableSink
from embedfleet.ingest.prepare import PrepareContext, Preparer
from embedfleet.ledger import Ledger, job_for_table, sync_overview, syncs_into
from embedfleet.pg import queue
from embedfleet.pg.connect import connect
from embedfleet.pg.copyin import assemble, vector_fields
from embedfleet.pg.ddl import embedding_info, join_name, qualified, table_exists, table_sql
from embedfleet.pg.scan import filter_names, user_filter
from embedfleet.settings import JobSpec, Settings
from embedfleet.sources.base import RawRecord
from embedfleet.sources.presets import table_columns
from embedfleet.sources.table import (alias_of, describe, key_line, key_text, read_rows, source_loaders,
                                     text_copies)

__all__ = ["SyncStats", "Syncer", "watched_columns", "stop_on_signals"]

log = logging.getLogger("embedfleet.sync")

BATCH_KEYS = 256  # keys a batch claims: a change waits for the whole batch it is in (docs/decisions/sync-queue.md)
LONG_QUEUE_BATCHES = 8  # where each claim's scan of a long queue is slow, batches grow to this many times as many keys
POLL_S = 0.2  # how often a follower looks at an empty queue: the trigger sends no NOTIFY (its cost)


@dataclass
class SyncStats:
    batches: int = 0
    keys: int = 0  # queued keys claimed (one key queued twice counts twice)
    embedded: int = 0  # rows whose text changed, embedded and written
    unchanged: int = 0  # rows whose text was the same: not embedded (their copied columns updated if changed)
    deleted: int = 0  # target rows of keys whose source row is gone (or filtered out, or now rejected)
    rejected: int = 0  # source rows that give no text (NULL, empty): their target rows are deleted
    tokens: int = 0
    # seconds the lanes spent, summed: where a drain's time goes (claim + lock + read + embed + write + commit)
    claim_s: float = 0.0  # claiming queued keys
    lock_s: float = 0.0  # waiting for another lane's keys
    read_s: float = 0.0  # the source rows, and the target's stored content
    embed_s: float = 0.0  # preparing and embedding the changed rows (the device shared by the lanes)
    write_s: float = 0.0  # upserts, updates and deletes in the target (its index)
    commit_s: float = 0.0  # forgetting the keys and committing

    def as_dict(self) -> dict:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}


def next_batch_size(size: int, claimed: int, claim_s: float, work_s: float, batch: int) -> int:
    """The keys a lane's next claim takes: `batch`, or more after a full claim whose scan of the queue (it has no
    index: the trigger's cost) took over a tenth of the batch's work, as in a long backlog of unchanged rows: then
    enough for the scans to stay a tenth, up to LONG_QUEUE_BATCHES × `batch`. Batches never shrink below `batch`:
    a smaller one embeds more versions of a row that keeps changing, more work where work is already behind."""
    if claimed < size or 10 * claim_s <= work_s:
        return batch
    return min(LONG_QUEUE_BATCHES * batch, max(batch, int(10 * claim_s * claimed / max(work_s, 1e-6))))


def watched_columns(spec: JobSpec, source_columns=()) -> list[str]:
    """The source columns whose UPDATE can change a target row: the text's, the copied ones, and those of
    `source_columns` that --where names (a row moving in or out of the filter is a change too)."""
    from embedfleet.sources.records import template_fields

    text = template_fields(spec.text_template) if spec.text_template else [spec.text_field]
    copied = [c.split(":")[0] for c in spec.columns or ()]
    named = filter_names(spec.where) if spec.where else set()
    filtered = [c for c in source_columns if c in named]
    # a template's `{meta.lang}` reads column meta, and `{a.b}` column "a.b" where the source has one
    return list(dict.fromkeys(c if c in source_columns else c.split(".")[0] for c in [*text, *copied, *filtered] if c))


class _ReadFailed(Exception):
    """A lane's read of the source named a column or table that is not there: told apart once rolled back."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


def column_gone_error(source: str, column: str) -> InputError:
    """A column sync reads, dropped or renamed under a follower: its queue is kept, nothing of it drained."""
    return InputError(f"sync: column {column!r} of {source}, which sync reads, was dropped or renamed while "
                      "following; its queue is kept: put the column back and rerun sync, or sync the columns the "
                      "table has now into a new --table")


def source_gone_error(source: str, q: queue.Queue, why: str = "") -> InputError:
    """A source dropped or renamed under a follower: what is kept, and the two ways on."""
    return InputError(f"sync: the source {source} was dropped or renamed while following{f' ({why})' if why else ''}; "
                      f"its queue {q.table_name} is kept: rename the table back and rerun sync to go on from there, "
                      f"or `sync --from-table {source} --uninstall` (its target stays) and sync the table by its name "
                      "now into a new target")


class Lane:
    """One connection's drain: a batch claimed, its keys locked, read, embedded (on the shared encoder), written
    and forgotten, in one transaction. Lanes run side by side so the target's index takes rows on several
    backends at once. Each lane claims only its share of the keys (by hash): a key changed twice is written in
    order by one lane, and no lane waits for another's batch; the per-key locks still order a key between two
    sync processes."""

    def __init__(self, spec: JobSpec, settings: Settings, dsn: str, source_dsn: str, encoder, gpu: threading.Lock,
                 stats: SyncStats, stats_lock: threading.Lock, batch: int, part: int = 0, parts: int = 1):
        from embedfleet.encode.tokenize import tokenizer_spec

        self.spec, self.encoder, self.gpu, self.batch = spec, encoder, gpu, batch
        self.size = batch  # the next claim's keys (next_batch_size)
        self.part, self.parts = part, parts
        self.stats, self.stats_lock = stats, stats_lock
        self.target, self.source_dsn = connect(dsn), source_dsn
        self.same_db = source_dsn == dsn
        self.source = self.target if self.same_db else connect(source_dsn, what="--source-db / EMBEDFLEET_SOURCE_DB")
        source = describe(self.source, spec.source_table)
        source_loaders(self.source, source.name)
        self.source_name, self.key_type = source.name, source.typmods[spec.id_field]  # character(8), not char(1)
        self.queue = queue.queue_for(source.name, spec.id_field, spec.job)
        self.watched = watched_columns(spec, source.columns)
        self.lock_space = int(self.queue.tag[:7], 16)  # the per-key advisory locks' first key: this job's
        self.prep = Preparer(PrepareContext(
            spec.preset, spec.text_template, spec.text_field, spec.id_field,
            tokenizer_spec(spec.model, spec.prompt, word_cache=settings.word_cache, default_model=settings.model),
            columns=spec.columns))
        columns = table_columns(spec.preset, False, spec.columns)
        self.columns = [c.name for c in columns]
        self.jsonb = {c.name for c in columns if c.pgtype == "jsonb"}  # psycopg sends a dict or list only wrapped
        self.vtype = embedding_info(self.target, spec.table)[0]
        self.sink = TableSink(self.target, spec.table, columns, self.vtype, spec.job)

    def close(self) -> None:
        self.prep.close()
        if not self.same_db:
            self.source.close()
        self.target.close()

    def step(self) -> int:
        """Claim a batch of queued keys and bring their target rows up to date. Returns the keys claimed."""
        local = SyncStats()
        t0 = time.perf_counter()
        try:
            with self.source.transaction():
                entries = queue.claim(self.source, self.queue, self.size, self.part, self.parts)
                if not entries:
                    return 0
                local.claim_s = time.perf_counter() - t0
                keys = list(dict.fromkeys(k for _, k in entries if k is not None))
                truncated = any(k is None for _, k in entries)  # a NULL key: the source was truncated
                if self.same_db:
                    self._locked_write(keys, truncated, local)
                else:
                    with self.target.transaction():
                        self._locked_write(keys, truncated, local)
                t1 = time.perf_counter()
                queue.forget(self.source, self.queue, [ctid for ctid, _ in entries])
        except _ReadFailed as e:  # rolled back: the catalog says what is gone (the error's words follow the server's language)
            self.check_following()
            raise source_gone_error(self.source_name, self.queue, e.why) from None
        local.commit_s += time.perf_counter() - t1
        local.batches, local.keys = 1, len(entries)
        self.size = next_batch_size(self.size, len(entries), local.claim_s,
                                    time.perf_counter() - t0 - local.claim_s, self.batch)
        with self.stats_lock:
            for name, value in asdict(local).items():
                setattr(self.stats, name, getattr(self.stats, name) + value)
        return len(entries)

    def _locked_write(self, keys: list[str], truncated: bool, stats: SyncStats) -> None:
        t0 = time.perf_counter()
        self._lock(keys)
        t1 = time.perf_counter()
        raws = self._read(keys)
        stats.lock_s, stats.read_s = t1 - t0, time.perf_counter() - t1
        self._write(keys, raws, truncated, stats)

    def _lock(self, keys: list[str]) -> None:
        """Each key's advisory lock on the target's connection until its commit, taken in one order by every
        lane (no deadlock): another lane holding one of them is waited for, then its rows are read as it left them."""
        hashes = sorted({int.from_bytes(hashlib.blake2b(k.encode(), digest_size=4).digest(), "big", signed=True)
                         for k in keys})
        self.target.execute("SELECT count(pg_advisory_xact_lock(%s, h)) FROM unnest(%s::int[]) AS h",
                            [self.lock_space, hashes])

    def _read(self, keys: list[str]) -> list[RawRecord]:
        """The keys' source rows as they are now (those --where leaves out are as good as gone)."""
        if not keys:
            return []
        key = self.spec.id_field
        cond = sql.SQL("{} = ANY(%s::{}[])").format(sql.Identifier(key), sql.SQL(self.key_type))
        if self.spec.where:
            cond = sql.SQL("{} AND {}").format(cond, user_filter(self.spec.where, placeholders=True))
        try:
            with self.source.cursor() as cur:
                names, rows = read_rows(cur, sql.SQL("SELECT {}, *{} FROM {} AS {} WHERE {}").format(
                    key_text(key), text_copies(self.spec.columns), sql.SQL(self.source_name),
                    sql.SQL(alias_of(self.source_name)), cond), key, [keys])
        except (psycopg.errors.UndefinedColumn, psycopg.errors.UndefinedTable) as e:  # a column or the table gone
            raise _ReadFailed(str(e).splitlines()[0]) from None
        if gone := [c for c in self.watched if c not in names]:  # before anything is written: the batch rolls back
            raise column_gone_error(self.source_name, gone[0])
        key_at = names.index(key)
        return [RawRecord(self.source_name, key_line(row[key_at], self.key_type), dict(zip(names, row)),
                          orjson.dumps(dict(zip(names, row)), default=str).decode(), None) for row in rows]

    def _write(self, keys: list[str], raws: list[RawRecord], truncated: bool, stats: SyncStats) -> None:
        conn, target = self.target, table_sql(self.target, self.spec.table)
        t0 = time.perf_counter()
        records, rejects = self.prep.records(raws)
        stats.rejected += len(rejects)
        self._record_rejects(keys, rejects)
        present = {r.id for r in records}
        stored = {row[0]: row[1:] for row in conn.execute(
            sql.SQL("SELECT id, content{} FROM {} WHERE id = ANY(%s)").format(
                sql.SQL("").join(sql.SQL(", {}").format(sql.Identifier(c)) for c in self.columns), target),
            [[r.id for r in records]]).fetchall()}
        stats.read_s += time.perf_counter() - t0
        changed, recolumned = [], []
        for r in records:
            old = stored.get(r.id)
            if old is None or old[0] != r.content:
                changed.append(r)
            else:
                stats.unchanged += 1
                values = tuple(r.values.get(c) for c in self.columns)
                if values != tuple(old[1:]):
                    recolumned.append((*(Jsonb(v) if c in self.jsonb and v is not None else v
                                         for c, v in zip(self.columns, values)), r.id))
        t1 = time.perf_counter()
        if changed:
            p = self.prep.prepare(changed, [], 0)
            with self.gpu:
                vectors = self.encoder.embed(p.tok)
            data = assemble(p.rows, vector_fields(vectors, self.vtype))
            t2 = time.perf_counter()
            stats.embed_s += t2 - t1
            t1 = t2
            # rows that exist go through the upsert at once: a direct COPY would insert (and index) rows
            # before failing on the first of them
            self.sink.insert(data, p.rows.n, direct=not any(r.id in stored for r in changed))
            stats.embedded += p.rows.n
            stats.tokens += int(p.tok.num_tokens)
        if recolumned:
            sets = sql.SQL(", ").join(sql.SQL("{} = %s").format(sql.Identifier(c)) for c in self.columns)
            with conn.cursor() as cur:
                cur.executemany(sql.SQL("UPDATE {} SET {} WHERE id = %s").format(target, sets), recolumned)
        gone = [k for k in keys if k not in present]
        if gone:
            stats.deleted += conn.execute(sql.SQL("DELETE FROM {} WHERE id = ANY(%s)").format(target),
                                          [gone]).rowcount
        if truncated:
            stats.deleted += self._delete_missing(target)
        stats.write_s += time.perf_counter() - t1

    def _record_rejects(self, keys: list[str], rejects: list) -> None:
        """The batch's rejects kept for `jobs rejects`, one per key; a key written or deleted now has none."""
        with self.target.cursor() as cur:
            cur.execute("DELETE FROM embedfleet.rejects WHERE job = %s AND source = %s AND line = ANY(%s)",
                        [self.spec.job, self.source_name, [key_line(k, self.key_type) for k in keys]])
            cur.executemany("INSERT INTO embedfleet.rejects (job, source, line, reason, raw) VALUES (%s, %s, %s, %s, %s)",
                            [(self.spec.job, r.source, r.line, r.reason, r.raw) for r in rejects])

    def _delete_missing(self, target: sql.Composable) -> int:
        """After a TRUNCATE: every target row whose source row is not there now."""
        key = sql.Identifier(self.spec.id_field)
        where = sql.SQL(" AND {}").format(user_filter(self.spec.where)) if self.spec.where else sql.SQL("")
        if self.same_db:
            return self.target.execute(sql.SQL(
                "DELETE FROM {t} AS embedfleet_target WHERE NOT EXISTS (SELECT 1 FROM {s} AS {a} "
                "WHERE {k}::text = embedfleet_target.id{w})").format(
                    t=target, s=sql.SQL(self.source_name), a=sql.SQL(alias_of(self.source_name)), k=key,
                    w=where)).rowcount
        alive = {k for (k,) in self.source.execute(sql.SQL("SELECT {}::text FROM {} AS {} WHERE true{}").format(
            key, sql.SQL(self.source_name), sql.SQL(alias_of(self.source_name)), where))}
        ids = [i for (i,) in self.target.execute(sql.SQL("SELECT id FROM {}").format(target)) if i not in alive]
        return self.target.execute(sql.SQL("DELETE FROM {} WHERE id = ANY(%s)").format(target), [ids]).rowcount

    def check_following(self) -> None:
        """An InputError if following cannot go on: the source gone, its trigger dropped, a column it reads gone."""
        source, installed, gone, renamed = queue.following(self.source, self.queue, self.watched)
        if not source:
            raise source_gone_error(self.source_name, self.queue)
        if renamed:  # remade on a connection of its own: a lane's may be inside its own transaction now
            with connect(self.source_dsn, what="--source-db / EMBEDFLEET_SOURCE_DB") as own:
                queue.follow_key(own, self.queue, renamed, self.watched)
        if renamed and renamed != self.queue.key:
            raise InputError(f"sync: the key column {self.queue.key!r} of {self.source_name} was renamed {renamed!r} "
                             f"while following; the trigger now reads {renamed!r}, so the application's writes go on "
                             "and are queued: rename it back and rerun sync at once (the trigger reads the new name "
                             "until then), or `sync --uninstall` and sync into a new --table")
        if not installed:
            raise InputError(f"sync: the trigger that queues {self.source_name}'s changes was dropped while following "
                             "(by `sync --uninstall`, by hand, or with its key by CASCADE): to follow it again, rerun "
                             "sync, which makes it again and compares every row once")
        if gone:
            raise column_gone_error(self.source_name, gone[0])


class Syncer:
    """Drains one sync job's queue on one device with `lanes` connections side by side: `step()` is one batch on
    the first lane; `run(ledger, follow, stop)` batches until the queue is empty (following, until `stop`)."""

    def __init__(self, spec: JobSpec, settings: Settings, dsn: str, source_dsn: str, device: str,
                 batch: int = BATCH_KEYS, encoder=None, lanes: int = 1):
        from embedfleet.ingest.worker import load_encoder

        self.spec, self.source_dsn = spec, source_dsn
        self.encoder = encoder or load_encoder(spec, device, settings)
        self.stats, gpu, stats_lock = SyncStats(), threading.Lock(), threading.Lock()
        self.lanes: list[Lane] = []
        try:
            n = max(1, lanes)
            for i in range(n):
                self.lanes.append(Lane(spec, settings, dsn, source_dsn, self.encoder, gpu, self.stats, stats_lock,
                                       batch, i, n))
        except BaseException:
            self.close()
            raise
        self.queue = self.lanes[0].queue
        self._wake = threading.Condition()

    def close(self) -> None:
        for lane in self.lanes:
            lane.close()
        close = getattr(self.encoder, "close", None)
        if close is not None:
            close()

    def step(self) -> int:
        return self.lanes[0].step()

    def requeue_after_restart(self, ledger: Ledger) -> int:
        """The queue is unlogged: if the source's server started again since it was last known (it may have
        crashed and emptied the queue), every key of the source is queued once. Returns the keys queued."""
        lane = self.lanes[0]
        if not ledger.source_restarted(self.spec.job, queue.server_started(lane.source)):
            return 0
        n = queue.requeue_all(lane.source, self.queue)
        log.warning("sync: the server of %s started again since its queue was last seen (a crash empties it): "
                    "all %d keys queued once, to compare", lane.source_name, n)
        return n

    def run(self, ledger: Ledger, follow: bool = False, stop: threading.Event | None = None) -> SyncStats:
        """Batches on every lane until the queue is empty; following, until `stop` is set, an idle lane looking
        again every POLL_S (at once on a NOTIFY on the queue's channel). Each lane commits the batch in hand
        before it stops; the first error stops them all and is raised here."""
        stop = stop or threading.Event()
        idle = [False] * len(self.lanes)
        errors: list[BaseException] = []

        def drain(i: int, lane: Lane) -> None:
            try:
                while not stop.is_set():
                    if lane.step():
                        idle[i] = False
                        continue
                    idle[i] = True
                    if not follow:
                        return
                    with self._wake:
                        self._wake.wait(POLL_S)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                errors.append(e)
                stop.set()

        self.requeue_after_restart(ledger)
        threads = [threading.Thread(target=drain, args=(i, lane), name=f"embedfleet-sync-{i}", daemon=True)
                   for i, lane in enumerate(self.lanes)]
        listener = None
        if follow:
            listener = connect(self.source_dsn, what="--source-db / EMBEDFLEET_SOURCE_DB")
            listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.queue.channel)))
        for t in threads:
            t.start()
        try:
            marked = 0.0
            while any(t.is_alive() for t in threads):
                if follow:
                    for _ in listener.notifies(timeout=POLL_S, stop_after=1):
                        with self._wake:
                            self._wake.notify_all()
                    if all(idle) and time.monotonic() - marked > 1.0:
                        self.lanes[0].check_following()
                        if not self.requeue_after_restart(ledger):
                            ledger.synced(self.spec.job)
                        marked = time.monotonic()
                else:
                    for t in threads:
                        t.join(0.5)
        except BaseException:
            stop.set()
            raise
        finally:
            for t in threads:
                t.join()
            if listener is not None:
                listener.close()
        if errors:
            raise errors[0]
        ledger.synced(self.spec.job)
        return self.stats


@contextmanager
def stop_on_signals():
    """An event SIGINT and SIGTERM set (instead of ending the process): the batch in hand commits first."""
    stop = threading.Event()
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in previous:
        signal.signal(s, lambda signum, frame: stop.set())
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# Key types whose text is the same in every session: the trigger's `key::text` matches the ids sync writes.
SYNC_KEYS = ("smallint", "integer", "bigint", "numeric", "text", "character varying", "character", "uuid", "citext",
             "name")


def default_lanes() -> int:
    """Half the cores, at most 8: the target's index takes rows on that many backends at once."""
    import os

    return max(1, min(8, (os.cpu_count() or 2) // 2))


# Keys whose text the application's session writes its own way (the queue's key::text is written in it)
SESSION_TEXT = {"timestamp with time zone": "TimeZone and DateStyle", "timestamp without time zone": "DateStyle",
                "date": "DateStyle", "real": "extra_float_digits", "double precision": "extra_float_digits",
                "interval": "IntervalStyle", "money": "lc_monetary", "bytea": "bytea_output"}


def check_sync_key(conn: psycopg.Connection, source, key: str, given: bool) -> None:
    """One line where `key` cannot be a sync's: its text written by the application's session would differ from
    sync's own (SESSION_TEXT), or it is of a type sync does not compare keys of. An enum, a boolean and a domain
    over a type that can be are taken."""
    base, enum = conn.execute(
        "SELECT format_type(CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE t.oid END, NULL), "
        "(SELECT b.typtype FROM pg_type b WHERE b.oid = CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE t.oid END) "
        "= 'e' FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid WHERE a.attrelid = %s::regclass "
        "AND a.attname = %s", [source.name, key]).fetchone()
    if base in SYNC_KEYS or base == "boolean" or enum:
        return
    named = f"--id-field {key!r}: {source.name}.{key}" if given else f"{source.name}'s key {key}"
    shown = source.columns[key] + (f" (a domain over {base})" if base != source.columns[key] else "")
    why = (f"whose text depends on the session writing it (its {SESSION_TEXT[base]})" if base in SESSION_TEXT
           else "whose values sync does not compare as keys")
    raise InputError(f"{named} is {shown}, {why}: sync needs a key of {', '.join(SYNC_KEYS[:-3])}, uuid, boolean "
                     "or an enum; name one with --id-field (`ingest --from-table` takes any key)")


def installed_on(source_dsn: str, table: str) -> str | None:
    """The source table's name where sync's triggers are on it, else None (or where it cannot be looked at)."""
    try:
        with psycopg.connect(source_dsn, autocommit=True, connect_timeout=10) as src:
            row = src.execute("SELECT format('%%I.%%I', n.nspname, c.relname) FROM pg_trigger t JOIN pg_class c ON "
                              "c.oid = t.tgrelid JOIN pg_namespace n ON n.oid = c.relnamespace WHERE t.tgrelid = "
                              "to_regclass(%s) AND t.tgname LIKE 'embedfleet\\_%%' LIMIT 1", [table]).fetchone()
    except psycopg.Error:
        return None
    return row[0] if row else None


def run_sync(spec: JobSpec, settings: Settings, launcher, device: str, follow: bool = False,
             stop: threading.Event | None = None, batch: int | None = None, lanes: int | None = None) -> dict:
    """The whole of `embedfleet sync`: check, install the queue (once), backfill (an ingest job: resumed, or
    nothing left), then drain the queue (and follow it). Returns the summary: the job, its table, the backfill's
    rows, the drain's counts, and the queue's state at the end."""
    from embedfleet.ingest.job import check_job, run_job, source_dsn
    from embedfleet.pg.ddl import ensure_table, finish_table, vector_type
    from embedfleet.pg.embedded import resolve_dsn

    dsn = resolve_dsn(spec.db, settings)
    src_dsn = source_dsn(spec, settings)
    with connect(dsn) as conn:
        try:
            cfg = check_job(spec, conn, settings)
        except InputError as e:  # a source changed under an installed sync (its key dropped): say how to stop it
            if leftover := installed_on(src_dsn, spec.source_table):
                raise InputError(f"{e}; sync's triggers are still on {leftover} (its changes are still queued): "
                                 f"`embedfleet sync --from-table {leftover} --uninstall` removes them") from None
            raise
        existed = table_exists(conn, cfg.table)
        recorded = check_rerun(conn, cfg, settings)
        target_db = queue.database_identity(conn)
    q = queue.queue_for(cfg.source_table, cfg.id_field, cfg.job)
    with connect(src_dsn, what="--source-db / EMBEDFLEET_SOURCE_DB") as src:
        source_db = queue.database_identity(src)
        if recorded and recorded.get("source_db") not in (None, source_db):
            raise InputError(f"sync job {cfg.job!r} follows {recorded['source']} in another database than the one "
                             f"--source-db names now ({recorded['source_db'].split('/', 1)[1]} then, "
                             f"{source_db.split('/', 1)[1]} now); to follow this one, pass --job NEWNAME --table NEWTABLE")
        source = describe(src, cfg.source_table)
        check_sync_key(src, source, cfg.id_field, given=spec.id_field is not None)
        if cfg.id_field not in source.unique:  # two rows of one id would be one target row, now one text, now another
            raise InputError(f"--id-field {cfg.id_field!r}: sync keeps one target row per id, and nothing keeps "
                             f"{source.name}.{cfg.id_field} unique; name a column its primary key or a unique "
                             f"index holds, or add one: CREATE UNIQUE INDEX ON {source.name} ({cfg.id_field})")
        made = queue.install(src, q, watched_columns(cfg, source.columns))
        started = queue.server_started(src)
        if made and existed:  # rows written before the trigger (an earlier ingest, an uninstalled sync) may be stale
            n = queue.requeue_all(src, q)
            log.info("sync: %s was written before its trigger: its %s keys are compared with the source once",
                     cfg.table, f"{n:,}")
    if made:
        log.info("sync: changes to %s are queued in %s from now on", cfg.source_table, q.table_name)
    ledger = Ledger.connect(dsn, settings.db_patience_seconds, host=settings.host_id)
    try:
        # the same database however reached (another role's DSN): status and --uninstall then find its queue
        ledger.record_sync(cfg.job, q.source, q.key, q.tag, source_db == target_db, started, source_db)
        # an earlier run's backfill (none where the table is gone: the job starts again)
        before = ledger.progress(cfg.job)["rows_written"] if existed and ledger.job(cfg.job) else 0
        progress = run_job(cfg, settings, launcher, empty_ok=True, checked=True)
        cfg = progress["spec"]
        lanes, batch = lanes or default_lanes(), batch or BATCH_KEYS
        syncer = Syncer(cfg, settings, dsn, src_dsn, device, batch, lanes=lanes) if table_exists(
            ledger.conn, cfg.table) else None
        if syncer is None:  # an empty source: the table is made now, for the rows that come
            from embedfleet.ingest.worker import load_encoder

            encoder = load_encoder(cfg, device, settings)
            ensure_table(ledger.conn, cfg.table, table_columns(cfg.preset, False, cfg.columns), encoder.dim,
                         vector_type(ledger.conn, cfg.dtype), cfg.partitions)
            ledger.set_model(cfg.job, encoder.name, encoder.dim, encoder.digest())
            syncer = Syncer(cfg, settings, dsn, src_dsn, device, batch, encoder=encoder, lanes=lanes)
        try:
            if follow and stop is None:  # SIGINT/SIGTERM end the following once the batch in hand commits
                with stop_on_signals() as stop:
                    stats = syncer.run(ledger, follow, stop)
            else:
                stats = syncer.run(ledger, follow, stop)
        finally:
            syncer.close()
        if not cfg.no_index:
            finish_table(ledger.conn, cfg.table, index=True, dsn=dsn)
        state = sync_overview(ledger.conn, cfg.job, settings.source_db)
    finally:
        ledger.close()
    return {"job": cfg.job, "table": cfg.table, "source": cfg.source_table, "queue": q.table_name,
            "installed": made, "backfill_rows": progress["rows_written"] - before, **stats.as_dict(), **(state or {})}


def check_rerun(conn, cfg: JobSpec, settings: Settings) -> dict | None:
    """Before anything is installed: the job's settings are its recorded ones, and no other sync follows into its
    table (two would mix their texts in it). Returns the job's sync record, if any."""
    ledger = Ledger(conn, host=settings.host_id)
    ledger.check_settings(cfg.job, cfg)
    if others := [j for j in syncs_into(conn, cfg.table) if j != cfg.job]:
        raise InputError(f"table {cfg.table} is the target of sync job {others[0]!r}: a second sync into it would mix "
                         "the two jobs' rows; pass --table NEWTABLE (and --job NEWNAME) to follow into another table")
    return ledger.sync_of(cfg.job)


def uninstall_sync(spec: JobSpec, settings: Settings) -> dict:
    """`sync --uninstall`: the source's trigger and the queue dropped, the sync's record gone; the target table
    and its job stay."""
    from embedfleet.ingest.job import source_dsn
    from embedfleet.pg.embedded import resolve_dsn

    dsn = resolve_dsn(spec.db, settings)
    with connect(source_dsn(spec, settings), what="--source-db / EMBEDFLEET_SOURCE_DB") as src:
        try:
            source = describe(src, spec.source_table)
            name, job = source.name, spec.job or spec.table or join_name(source.schema, f"{source.table}_embeddings")
        except InputError:  # dropped or renamed since: the sync's record says what to remove
            source, name = None, spec.source_table if "." in spec.source_table else qualified(src, spec.source_table)
            job = spec.job or spec.table or f"{name}_embeddings"
        ledger = Ledger.connect(dsn, settings.db_patience_seconds, host=settings.host_id)
        try:
            if not spec.job and spec.table and (known := job_for_table(ledger.conn, spec.table)):
                job = known[0]  # made with the table spelled another way (`t`, `public.t`)
            row = ledger.sync_of(job)
            if row is None and not (spec.job or spec.table):  # made with another --table: found by its source
                jobs = [j for (j,) in ledger.conn.execute("SELECT job FROM embedfleet.syncs WHERE source = %s "
                                                          "ORDER BY job", [name])]
                if len(jobs) > 1:
                    raise InputError(f"--uninstall: {len(jobs)} syncs follow {name} ({', '.join(jobs)}); name the "
                                     "one to remove with --table")
                if jobs:
                    job, row = jobs[0], ledger.sync_of(jobs[0])
            if row is None and source is None:
                raise InputError(f"--from-table {spec.source_table}: no such table, and no sync job {job!r} "
                                 "follows it; name the sync's target with --table or --job")
            if row and not row["same_db"] and not settings.source_db:
                where = (row["source_db"] or "/another database").split("/", 1)[1]
                raise InputError(f"sync job {job!r} follows {row['source']} in database {where}, whose trigger and "
                                 "queue are there: pass --source-db DSN of that database to remove them")
            q = queue.Queue(row["source"], row["key"], row["tag"]) if row else queue.queue_for(
                source.name, spec.id_field or source.key or "", job)
            dropped = queue.uninstall(src, q)
            if ledger.conn.execute("DELETE FROM embedfleet.syncs WHERE job = %s", [job]).rowcount:
                # its table followed the source: its rows are no longer what the backfill's ledger counts
                ledger.conn.execute("UPDATE embedfleet.jobs SET config = config || '{\"followed\": true}' "
                                    "WHERE job = %s", [job])
        finally:
            ledger.close()
    return {"job": job, "source": name, "queue": q.table_name, "uninstalled": dropped}
