"""A job's life, the same whatever runs its workers: check everything that can be checked before a job
exists, plan it into the ledger (or find it planned: a rerun resumes), have a launcher run workers
until no chunk is left, then finish it (statistics, the HNSW index, its final state).

    run_job(spec, settings, LocalLauncher(...))   # cli/ingest.py; ingest/launch/local.py
    run_job(spec, settings, RayLauncher(...))     # cli/ingest.py --ray; ingest/launch/ray.py
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Callable

from psycopg import sql

from embedfleet.errors import InputError, JobError, ModelError
from embedfleet.logs import plural
from embedfleet.ingest.launch import Launcher
from embedfleet.ingest.preflight import check_inputs_have_text
from embedfleet.ledger import Ledger, remove_job
from embedfleet.pg.connect import Reconnect
from embedfleet.pg.ddl import (check_embedding_column, check_identifier, check_partitions, check_server,
                               check_table_columns, check_write_privileges, drop_table, ensure_vector, finish_table,
                               join_name, partition_count, table_exists, table_rows, table_sql)
from embedfleet.pg.embedded import resolve_dsn
from embedfleet.pg.fts import check_fts_config
from embedfleet.settings import JobSpec, Settings, default_chunk_bytes
from embedfleet.sources import files
from embedfleet.sources.plan import (CSV_FIRST_LINE, ChunkSpec, chunk_lines, expand_inputs, input_kind, plan_chunks,
                                     plan_file, table_name_for)
from embedfleet.sources.table import describe, plan_table
from embedfleet.sources.presets import table_columns
from embedfleet.sources.records import validate_template

__all__ = ["run_job", "check_job", "plan_job", "finalize", "apply_limit"]

log = logging.getLogger("embedfleet")


def run_job(spec: JobSpec, settings: Settings, launcher: Launcher, empty_ok: bool = False, said: bool = False,
            checked: bool = False) -> dict:
    """Run one ingest job to its end. Returns the job's final progress (each worker's summary under
    "summaries", the checked spec under "spec"). A job that ends with failed chunks, stops with chunks left, embeds nothing, or whose
    table cannot be finished is a JobError, and the ledger says the same (state and error). An interrupt
    (Ctrl-C, SIGTERM) stops the workers, frees their chunks and leaves the job "interrupted". `empty_ok`: a
    source with nothing in it is a job of no chunks (sync's backfill of an empty table), not an error. `checked`:
    `spec` is what `check_job` returned already (sync checks it before installing its trigger)."""
    dsn = resolve_dsn(spec.db, settings)
    reconnect = Reconnect(dsn, settings.db_patience_seconds)
    conn = reconnect.first()
    served = ExitStack()
    try:
        # before the ledger exists: a job that cannot run leaves nothing behind
        cfg = spec if checked else check_job(spec, conn, settings, say=not said)
        # the metrics port taken before anything is planned, too: one it cannot have leaves no job behind
        served.enter_context(_metrics(settings.metrics_port, dsn, cfg.job))
    except BaseException:
        conn.close()
        raise
    ledger = Ledger(conn, reconnect, settings.host_id)
    existed = table_exists(conn, cfg.table)  # a table made by this run and left empty is not kept
    # GPU workers import torch and start their devices (seconds) while the job is planned
    early = launcher.device_kind == "cuda"
    job = source = None
    try:
        if early:
            launcher.prestart(cfg.job, dsn, conn, bool(cfg.meta))
        if cfg.source_table:  # planned and read in one snapshot of the source, held while the workers run
            source = SourceSnapshot(source_dsn(cfg, settings), cfg.source_table)
        cfg = plan_job(cfg, ledger, launcher.device_kind, source, empty_ok)
        job = cfg.job
        counts = ledger.counts(job)
        if counts["pending"] or counts["running"]:
            ledger.set_job_state(job, "running")
            launcher.run(ledger, job, dsn, cfg.quiet)
        if source is not None:
            source = source.close()
        if early:
            launcher.discard()  # those the job did not need (nothing left, or fewer chunks than devices)
        t0, started_at, steps = time.perf_counter(), time.time(), {}
        counts, loaded = finish(ledger, job, cfg, steps)
        finalize_s = time.perf_counter() - t0
        progress = ledger.progress(job)
        progress["finalize"] = {"started_at": round(started_at, 3), "seconds": round(finalize_s, 3), **steps}
        progress["summaries"] = ledger.summaries(job)
        progress["table_exists"] = loaded  # none when no worker had a record
        progress["table_partitions"] = partition_count(ledger.conn, cfg.table) if loaded else 0
        progress["rows_before"] = (ledger.job(job) or {}).get("rows_before") or 0  # rows a rewrite may replace
        progress["spec"] = cfg
        if loaded and cfg.columns and not cfg.source_table:
            for name in columns_never_given(ledger.conn, cfg):
                log.warning("--columns %s: the field is missing or null in every row the table's statistics "
                            "sampled; check its name as the input writes it, case included", name)
        errors = ledger.worker_errors(job)
        # a rerun that replaced files with nothing keeps its job and table (every record rejected still fails)
        replaced_empty = cfg.replacing and not progress["rejected"]
        if not (counts["failed"] or counts["pending"] or counts["running"] or empty_ok or replaced_empty):
            nothing_embedded(ledger, job, cfg, progress, existed)
    except KeyboardInterrupt:
        if job is not None:
            interrupted(ledger, job, launcher)
        raise
    finally:
        served.close()
        if early:
            launcher.discard()  # also after an error planning the job, or Ctrl-C
        if source is not None:
            source.close()
        ledger.close()
    if counts["failed"]:
        raise JobError(f"job {job!r} finished with {plural(counts['failed'], 'failed chunk')}; "
                       f"`embedfleet status --job {job}` shows why; rerun to retry them")
    if counts["pending"] or counts["running"]:
        if errors:
            raise JobError(f"job {job!r} stopped: {errors[0][1]}")
        raise JobError(f"job {job!r} stopped with {counts['pending'] + counts['running']} chunks left "
                       "(all workers died); rerun the same command to resume")
    return progress


class SourceSnapshot:
    """A REPEATABLE READ transaction on a --from-table source, held open while its job runs: the plan counts the
    source's pages in it, and the workers' reads join it (`pg_export_snapshot`), so each row is read once."""

    def __init__(self, dsn: str, source: str):
        from embedfleet.pg.connect import connect
        from embedfleet.pg.scan import begin_snapshot, export_snapshot

        self.source, self.conn = source, connect(dsn, what="--source-db / EMBEDFLEET_SOURCE_DB")
        begin_snapshot(self.conn)
        self.snapshot = export_snapshot(self.conn)

    def close(self) -> None:
        self.conn.close()


def interrupted(ledger: Ledger, job: str, launcher: Launcher) -> None:
    """After an interrupt: the launcher's workers are stopped; their chunks go back to pending now, and the
    job says it was interrupted (not "running" for ever)."""
    try:
        launcher.discard()  # whatever started early is stopped before its chunks are freed
        ledger.release_dead_local(job)
        ledger.set_job_state(job, "interrupted", "interrupted: rerun the same command to resume")
    except Exception as e:  # noqa: BLE001 - the database may be what went away; the interrupt still ends the run
        log.warning("could not mark job %s interrupted: %s", job, e)


def nothing_embedded(ledger: Ledger, job: str, cfg: JobSpec, progress: dict, existed: bool) -> None:
    """A job whose inputs gave no row fails with why, and leaves no empty table of its own making: with
    rejects the job stays in the ledger (status lists them); with no record at all it is removed."""
    if progress["rows_written"] or progress["rows_seen"]:
        return
    if not existed and table_exists(ledger.conn, cfg.table) and table_rows(ledger.conn, cfg.table) == 0:
        drop_table(ledger.conn, cfg.table)
    if progress["rejected"]:
        first = ledger.first_reject(job)
        n = progress["rejected"]
        why = (f"{'the one record was' if n == 1 else f'all {n:,} records were'} rejected (first: "
               f"{Path(first[0]).name} line {first[1]}: "
               f"{first[2]}); `embedfleet status --job {job}` counts them, and embedfleet.rejects holds each line")
        ledger.set_job_state(job, "failed", f"nothing embedded: {why}")
        raise JobError(f"nothing embedded: {why}")
    remove_job(ledger.conn, job)
    raise JobError("nothing embedded: the inputs hold no records (empty, or blank lines only); no table made")


def _metrics(port: int | None, dsn: str, job: str):
    if port is None:
        return nullcontext()
    from embedfleet.ingest.metrics import serve_metrics

    return serve_metrics(port, dsn, job)


def apply_limit(chunks: list[ChunkSpec], limit: int | None,
                count: Callable[[ChunkSpec, int], int | None] = chunk_lines) -> list[tuple[ChunkSpec, int | None]]:
    """Keep the chunks holding the first `limit` lines over all inputs in order, each capped (`last_line`).
    A chunk's lines are known when the next chunk continues its file; a file's last chunk is counted
    (`count`: its lines, or None when more than are left, so the cap falls inside it and planning stops)."""
    if limit is None:
        return [(c, None) for c in chunks]
    from embedfleet.sources.csv import record_cap

    out, remaining = [], limit
    for i, c in enumerate(chunks):
        if remaining <= 0:
            break
        if c.kind == "csv":  # a quoted field may run over lines: the cap is where the last record kept starts
            records, cap = record_cap(c, remaining)
            out.append((c, cap))
            remaining -= records
            continue
        out.append((c, c.first_line + remaining - 1))
        if i + 1 == len(chunks):
            break
        nxt = chunks[i + 1]
        lines = nxt.first_line - c.first_line if nxt.source == c.source else count(c, remaining)
        if lines is None:
            break
        remaining -= lines
    return out


def meta_identity(path: str) -> str:
    """Which meta file this is, contents included (a path or a URL): loaded once per identity."""
    from embedfleet.sources import files

    return hashlib.sha256(files.fingerprint(path).encode()).hexdigest()[:16]


def check_job(spec: JobSpec, conn, settings: Settings, say: bool = True) -> JobSpec:
    """Everything that can be known wrong before a job exists: names, the server (PostgreSQL, pgvector,
    privileges), the model and the inputs' text. Returns the spec with its inputs expanded and its table and
    job named; an error here leaves no job behind. `say`: the index it gets and the --dim notes are logged
    (a caller that checked the job already has said them)."""
    made = None
    if spec.source_table:
        named = spec.table is not None
        spec = check_source(spec, source_dsn(spec, settings))
        if not named:  # NAME_embeddings in the source's schema, which another database may lack; made first, as
            from embedfleet.pg.ddl import ensure_schema  # the checks below resolve the name through it

            made = ensure_schema(conn, spec.table.partition(".")[0])
        inputs = spec.inputs
    else:
        inputs = tuple(expand_inputs(list(spec.inputs)))
    try:
        return _check_named(spec, inputs, conn, settings, say)
    except BaseException:
        if made:  # a refused job leaves nothing behind
            from embedfleet.pg.ddl import drop_empty_schema

            drop_empty_schema(conn, made)
        raise


def _check_named(spec: JobSpec, inputs: tuple, conn, settings: Settings, say: bool) -> JobSpec:
    """check_job's checks once the inputs and the target's schema are known."""
    table = check_identifier(spec.table or table_name_for(inputs[0]))
    cfg = spec.replace(inputs=inputs, table=table, job=spec.job or table, model=spec.model or settings.model)
    check_server(conn, cfg.dtype)
    if cfg.columns:
        from embedfleet.sources.presets import job_preset

        job_preset(cfg.preset, list(cfg.columns))  # a name the table has already: one line now, nothing installed
    from embedfleet.encode.models import check_model, model_name, unnamed_prompt

    model = check_model(cfg.model, cfg.trust_remote_code)  # an unusable model fails here, once, not in every worker after planning
    model.check_task(cfg.task)
    hidden = model.output_dim(model.hidden_size) if model.hidden_size else None  # a Dense module sets the width
    name = model_name(spec.model, model.path)
    if cfg.dim is not None and hidden is not None and not 0 < cfg.dim <= hidden:
        raise ModelError(f"--dim {cfg.dim} is out of range: {name} makes {hidden}-dimensional vectors")
    if say and model.pooling == "lasttoken" and not (model.path / "modules.json").is_file():
        log.info("pooling: %s has no modules.json: its vectors are its last token's, as decoder embedding models "
                 "pool (sentence-transformers would take the mean); a modules.json with a Pooling module decides", name)
    if say and (cfg.dim or hidden):  # the index a table of this width gets, decided and said before anything is planned
        from embedfleet.pg.ddl import index_plan

        _, words = index_plan(cfg.dim or hidden, "halfvec" if cfg.dtype == "half" else "vector", cfg.index)
        if not cfg.no_index:
            log.info("index: %s", words)
    if say and cfg.prompt and (said := unnamed_prompt(model, name, cfg.prompt, "--prompt ")):
        log.warning("--prompt %s: %s", cfg.prompt, said)
    if say and cfg.dim is not None and cfg.dim < (hidden or 0) and model.matryoshka() is None:
        log.warning("--dim %d: %s was not trained for shorter vectors (its model card names no Matryoshka training): "
                    "its first %d dimensions may find worse neighbours than all %d", cfg.dim, name, cfg.dim, hidden)
    if say and cfg.dim is None and hidden and (widths := model.matryoshka()) is not None:
        from embedfleet.pg.ddl import HNSW_VECTOR_DIMS

        shorter = [w for w in widths if w < hidden]
        log.info("dim: %s was trained for shorter vectors (Matryoshka%s): --dim N keeps the first N, a smaller table "
                 "and index%s", name, f": {', '.join(map(str, shorter))}" if shorter else "",
                 f"; at most {HNSW_VECTOR_DIMS:,} get HNSW on the vectors themselves" if hidden > HNSW_VECTOR_DIMS else "")
    if cfg.passages:
        check_passages(cfg, model)
    if cfg.text_template:
        validate_template(cfg.text_template)
    check_write_privileges(conn, cfg.table, index=not cfg.no_index)
    if cfg.fts_config is not None and not cfg.fts:
        raise InputError(f"--fts-config {cfg.fts_config} configures --fts's full-text index: add --fts, or leave "
                         "--fts-config out")
    if cfg.fts_config and not conn.execute("SELECT 1 FROM pg_ts_config WHERE cfgname = %s",
                                           [cfg.fts_config]).fetchone():
        raise InputError(f"--fts-config {cfg.fts_config!r}: the server has no such text search configuration "
                         "(`SELECT cfgname FROM pg_ts_config` lists them)")
    check_partitions(conn, cfg.table, cfg.partitions)
    ensure_vector(conn)
    if table_exists(conn, cfg.table):  # its vectors must be this job's size, and its columns this job's
        check_same_columns(conn, cfg)
        if cfg.fts and cfg.fts_config:
            check_fts_config(conn, cfg.table, cfg.fts_config)
        if cfg.dim or hidden:
            check_embedding_column(conn, cfg.table, cfg.dim or hidden, "halfvec" if cfg.dtype == "half" else "vector")
        check_table_columns(conn, cfg.table, table_columns(cfg.preset, bool(cfg.passages), cfg.columns))
        check_same_model(conn, cfg, model)
    if not cfg.source_table:
        check_inputs_have_text(cfg)
    if spec.job is None:  # named after its table: `t` and `public.t` are one job (one trigger, one resume)
        from embedfleet.ledger import job_for_table

        if known := job_for_table(conn, table):
            cfg = cfg.replace(job=known[0], table=known[1])
    return cfg


def check_same_columns(conn, cfg: JobSpec) -> None:
    """A rerun of the table's job with other --columns is refused as a job of other settings, before the table's
    columns are compared: adding the column to the table would not make the job take it."""
    from embedfleet.ledger import Ledger, job_for_table, ledger_exists

    if not ledger_exists(conn) or not (known := job_for_table(conn, cfg.table)):
        return
    job = cfg.job if cfg.job and cfg.job != cfg.table else known[0]
    ledger = Ledger(conn)
    existing = ledger.job(job)
    if existing and (existing["config"].get("columns") or []) != [list(c) if isinstance(c, tuple) else c
                                                                 for c in cfg.columns or ()]:
        ledger.check_settings(job, cfg)


def check_same_model(conn, cfg: JobSpec, model) -> None:
    """Vectors of two models in one table do not compare: a job may not write into a table that another job's
    model filled (told apart by `ModelSpec.digest`, not by name), where the ledger knows it."""
    from embedfleet.ledger import ledger_exists
    from embedfleet.pg.ddl import spellings

    if not ledger_exists(conn):
        return
    other = conn.execute(
        "SELECT job, coalesce(model, config->>'model') FROM embedfleet.jobs WHERE table_name = ANY(%s) AND job <> %s "
        "AND config->>'model_digest' IS NOT NULL AND config->>'model_digest' <> %s ORDER BY created LIMIT 1",
        [spellings(conn, cfg.table), cfg.job, model.digest()]).fetchone()
    if other:
        from embedfleet.encode.models import model_name

        raise ModelError(f"table {cfg.table!r} holds vectors of another model ({other[1]}, job {other[0]!r}): "
                         f"{model_name(cfg.model, model.path)}'s would not compare with them; pass another --table, "
                         "or that --model")


def source_dsn(spec: JobSpec, settings: Settings) -> str:
    """Where a --from-table source lives: --source-db, else the target's database."""
    return settings.source_db or resolve_dsn(spec.db, settings)


def check_source(spec: JobSpec, dsn: str) -> JobSpec:
    """A --from-table job's source read from its catalog: the spec with its input the source's qualified name,
    its id the key, its text field found where there is one text column, its --columns typed as the source's,
    and its table (by default) NAME_embeddings beside the source. One line for each way it cannot work."""
    from embedfleet.pg.connect import connect
    from embedfleet.sources.records import template_fields
    from embedfleet.sources.table import check_fields, describe, resolve_columns, text_columns

    with connect(dsn, what="--source-db / EMBEDFLEET_SOURCE_DB") as conn:
        source = describe(conn, spec.source_table)
        if spec.where:
            check_where(conn, source.name, spec.where)
    text_field = spec.text_field
    if not text_field and not spec.text_template:
        candidates = [c for c in text_columns(source) if c != (spec.id_field or source.key)]
        if len(candidates) != 1:
            raise InputError(f"--from-table {source.name}: pass --text-field COLUMN or --text-template "
                             f"(text columns: {', '.join(candidates) or 'none'})")
        text_field = candidates[0]
    names = [c.split(":")[0].strip() for c in spec.columns or ()]
    key = check_fields(source, spec.id_field, text_field,
                       template_fields(spec.text_template) if spec.text_template else [], names)
    return spec.replace(inputs=(source.name,), source_table=source.name, id_field=key, text_field=text_field,
                        columns=resolve_columns(source, spec.columns),
                        table=spec.table or join_name(source.schema, f"{source.table}_embeddings"))


def check_where(conn, source: str, where: str) -> None:
    """A --where that cannot run on the source is one line now, not a failed chunk in every worker."""
    import psycopg
    from psycopg import sql

    from embedfleet.errors import first_line
    from embedfleet.pg.scan import user_filter, where_error
    from embedfleet.sources.table import alias_of

    try:
        with conn.transaction():
            conn.execute("SET TRANSACTION READ ONLY")
            # run on one row: a filter that would write (a function's side effect) is refused now, not by each worker
            conn.execute(sql.SQL("SELECT 1 FROM (SELECT * FROM {} LIMIT 1) AS {} WHERE {}").format(
                sql.SQL(source), sql.SQL(alias_of(source)), user_filter(where)))
    except psycopg.Error as e:
        raise where_error(first_line(e), where) from None


def check_passages(cfg: JobSpec, spec) -> None:
    """A passage must fit what the model sees, special tokens and the prompt included."""
    from embedfleet.encode.models import model_name
    from embedfleet.encode.passages import parse_passages, room
    from embedfleet.encode.tokenize import model_tokenizer

    size, overlap = parse_passages(cfg.passages)
    tok = model_tokenizer(spec, cfg.prompt)
    fits = room(tok.tokenizer_json, tok.max_length, tok.prefix)
    if size > fits:
        raise InputError(f"--passages {cfg.passages}: {model_name(cfg.model, spec.path)} sees {tok.max_length} tokens, {fits} of them "
                         f"a passage's once its special tokens{' and prompt' if tok.prefix else ''} are in; "
                         f"use --passages {fits}{f':{overlap}' if overlap else ''} or less")


def plan_job(cfg: JobSpec, ledger: Ledger, device: str, source: "SourceSnapshot | None" = None,
             empty_ok: bool = False) -> JobSpec:
    """Load the meta file and plan the job (or find it planned: a rerun resumes). Returns the spec with its
    meta file's path resolved. A --from-table job is planned in `source`'s snapshot, which its workers join
    while it is held."""
    meta_id = None
    if cfg.meta:
        from embedfleet.sources.presets import get_preset, load_meta

        (meta_path,) = expand_inputs([cfg.meta])
        cfg = cfg.replace(meta=meta_path)
        meta_id = meta_identity(meta_path)
        if not ledger.meta_loaded(meta_id):
            skipped = []
            rows = load_meta(meta_path, get_preset(cfg.preset), on_skip=lambda line, why: skipped.append(line))
            n = ledger.load_meta(meta_id, meta_path, rows, lambda: len(skipped))
            log.info("loaded %d products from %s", n, meta_path)
    chunk_bytes = cfg.chunk_bytes or default_chunk_bytes(device)
    if ledger.discard_failed_start(cfg.job, cfg):
        log.info("job %s failed before embedding anything: planned again with these settings", cfg.job)
    exists = ledger.job(cfg.job) is not None
    if exists and not cfg.source_table and not table_exists(ledger.conn, cfg.table) and ledger.made_progress(cfg.job):
        # nothing of it is left: planned again from its files as they are now (they may have changed meanwhile)
        log.warning("table %s is gone: job %s is planned again from the start, from its inputs as they are now",
                    cfg.table, cfg.job)
        for other in ledger.orphan_jobs(cfg.job):
            log.warning("job %s also wrote table %s: its rows went with it; rerun its command to embed them again",
                        other, cfg.table)
        from embedfleet.ledger import remove_job

        remove_job(ledger.conn, cfg.job)
        exists = False
    plan, planned = [], []
    if not exists and cfg.source_table:
        plan = [(c, None) for c in plan_table(source.conn, describe(source.conn, source.source), chunk_bytes)]
        if not plan and not empty_ok:
            raise JobError(f"nothing embedded: table {cfg.source_table} has no rows; no table made")
    elif not exists:
        if cfg.replacing:
            raise InputError(f"--replace: job {cfg.job!r} has not embedded anything yet; run it without --replace")
        chunks = plan_chunks(list(cfg.inputs), chunk_bytes)
        plan = apply_limit(chunks, cfg.limit)
        planned = files_planned(cfg.inputs, [c for c, _ in plan])
    if not plan and not exists and not empty_ok:  # every input is empty: no job, no table, as blank lines
        raise JobError("nothing embedded: the inputs hold no records (empty, or blank lines only); no table made")
    if not ledger.create_job(cfg.job, cfg, plan, meta_id, planned):  # it exists with the same settings: resume
        released = ledger.release_dead_local(cfg.job)
        if not table_exists(ledger.conn, cfg.table) and ledger.made_progress(cfg.job):
            chunks = ledger.restart_job(cfg.job)
            log.warning("table %s is gone: embedding job %s again from the start (%d chunks)", cfg.table, cfg.job,
                        chunks)
            for other in ledger.orphan_jobs(cfg.job):
                log.warning("job %s also wrote table %s: its rows went with it; rerun its command to embed them again",
                            other, cfg.table)
        retried = ledger.retry_failed(cfg.job)
        if released or retried:
            log.info("resuming %s: %s of dead workers re-queued, %s retried", cfg.job, plural(released, "chunk"),
                     plural(retried, "failed chunk"))
        added = 0 if cfg.source_table else plan_changes(cfg, ledger, chunk_bytes)
        if added:
            log.info("job %s: %s for %s", cfg.job, plural(added, "new chunk"),
                     "the files given with --replace (and anything "
                     "added to its inputs)" if cfg.replacing else "what was added to its inputs")
    if source is not None:
        ledger.set_snapshot(cfg.job, source.snapshot)
    return cfg


def files_planned(inputs, chunks: list[ChunkSpec]) -> list:
    """Each input as planned into `chunks` (an empty one too, so that lines appended later are found)."""
    from embedfleet.sources.changes import planned_file

    by_source: dict[str, list[ChunkSpec]] = {}
    for c in chunks:
        by_source.setdefault(c.source, []).append(c)
    out = []
    for source in inputs:
        if source in by_source:
            out.append(planned_file(source, by_source[source]))
        elif files.size(source) == 0:
            out.append(planned_file(source, []))
    return out


def record_ids(cfg: JobSpec) -> str | None:
    """How a job's ids come from its records, as a user would name it, or None where they are the file and line."""
    from embedfleet.sources.presets import job_preset

    preset = job_preset(cfg.preset, list(cfg.columns or ()))
    if cfg.id_field or preset.id_field:
        return f"--id-field {cfg.id_field or preset.id_field}"
    return f"preset {preset.name}'s fields {', '.join(preset.id_fields)}" if preset.id_fields else None


def plan_changes(cfg: JobSpec, ledger: Ledger, chunk_bytes: int) -> int:
    """A rerun of a planned job: chunks for bytes appended to its files and for files its inputs now match,
    and (--replace) its files planned anew, their chunks before dropped; a file whose planned bytes changed is
    refused before anything is added. Returns the chunks added."""
    from embedfleet.sources.changes import appended_from, changed_line, next_line, survey

    known = ledger.planned_files(cfg.job)
    spelled = {files.same_file(s): s for s in known}  # a file named the other way now (path, file:// URL) is the same

    def as_planned(sources) -> list[str]:
        return [spelled.get(files.same_file(s), s) for s in sources]

    inputs = as_planned(cfg.inputs)
    replace = frozenset(as_planned(expand_inputs(list(cfg.replacing or ()))))
    for source in sorted(replace - set(known) - set(inputs)):
        raise InputError(f"--replace {source}: not one of job {cfg.job!r}'s input files")
    named = record_ids(cfg)
    # Rows carry no file of their own: a record that left the file would keep its row, unseen by verify's count.
    no_replace = (f"job {cfg.job!r} takes its ids from the records ({named}), so the rows of records no longer in "
                  "the file cannot be found; to embed it again, remove the job and its table (embedfleet jobs rm "
                  f"{cfg.job} --drop-table) and run the command again") if named else None
    if replace and no_replace:
        raise InputError(f"--replace {sorted(replace)[0]}: {no_replace} without --replace")
    found = survey(known, inputs, replace)
    if gone := [s for s in sorted(known) if not files.is_url(s) and not Path(s).exists()]:
        shown = ", ".join(Path(s).name for s in gone[:3]) + (f" and {len(gone) - 3:,} more" if len(gone) > 3 else "")
        log.warning("%s of job %s %s gone (%s): %s rows stay in table %s, and a renamed file's are there under both "
                    "names; to embed the inputs as they are now, remove the job and its table (embedfleet jobs rm %s "
                    "--drop-table) and rerun", plural(len(gone), "planned file"), cfg.job,
                    "is" if len(gone) == 1 else "are", shown, "its" if len(gone) == 1 else "their", cfg.table, cfg.job)
    if found.changed:
        others = [Path(source).name for source, _ in found.changed[1:]]
        more = (f" ({plural(len(others), 'more file')} changed too: {', '.join(others[:3])}"
                f"{', …' if len(others) > 3 else ''})" if others else "")
        raise InputError(changed_line(*found.changed[0], no_replace) + more)
    last = ledger.last_chunks(cfg.job)
    grown: list[ChunkSpec] = []
    for p, _ in sorted(found.grown, key=lambda g: g[0].source):
        if p.source not in last:  # empty when planned, so no chunk: planned as a new file is
            grown += plan_file(p.source, chunk_bytes)
            continue
        start, more = appended_from(p)
        grown += plan_file(p.source, chunk_bytes, start=start, first_line=next_line(last[p.source][0]) + more)
    grown += [c for source in found.new for c in plan_file(source, chunk_bytes)]
    plan = apply_limit(grown, None if cfg.limit is None else max(0, cfg.limit - lines_planned(last, cfg.limit)))
    replaced = []
    for source in sorted(replace):
        # a file that holds nothing now is one chunk of no bytes, whose commit clears the rows it had
        chunks = plan_file(source, chunk_bytes) or [ChunkSpec(source, input_kind(source), 0, 0, 1)]
        ends = [c.first_line - 1 for c in chunks[1:]] + [ledger.last_line_read(cfg.job, source)]
        replaced += [(c, None, end) for c, end in zip(chunks, ends)]
    planned_now = {c.source: [] for c, *_ in plan + replaced}
    for c, *_ in plan + replaced:
        planned_now[c.source].append(c)
    from embedfleet.sources.changes import planned_file

    records = [planned_file(source, ([ChunkSpec(source, known[source].kind, 0, known[source].size, 1)]
                                     if source in known and source not in replace else []) + chunks)
               for source, chunks in planned_now.items()]
    records += [planned_file(source, []) for source in found.new if source not in planned_now
                and files.size(source) == 0]
    return ledger.extend_job(cfg.job, plan + replaced, records, replace & set(known))


def lines_planned(last: dict, most: int) -> int:
    """The records a job planned (up to `most`), from each file's last chunk and its --limit cap: a line each,
    except in a CSV file, where a quoted field may run over lines and its records are counted."""
    from embedfleet.sources.changes import next_line
    from embedfleet.sources.csv import record_cap

    total = 0
    for spec, cap in last.values():
        if spec.kind == "csv":  # the file's planned part, from its start
            total += record_cap(ChunkSpec(spec.source, "csv", 0, spec.end, CSV_FIRST_LINE), most, cap)[0]
            continue
        end = next_line(spec)
        if cap is not None:
            end = min(end, cap + 1)
        total += end - 1
    return total


def columns_never_given(conn, cfg: JobSpec) -> list[str]:
    """The --columns whose field no row had: NULL in every row, by the statistics the job's end gathered."""
    from embedfleet.pg.ddl import split_table

    schema, name = split_table(conn, cfg.table)
    wanted = [c.split(":")[0].strip() for c in cfg.columns or ()]
    rows = conn.execute("SELECT attname FROM pg_stats WHERE tablename = %s AND schemaname = coalesce(%s, "
                        "current_schema()) AND attname = ANY(%s) AND null_frac = 1", [name, schema, wanted]).fetchall()
    return [c for c in wanted if (c,) in rows]


def finalize(ledger: Ledger, job: str, cfg: JobSpec, timings: dict | None = None) -> tuple[dict, bool]:
    """Mark the job done or failed; once everything landed, make the table searchable (statistics,
    autovacuum back, the HNSW index) — safe when two runs of the job finish together. Returns the
    chunks' counts and whether the table exists (a worker makes it); `timings` gets the table's steps."""
    counts = ledger.counts(job)
    loaded = table_exists(ledger.conn, cfg.table)
    if counts["failed"]:
        failed = ledger.failed_chunks(job)
        msg = "; ".join(f"chunk {c} ({Path(s).name}): {e}" for c, s, e in failed[:5])
        if loaded:
            finish_table(ledger.conn, cfg.table, index=False, dsn=ledger.dsn)
        ledger.set_job_state(job, "failed", f"{len(failed)} chunks failed: {msg}")
        return counts, loaded
    if counts["pending"] or counts["running"]:
        errors = ledger.worker_errors(job)
        if errors:  # every worker stopped on an error it cannot get past (a model or device it cannot use)
            ledger.set_job_state(job, "failed", "; ".join(f"{w}: {e}" for w, e in errors[:3]))
        return counts, loaded  # otherwise stopped early (interrupted): a rerun resumes
    if loaded and not ledger.conn.execute(sql.SQL("SELECT EXISTS (SELECT FROM {})").format(
            table_sql(ledger.conn, cfg.table))).fetchone()[0]:  # no row to search: nothing is said searchable
        ledger.set_job_state(job, "done")
        return counts, loaded
    if loaded:
        if cfg.fts:  # first: adding its column rewrites the table, and would rebuild an HNSW index built before
            from embedfleet.pg.fts import add_fts

            t0 = time.perf_counter()
            added, config = add_fts(ledger.conn, cfg.table, cfg.fts_config)
            if added and timings is not None:
                timings["fts_s"] = round(time.perf_counter() - t0, 3)
            log.info("table %s has a full-text index (%s): search --hybrid", cfg.table, config)
        found = finish_table(ledger.conn, cfg.table, index=not cfg.no_index, timings=timings, dsn=ledger.dsn,
                             kind=cfg.index)
        if found:
            what = "binary-quantized HNSW index" if found[1] == "bit" else "HNSW index"
            log.info("table %s is searchable (%s %s)", cfg.table, what, found[0])
    ledger.set_job_state(job, "done")
    return counts, loaded


def finish(ledger: Ledger, job: str, cfg: JobSpec, timings: dict) -> tuple[dict, bool]:
    """`finalize`, with a statement the server refuses (an index it cannot build, a full disk) reported as
    itself: the job is marked failed with the reason, and the error says what would work. A lost connection
    is left to the caller's one line about it."""
    import psycopg

    from embedfleet.errors import EmbedfleetError, connection_lost, first_line

    try:
        return finalize(ledger, job, cfg, timings)
    except psycopg.Error as e:
        if connection_lost(e):
            raise
        reason = first_line(e)
        hint = finish_hint(reason)
        with contextlib.suppress(psycopg.Error):
            ledger.set_job_state(job, "failed", f"finishing table {cfg.table} failed: {reason}")
        raise JobError(f"job {job!r}: every row is written, but finishing table {cfg.table!r} failed: {reason}"
                       + (f"; {hint}" if hint else "")) from None
    except EmbedfleetError as e:  # a refusal at the finish (another full-text configuration): failed, saying so
        with contextlib.suppress(psycopg.Error):
            ledger.set_job_state(job, "failed", f"finishing table {cfg.table} failed: {e}")
        raise


def finish_hint(reason: str) -> str | None:
    """What would work instead, for the failures a table's finish is known to meet."""
    if "dimensions for hnsw index" in reason:
        return ("pgvector's HNSW index takes vector up to 2,000 dimensions (halfvec up to 4,000): rerun the same "
                "command with --no-index to finish without one (search then scans every row), or with --dim N "
                "(N ≤ 2000) under a new --job and --table where the model was trained for shorter vectors")
    if "could not extend file" in reason or "No space left" in reason:
        return "the server's disk is full: free space, then rerun the same command to finish"
    return None
