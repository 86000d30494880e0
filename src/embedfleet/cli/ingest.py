"""`ingest`, `worker`, `status`, `jobs rm`: a job's life from the command line."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import List, Optional

import typer

from embedfleet.cli.app import check_where, DbOpt, TrustOpt, app, emit, jobs_app, knobs, state, stopped_on_purpose, with_flags
from embedfleet.errors import EmbedfleetError, InputError, JobError
from embedfleet.logs import plural
from embedfleet.settings import shell_escapes


# Flags `ingest` and `sync` share, declared once.
TextTemplateOpt = typer.Option(None, "--text-template", help='e.g. "{title}\\n\\n{text}" (\\n and \\t as written '
                               'in a shell are a newline and a tab)')
TextFieldOpt = typer.Option(None, "--text-field", help="field (a table's column) holding the text to embed")
IdFieldOpt = typer.Option(None, "--id-field", help="field holding a unique id (a table's default: its primary key)")
ModelOpt = typer.Option(None, "--model", help="local model directory or hub id (default: bundled all-MiniLM-L6-v2)")
JobOpt = typer.Option(None, "--job", help="job name (default: the table name)")
DevicesOpt = typer.Option(None, "--devices", help="auto | cpu | cuda | cuda:0,1,…")
WorkersOpt = typer.Option(None, "--workers", help="worker processes (default: one per device)")
BatchTokensOpt = typer.Option(None, "--batch-tokens", help="auto | tokens per forward pass")
ChunkBytesOpt = typer.Option(None, "--chunk-bytes", help="bytes of input per claimed chunk")
NoIndexOpt = typer.Option(False, "--no-index", help="skip the HNSW index build")
DtypeOpt = typer.Option(None, "--dtype", help="float (vector) | half (halfvec, pgvector ≥ 0.7)")
DimOpt = typer.Option(None, "--dim", help="Matryoshka: keep the first N dimensions")
PromptOpt = typer.Option(None, "--prompt", help="prompt name or text prepended to documents")
TaskOpt = typer.Option(None, "--task", help="the task a model's own module takes (jina's adapters, with "
                       "--trust-remote-code; default: the prompt's name); searches reuse it")
SourceDbOpt = typer.Option(None, "--source-db", help="the database a --from-table source is in (default: --db)")
WhereOpt = typer.Option(None, "--where", callback=check_where, help="with --from-table: SQL filter on the source's rows (read-only)")
QuietOpt = typer.Option(False, "--quiet", help="no progress display")


@app.command()
def ingest(
    inputs: List[str] = typer.Argument(None, help="JSONL(.gz/.zst), Parquet or CSV files or URLs (s3://, gs://, hf://, file://); globs allowed"),
    meta: Optional[str] = typer.Option(None, "--meta", help="product metadata file joined by parent_asin"),
    preset: Optional[str] = typer.Option(None, "--preset", help="amazon-reviews | generic | wikipedia | arxiv"),
    text_template: Optional[str] = TextTemplateOpt,
    text_field: Optional[str] = TextFieldOpt,
    id_field: Optional[str] = IdFieldOpt,
    model: Optional[str] = ModelOpt,
    trust_remote_code: bool = TrustOpt,
    db: Optional[str] = DbOpt,
    table: Optional[str] = typer.Option(None, "--table", help="target table (default: first input's file stem)"),
    job: Optional[str] = JobOpt,
    devices: Optional[str] = DevicesOpt,
    workers: Optional[int] = WorkersOpt,
    batch_tokens: Optional[str] = BatchTokensOpt,
    chunk_bytes: Optional[int] = ChunkBytesOpt,
    limit: Optional[int] = typer.Option(None, "--limit", help="only the first N lines, counted over the inputs in order"),
    no_index: bool = NoIndexOpt,
    index: Optional[str] = typer.Option(None, "--index", help="hnsw (default) | binary: HNSW over the binary-quantized "
                                        "vectors (a few bits a dimension, about 10× smaller; searches rank its candidates by the full vectors)"),
    fts: bool = typer.Option(False, "--fts", help="also a full-text index of the content, at the end of the job "
                             "(search --hybrid)"),
    fts_config: Optional[str] = typer.Option(None, "--fts-config", help="with --fts: the text search configuration "
                                             "(default simple; english, german…: stemming and stop words)"),
    dtype: Optional[str] = DtypeOpt,
    dim: Optional[int] = DimOpt,
    prompt: Optional[str] = PromptOpt,
    task: Optional[str] = TaskOpt,
    passages: Optional[str] = typer.Option(None, "--passages", help="TOKENS\\[:OVERLAP]: each record as passages "
                                           "of at most TOKENS tokens, overlapping by OVERLAP (e.g. 200:32)"),
    partitions: Optional[int] = typer.Option(None, "--partitions", help="a new table as N hash partitions of its id, "
                                             "each growing under its own lock: for several GPUs (e.g. 8)"),
    columns: Optional[str] = typer.Option(None, "--columns", help="NAME:TYPE,…: record fields as typed columns of "
                                          "their own (e.g. stars:int,lang:text), for --where, train and map"),
    from_table: Optional[str] = typer.Option(None, "--from-table", help="[SCHEMA.]NAME: embed a PostgreSQL table's "
                                             "rows instead of files (its columns are the fields; id: its key)"),
    source_db: Optional[str] = SourceDbOpt,
    where: Optional[str] = WhereOpt,
    replace: Optional[List[str]] = typer.Option(None, "--replace", help="PATH: embed this input file again, "
                                                "its rows replaced chunk by chunk (a file that changed where it was "
                                                "already embedded; repeatable)"),
    config: Optional[str] = typer.Option(None, "--config", help="YAML file with any of these flags (flags win)"),
    ray: Optional[str] = typer.Option(None, "--ray", help="run the workers as Ray actors: auto (RAY_ADDRESS or a "
                                      "local cluster) or the cluster's ADDRESS; pip install embedfleet\\[ray]"),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", min=0, max=65535,
                                              help="serve Prometheus metrics on this port"),
    quiet: bool = QuietOpt,
    json_out: bool = typer.Option(False, "--json", help="print the final job summary as JSON"),
) -> None:
    """Embed INPUT files into a pgvector table. Re-running the same command resumes and embeds what is new.

    New: files the inputs match now, lines appended to planned files (a file changed where it was embedded is
    refused: --replace it)."""
    state["resumes"] = True
    from embedfleet.settings import build_job, run_options
    from embedfleet.ingest.bound import bound_line, host_shares, host_ticks, time_shares
    from embedfleet.ingest.job import run_job
    from embedfleet.sources.plan import expand_inputs

    run = run_options(config)  # how it runs, from --config where no flag says
    source_db, metrics_port = source_db or run.source_db, metrics_port if metrics_port is not None else run.metrics_port
    ray, json_out = ray or run.ray, json_out or run.json
    cfg = build_job(dict(
        inputs=inputs, meta=meta, preset=preset, text_template=shell_escapes(text_template), text_field=text_field,
        id_field=id_field, model=model, db=db, table=table, job=job, devices=devices, workers=workers,
        batch_tokens=batch_tokens, chunk_bytes=chunk_bytes, limit=limit, no_index=no_index, dtype=dtype,
        dim=dim, prompt=prompt, passages=passages, partitions=partitions, quiet=quiet, columns=columns,
        replacing=tuple(replace) if replace else None, source_table=from_table, where=where,
        trust_remote_code=trust_remote_code or None, fts=fts or None, fts_config=fts_config, index=index, task=task,
    ), config)
    if source_db and not cfg.source_table:
        raise InputError("--source-db is the database a --from-table source is in; files are read where they are: "
                         "leave it out, or add --from-table")
    settings = with_flags(knobs(), metrics_port=metrics_port, source_db=source_db)
    if not cfg.source_table:  # a missing file fails before any server starts
        cfg = cfg.replace(inputs=tuple(expand_inputs(list(cfg.inputs))))
    begun, ticks = time.time(), host_ticks()  # this run's workers start after it: an earlier run's summaries are not its
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries our one JSON document, whatever a library prints
        if ray:
            from embedfleet.ingest.launch.ray import RayLauncher

            launcher = RayLauncher(ray, cfg.devices, cfg.workers, settings)
        else:
            from embedfleet.ingest.launch.local import LocalLauncher
            from embedfleet.platform.devices import parse_devices

            launcher = LocalLauncher(parse_devices(cfg.devices, cfg.workers), settings)
        progress = run_job(cfg, settings, launcher)
    cfg = progress["spec"]  # as checked and planned: the job's and table's names filled in
    summary = {"job": cfg.job, "table": cfg.table, "chunks_total": progress["chunks_total"],
               "chunks_done": progress["chunks_done"], "rows_written": progress["rows_written"],
               "rejected": progress["rejected"], "workers": progress["summaries"],
               "finalize": progress["finalize"],  # the table's statistics and index, after the workers
               "time_shares": time_shares(progress["summaries"], begun),  # what held the devices (None: too short to say)
               "host_cpu": host_shares(ticks, host_ticks())}  # this host's CPU: busy, and taken by a hypervisor
    if json_out:
        emit(summary)
    elif not progress["table_exists"]:  # a worker creates the table with the model's dimension: none started
        typer.echo(f"{cfg.job}: no records in the inputs; nothing embedded, no table {cfg.table!r} created", err=True)
    else:
        import shlex

        before, written = progress["rows_before"], progress["rows_written"]
        merged = progress["rows_seen"] - written - before
        same_id = (f"; {plural(merged, 'record')} shared an id with another, the table keeps the last"
                   if merged > 0 else "")
        # a table that held rows: how many this job added and replaced, not only what it added ("0 rows")
        held = f", {min(before, progress['rows_seen'] - written):,} of its {before:,} rows replaced, " \
            f"{before + written:,} in all" if before else ""
        typer.echo(f"{cfg.job}: {plural(written, 'new row' if before else 'row')} in table "
                   f"{cfg.table!r}{held} "
                   f"({summary['rejected']} rejected{same_id}) — try: embedfleet search \"…\" --table "
                   f"{shlex.quote(cfg.table)}", err=True)
        if summary["rejected"]:
            typer.echo(f"why each was rejected: embedfleet jobs rejects {shlex.quote(cfg.job)}", err=True)
        if cfg.source_table:  # a rerun of the same command finds nothing new: the table's changes are sync's
            typer.echo(f"ingest reads {cfg.source_table} once: `embedfleet sync` with the same flags embeds the rows "
                       "added, changed or deleted since, and with --follow keeps up with them", err=True)
        if summary["time_shares"]:
            ran = [s for s in progress["summaries"] if s.get("started_at", 0.0) >= begun]
            several = len(ran) > 1 and not progress["table_partitions"]
            typer.echo(bound_line(summary["time_shares"], summary["host_cpu"], several,
                                  stores_half=cfg.dtype == "half"), err=True)


@app.command()
def sync(
    from_table: str = typer.Option(..., "--from-table", help="[SCHEMA.]NAME: the source table to follow"),
    text_field: Optional[str] = TextFieldOpt,
    text_template: Optional[str] = TextTemplateOpt,
    id_field: Optional[str] = IdFieldOpt,
    where: Optional[str] = WhereOpt,
    columns: Optional[str] = typer.Option(None, "--columns", help="a,b: source columns copied into the target"),
    source_db: Optional[str] = SourceDbOpt,
    db: Optional[str] = DbOpt,
    table: Optional[str] = typer.Option(None, "--table", help="target table (default: NAME_embeddings beside the "
                                        "source)"),
    job: Optional[str] = JobOpt,
    model: Optional[str] = ModelOpt,
    trust_remote_code: bool = TrustOpt,
    devices: Optional[str] = DevicesOpt,
    workers: Optional[int] = WorkersOpt,
    batch_tokens: Optional[str] = BatchTokensOpt,
    chunk_bytes: Optional[int] = ChunkBytesOpt,
    dtype: Optional[str] = DtypeOpt,
    dim: Optional[int] = DimOpt,
    prompt: Optional[str] = PromptOpt,
    task: Optional[str] = TaskOpt,
    no_index: bool = NoIndexOpt,
    batch: Optional[int] = typer.Option(None, "--batch", help="queued keys a drain batch takes (default: 256; "
                                        "up to 8 times as many while the queue is too long to scan quickly)"),
    lanes: Optional[int] = typer.Option(None, "--lanes", help="drain batches side by side on this many connections "
                                        "(default: half the cores, at most 8)"),
    follow: bool = typer.Option(False, "--follow", help="keep following changes until SIGINT/SIGTERM"),
    uninstall: bool = typer.Option(False, "--uninstall", help="remove the trigger and the queue (the vectors stay)"),
    quiet: bool = QuietOpt,
    json_out: bool = typer.Option(False, "--json", help="print the summary as JSON"),
) -> None:
    """Make a table's embeddings equal to the table and keep them so: backfill, then apply queued changes.

    The first run installs a trigger on the source and a queue in schema embedfleet; without --follow the queue
    is drained and the command exits 0; with it, changes keep being applied until SIGINT/SIGTERM."""
    state["resumes"], state["following"] = True, follow  # a follower stopped, even in its backfill, exits 0
    from embedfleet.settings import build_job
    from embedfleet.ingest.sync import run_sync, uninstall_sync

    cfg = build_job(dict(
        source_table=from_table, text_field=text_field, text_template=shell_escapes(text_template), id_field=id_field,
        where=where, columns=columns, db=db, table=table, job=job, model=model, devices=devices, workers=workers,
        batch_tokens=batch_tokens, chunk_bytes=chunk_bytes, dtype=dtype, dim=dim, prompt=prompt, no_index=no_index,
        quiet=quiet, trust_remote_code=trust_remote_code or None, task=task))
    settings = with_flags(knobs(), source_db=source_db)
    if (batch is not None and batch < 1) or (lanes is not None and lanes < 1):
        raise typer.BadParameter("--batch and --lanes must be at least 1")
    if uninstall and follow:
        raise typer.BadParameter("--uninstall removes the sync that --follow would run: give one of them")
    with contextlib.redirect_stdout(sys.stderr):
        if uninstall:
            summary = uninstall_sync(cfg, settings)
        else:
            from embedfleet.ingest.launch.local import LocalLauncher
            from embedfleet.platform.devices import parse_devices

            devs = parse_devices(cfg.devices, cfg.workers)
            summary = run_sync(cfg, settings, LocalLauncher(devs, settings), devs[0], follow, batch=batch, lanes=lanes)
    if json_out:
        emit(summary)
    elif uninstall:
        typer.echo(f"{summary['job']}: {'removed' if summary['uninstalled'] else 'there was no'} trigger and queue "
                   f"on {summary['source']}; the table stays", err=True)
    else:
        typer.echo(f"{summary['job']}: {summary['table']} follows {summary['source']} — backfill "
                   f"{summary['backfill_rows']:,} rows; {summary['keys']:,} queued changes: {summary['embedded']:,} "
                   f"embedded, {summary['unchanged']:,} unchanged, {summary['deleted']:,} deleted; "
                   f"{summary.get('pending') or 0:,} pending", err=True)


@app.command()
def worker(
    job: str = typer.Option(..., "--job", help="the job to join"),
    db: Optional[str] = DbOpt,
    devices: str = typer.Option("auto", "--devices", "--device", help="auto | cpu | cuda | cuda:0,1,… (one worker each)"),
    workers: Optional[int] = typer.Option(None, "--workers", min=1, help="worker processes (default: one per device)"),
    worker_id: Optional[str] = typer.Option(None, "--worker-id", help="name prefix shown in status (default host-pid)"),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", min=0, max=65535,
                                              help="serve Prometheus metrics on this port"),
    source_db: Optional[str] = typer.Option(None, "--source-db", help="a --from-table job's source database "
                                            "(default: --db)"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress display"),
) -> None:
    """Join a running job from this host, one worker per local device: claim chunks until none are left."""
    state["resumes"] = True
    from contextlib import nullcontext

    from embedfleet.platform.devices import validate_devices
    from embedfleet.ingest.launch.local import LocalLauncher
    from embedfleet.platform.devices import parse_devices
    from embedfleet.pg.embedded import resolve_dsn
    from embedfleet.ledger import Ledger

    settings = with_flags(knobs(), metrics_port=metrics_port, source_db=source_db)
    launcher = LocalLauncher(parse_devices(validate_devices(devices), workers), settings, prefix=worker_id)
    dsn = resolve_dsn(db, knobs())
    ledger = Ledger.connect(dsn, settings.db_patience_seconds, host=settings.host_id)
    try:
        if ledger.job(job) is None:
            raise EmbedfleetError(f"no job named {job!r} in this database; `embedfleet status` lists them")
        if settings.metrics_port is not None:
            from embedfleet.ingest.metrics import serve_metrics

            serving = serve_metrics(settings.metrics_port, dsn, job)
        else:
            serving = nullcontext()
        with serving:
            launcher.run(ledger, job, dsn, quiet)
        # every worker of this host stopped on an error (a model it cannot load here) while work is left: say why
        mine = launcher.worker_names()
        errors = [e for w, e in ledger.worker_errors(job) if w in mine]
        if errors and len(errors) == len(mine):
            left = ledger.counts(job)
            if left["pending"] or left["running"]:
                raise JobError(f"this host's workers for job {job!r} stopped: {errors[0]}")
    finally:
        ledger.close()


@app.command()
def status(
    job: Optional[str] = typer.Option(None, "--job"),
    db: Optional[str] = DbOpt,
    watch: bool = typer.Option(False, "--watch", help="redraw jobs and every worker (host, device, GPU) each second"),
    json_out: bool = typer.Option(False, "--json", help="one JSON document on stdout"),
    source_db: Optional[str] = typer.Option(None, "--source-db", help="where a sync job's source (and its queue) "
                                            "is, when another database than --db: its pending and lag_s"),
) -> None:
    """Jobs in the ledger: chunks, rows, rejects, state — and with --watch the fleet working on them."""
    from embedfleet.pg.embedded import resolve_dsn
    from embedfleet.pg.connect import connect
    from embedfleet.ledger import job_named, jobs_overview
    from embedfleet.pg.ddl import table_rows

    settings = with_flags(knobs(), source_db=source_db)
    with connect(resolve_dsn(db, settings)) as conn:
        job = job and job_named(conn, job)
        jobs = jobs_overview(conn, job, settings.source_db, host=settings.host_id)
        if job and not jobs:
            raise EmbedfleetError(f"no job named {job!r}; `embedfleet status` lists them")
        if json_out:
            emit({"jobs": jobs})
            return
        from rich.console import Console

        from embedfleet.ingest.monitor import counted_every, status_table, watch as watch_fleet

        if watch:
            count = counted_every(10.0, table_rows)  # a sync job's rows, counted in its table
            watch_fleet(lambda: jobs_overview(conn, job, settings.source_db, count, settings.host_id))
            stopped_on_purpose()
            return
        # piped or redirected: each job on one line, whatever its names' length (grep finds it)
        wide = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 100_000
        Console(width=wide).print(status_table(jobs) if jobs else "no jobs yet: embedfleet ingest FILE")


@jobs_app.command("rm")
def jobs_rm(
    job: str = typer.Argument(..., help="the job's name, as `embedfleet status` lists it"),
    db: Optional[str] = DbOpt,
    drop_table: bool = typer.Option(False, "--drop-table", help="drop the job's table too (default: keep it)"),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Remove a job's ledger entries (chunks, rejects, workers); its table stays unless --drop-table."""
    from embedfleet.pg.embedded import resolve_dsn
    from embedfleet.pg.connect import connect
    from embedfleet.pg.ddl import table_exists
    from embedfleet.ledger import job_named, remove_job

    with connect(resolve_dsn(db, knobs())) as conn:
        job = job_named(conn, job)
        removed = remove_job(conn, job, drop_table=drop_table, host=knobs().host_id)
        kept = not removed["table_dropped"] and table_exists(conn, removed["table"])  # a job with no row made none
    if json_out:
        emit(removed)
    else:
        table = f"table {removed['table']!r} {'dropped' if removed['table_dropped'] else 'kept' if kept else 'was never made'}"
        typer.echo(f"removed job {job!r} ({plural(removed['chunks'], 'chunk')}, {plural(removed['rejects'], 'reject')}); "
                   f"{table}", err=True)


@jobs_app.command("rejects")
def jobs_rejects(
    job: str = typer.Argument(..., help="the job's name, as `embedfleet status` lists it"),
    db: Optional[str] = DbOpt,
    limit: int = typer.Option(50, "--limit", min=0, help="at most this many (0: all)"),
    json_out: bool = typer.Option(False, "--json", help="one JSON document: source, line, reason, raw each"),
) -> None:
    """The records a job rejected, in input order: the file and line of each, and why."""
    from embedfleet.pg.embedded import resolve_dsn
    from embedfleet.pg.connect import connect
    from embedfleet.ledger import job_named, job_rejects, jobs_overview

    with connect(resolve_dsn(db, knobs())) as conn:
        job = job_named(conn, job)
        known = jobs_overview(conn, job)
        if not known:
            raise EmbedfleetError(f"no job named {job!r}; `embedfleet status` lists them")
        rejects, total = job_rejects(conn, job, limit or None)
    if json_out:
        emit({"job": job, "rejected": total, "rejects": rejects})
        return
    for r in rejects:
        where = f"{r['source']} key {r['key']}" if r.get("key") is not None else f"{r['source']}:{r['line']}"
        typer.echo(f"{where}: {r['reason']}")
    if total > len(rejects):
        typer.echo(f"… {total - len(rejects):,} more (--limit 0 lists all)", err=True)
    elif not total:
        typer.echo(f"job {job!r} rejected no record", err=True)
