"""The command line. Thin: each command parses flags and calls one function.

    ingest   inputs → embeddings → PostgreSQL, on every local device   (runtime/local.py → runtime/worker.py)
    worker   join a running job from any host                           (runtime/worker.py)
    status   the ledger's view of every job
    search   nearest neighbours of a query text (or a file of them)
    serve    the same over HTTP, the model loaded once
    verify   row counts, dimensions, norms
    train    a head on a table's stored vectors, on every local device (one process each)  (train/trainer.py)
    predict  a trained head applied to a table's stored vectors              (train/predict.py)
    export   a table's ids, columns and vectors to Parquet, .npy or JSON lines (store/export.py)
    map      a 2-D UMAP of a table's vectors, as one self-contained HTML page or a PNG (viz/map.py)
    db       the embedded PostgreSQL
    cache    compiled graphs, kernels and bytecode kept between processes
    bench    this encoder vs sentence-transformers, first call and steady state, fresh processes

With --json, stdout carries exactly one JSON document; logs and progress go to stderr.
Errors a user can act on print one line and exit non-zero (no traceback unless --debug).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from typing import List, Optional

import click
import orjson
import typer

from embedfleet.bytecode import keep_bytecode
from embedfleet.errors import EmbedfleetError

# Help text is rich markup: a literal bracket is escaped with a backslash, or rich takes "[ray]" for a style.
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Embed large text corpora on every GPU you can reach, into PostgreSQL/pgvector, exactly once.")
db_app = typer.Typer(no_args_is_help=True, help="The embedded PostgreSQL server (used when no --db is given).")
app.add_typer(db_app, name="db")
jobs_app = typer.Typer(no_args_is_help=True, help="The jobs in the ledger (`embedfleet status` lists them).")
app.add_typer(jobs_app, name="jobs")
cache_app = typer.Typer(no_args_is_help=True, help="Compiled graphs, kernels and bytecode kept under $EMBEDFLEET_HOME/cache.")
app.add_typer(cache_app, name="cache")

_state = {"debug": False}
DbOpt = typer.Option(None, "--db", help="postgresql://… DSN (default: $EMBEDFLEET_DB, else the embedded server)")


def _emit(doc) -> None:
    sys.stdout.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2, default=str).decode() + "\n")


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks.")) -> None:
    _state["debug"] = debug
    keep_bytecode()  # before torch & co. are imported, here and in every process this one starts
    from embedfleet.logs import setup_logging

    setup_logging(debug)


@app.command()
def ingest(
    inputs: List[str] = typer.Argument(None, help="JSONL(.gz/.zst), Parquet or CSV files or URLs (s3://, gs://, hf://, file://); globs allowed"),
    meta: Optional[str] = typer.Option(None, "--meta", help="product metadata file joined by parent_asin"),
    preset: Optional[str] = typer.Option(None, "--preset", help="amazon-reviews | generic | wikipedia | arxiv"),
    text_template: Optional[str] = typer.Option(None, "--text-template", help='e.g. "{title}\\n\\n{text}"'),
    text_field: Optional[str] = typer.Option(None, "--text-field", help="field holding the text to embed"),
    id_field: Optional[str] = typer.Option(None, "--id-field", help="field holding a unique id"),
    model: Optional[str] = typer.Option(None, "--model", help="local model directory or hub id (default: bundled all-MiniLM-L6-v2)"),
    db: Optional[str] = DbOpt,
    table: Optional[str] = typer.Option(None, "--table", help="target table (default: first input's file stem)"),
    job: Optional[str] = typer.Option(None, "--job", help="job name (default: the table name)"),
    devices: Optional[str] = typer.Option(None, "--devices", help="auto | cpu | cuda | cuda:0,1,…"),
    workers: Optional[int] = typer.Option(None, "--workers", help="worker processes (default: one per device)"),
    batch_tokens: Optional[str] = typer.Option(None, "--batch-tokens", help="auto | tokens per forward pass"),
    chunk_bytes: Optional[int] = typer.Option(None, "--chunk-bytes", help="bytes of input per claimed chunk"),
    limit: Optional[int] = typer.Option(None, "--limit", help="only the first N lines, counted over the inputs in order"),
    no_index: bool = typer.Option(False, "--no-index", help="skip the HNSW index build"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float (vector) | half (halfvec, pgvector ≥ 0.7)"),
    dim: Optional[int] = typer.Option(None, "--dim", help="Matryoshka: keep the first N dimensions"),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="prompt name or text prepended to documents"),
    passages: Optional[str] = typer.Option(None, "--passages", help="TOKENS\\[:OVERLAP]: each record as passages "
                                           "of at most TOKENS tokens, overlapping by OVERLAP (e.g. 256:32)"),
    partitions: Optional[int] = typer.Option(None, "--partitions", help="a new table as N hash partitions of its id, "
                                             "each growing under its own lock: for several GPUs (e.g. 8)"),
    columns: Optional[str] = typer.Option(None, "--columns", help="NAME:TYPE,…: record fields as typed columns of "
                                          "their own (e.g. stars:int,lang:text), for --where, train and map"),
    config: Optional[str] = typer.Option(None, "--config", help="YAML file with any of these flags (flags win)"),
    ray: Optional[str] = typer.Option(None, "--ray", help="run the workers as Ray actors: auto (RAY_ADDRESS or a "
                                      "local cluster) or the cluster's ADDRESS; pip install embedfleet\\[ray]"),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", help="serve Prometheus metrics on this port"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress display"),
    json_out: bool = typer.Option(False, "--json", help="print the final job summary as JSON"),
) -> None:
    """Embed INPUT files into a pgvector table. Re-running the same command resumes."""
    _state["resumes"] = True
    from embedfleet.config import Settings, build_config
    from embedfleet.runtime.bound import bound_line, host_shares, host_ticks, time_shares
    from embedfleet.runtime.job import run_job
    from embedfleet.sources.plan import expand_inputs

    cfg = build_config(dict(
        inputs=inputs, meta=meta, preset=preset, text_template=text_template, text_field=text_field,
        id_field=id_field, model=model, db=db, table=table, job=job, devices=devices, workers=workers,
        batch_tokens=batch_tokens, chunk_bytes=chunk_bytes, limit=limit, no_index=no_index, dtype=dtype,
        dim=dim, prompt=prompt, passages=passages, partitions=partitions, quiet=quiet, columns=columns,
    ), config)
    settings = Settings.from_env(metrics_port=metrics_port)
    cfg.inputs = expand_inputs(cfg.inputs)  # a missing file or GPU fails before any server starts
    begun, ticks = time.time(), host_ticks()  # this run's workers start after it: an earlier run's summaries are not its
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries our one JSON document, whatever a library prints
        if ray:
            from embedfleet.runtime.ray_launcher import RayLauncher

            launcher = RayLauncher(ray, cfg.devices, cfg.workers, settings)
        else:
            from embedfleet.runtime.local import LocalLauncher, parse_devices

            launcher = LocalLauncher(parse_devices(cfg.devices, cfg.workers), settings)
        progress = run_job(cfg, settings, launcher)
    summary = {"job": cfg.job, "table": cfg.table, "chunks_total": progress["chunks_total"],
               "chunks_done": progress["chunks_done"], "rows_written": progress["rows_written"],
               "rejected": progress["rejected"], "workers": progress["summaries"],
               "finalize": progress["finalize"],  # the table's statistics and index, after the workers
               "time_shares": time_shares(progress["summaries"], begun),  # what held the devices (None: too short to say)
               "host_cpu": host_shares(ticks, host_ticks())}  # this host's CPU: busy, and taken by a hypervisor
    if json_out:
        _emit(summary)
    elif not progress["table_exists"]:  # a worker creates the table with the model's dimension: none started
        typer.echo(f"{cfg.job}: no records in the inputs; nothing embedded, no table {cfg.table!r} created", err=True)
    else:
        import shlex

        merged = progress["rows_seen"] - progress["rows_written"] - progress["rows_before"]
        same_id = f"; {merged:,} records shared an id with another, the table keeps the last" if merged > 0 else ""
        typer.echo(f"{cfg.job}: {summary['rows_written']:,} rows in table {cfg.table!r} "
                   f"({summary['rejected']} rejected{same_id}) — try: embedfleet search \"…\" --table "
                   f"{shlex.quote(cfg.table)}", err=True)
        if summary["time_shares"]:
            ran = [s for s in progress["summaries"] if s.get("started_at", 0.0) >= begun]
            several = len(ran) > 1 and not progress["table_partitions"]
            typer.echo(bound_line(summary["time_shares"], summary["host_cpu"], several,
                                  stores_half=cfg.dtype == "half"), err=True)


@app.command()
def worker(
    job: str = typer.Option(..., "--job", help="the job to join"),
    db: Optional[str] = DbOpt,
    devices: str = typer.Option("auto", "--devices", "--device", help="auto | cpu | cuda | cuda:0,1,… (one worker each)"),
    workers: Optional[int] = typer.Option(None, "--workers", help="worker processes (default: one per device)"),
    worker_id: Optional[str] = typer.Option(None, "--worker-id", help="name prefix shown in status (default host-pid)"),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", help="serve Prometheus metrics on this port"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress display"),
) -> None:
    """Join a running job from this host, one worker per local device: claim chunks until none are left."""
    _state["resumes"] = True
    from contextlib import nullcontext

    from embedfleet.config import Settings, validate_devices
    from embedfleet.runtime.local import LocalLauncher, parse_devices
    from embedfleet.store.embedded import resolve_dsn
    from embedfleet.store.ledger import Ledger

    settings = Settings.from_env(metrics_port=metrics_port)
    launcher = LocalLauncher(parse_devices(validate_devices(devices), workers), settings, prefix=worker_id)
    dsn = resolve_dsn(db)
    ledger = Ledger.connect(dsn, settings.db_patience_seconds, host=settings.host_id)
    try:
        if ledger.job(job) is None:
            raise EmbedfleetError(f"no job named {job!r} in this database; `embedfleet status` lists them")
        if settings.metrics_port is not None:
            from embedfleet.runtime.metrics import serve_metrics

            serving = serve_metrics(settings.metrics_port, dsn, job)
        else:
            serving = nullcontext()
        with serving:
            launcher.run(ledger, job, dsn, quiet)
    finally:
        ledger.close()


@app.command()
def status(
    job: Optional[str] = typer.Option(None, "--job"),
    db: Optional[str] = DbOpt,
    watch: bool = typer.Option(False, "--watch", help="redraw jobs and every worker (host, device, GPU) each second"),
    json_out: bool = typer.Option(False, "--json", help="one JSON document on stdout"),
) -> None:
    """Jobs in the ledger: chunks, rows, rejects, state — and with --watch the fleet working on them."""
    from embedfleet.store.embedded import resolve_dsn
    from embedfleet.store.ledger import connect, jobs_overview

    with connect(resolve_dsn(db)) as conn:
        jobs = jobs_overview(conn, job)
        if job and not jobs:
            raise EmbedfleetError(f"no job named {job!r}; `embedfleet status` lists them")
        if json_out:
            _emit({"jobs": jobs})
            return
        from rich.console import Console

        from embedfleet.runtime.monitor import status_table, watch as watch_fleet

        if watch:
            watch_fleet(lambda: jobs_overview(conn, job))
            _stopped_on_purpose()
            return
        Console().print(status_table(jobs) if jobs else "no jobs yet: embedfleet ingest FILE")


@app.command()
def search(
    query: Optional[str] = typer.Argument(None, help="text to search for (or --queries FILE)"),
    table: str = typer.Option(..., "--table"),
    db: Optional[str] = DbOpt,
    k: int = typer.Option(10, "-k", "--k", help="results"),
    where: Optional[str] = typer.Option(None, "--where", help="SQL filter, e.g. \"rating <= 2\" (read-only)"),
    model: Optional[str] = typer.Option(None, "--model", help="default: the model the table was built with"),
    device: str = typer.Option("cpu", "--device", help="cpu (one query needs no GPU) | auto | cuda | cuda:N"),
    queries: Optional[str] = typer.Option(None, "--queries", help="file of queries, one a line ('-': stdin): "
                                          "prints one JSON line of results each, the model loaded once"),
    group_by_parent: bool = typer.Option(False, "--group-by-parent",
                                         help="the best passage of each of the k nearest records (--passages tables)"),
    statement_timeout: float = typer.Option(5.0, "--statement-timeout", help="seconds a search may run on the server"),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Nearest rows to QUERY (cosine), embedded with the table's own model and query prompt."""
    if (query is None) == (queries is None):
        raise EmbedfleetError("give a QUERY or --queries FILE (one of them)")
    if query is not None and not query.strip():
        raise EmbedfleetError("the query is empty: give the text to search for")
    if statement_timeout <= 0:
        raise EmbedfleetError(f"--statement-timeout {statement_timeout:g}: give a number of seconds above 0")
    if queries is None:
        from embedfleet.encode import one_thread_math

        one_thread_math()
    from embedfleet.store.embedded import resolve_dsn
    from embedfleet.store.search import query_lines, run_search

    texts = query_lines(queries) if queries is not None else [query]
    for text, results, scan in run_search(resolve_dsn(db), table, texts, k=k, where=where, model=model, device=device,
                                          group_by_parent=group_by_parent, statement_timeout=statement_timeout):
        if queries is not None:
            sys.stdout.write(orjson.dumps({"query": text, "results": results, "scan": scan}, default=str).decode() + "\n")
        elif json_out:
            _emit({"results": results, "scan": scan})
        elif not results:
            typer.echo(f"no rows of {table!r}" + (" pass the filter" if where else " to search (the table is empty)"),
                       err=True)
        else:
            for r in results:
                line = " ".join(str(r["content"]).split())
                typer.echo(f"{r['distance']:.4f}  {r['id']}  {line[:120]}")


@app.command()
def serve(
    table: str = typer.Option(..., "--table"),
    db: Optional[str] = DbOpt,
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on (default: this machine only)"),
    port: int = typer.Option(8000, "--port", help="0: any free port"),
    k: int = typer.Option(10, "-k", "--k", help="results when a request gives no k"),
    model: Optional[str] = typer.Option(None, "--model", help="default: the model the table was built with"),
    device: str = typer.Option("auto", "--device", help="auto (a GPU if there is one) | cpu | cuda | cuda:N"),
    allow_where: bool = typer.Option(False, "--allow-where", help="accept SQL filters (where=…) from clients; they "
                                     "run read-only as a role that can read only this table"),
    where_db: Optional[str] = typer.Option(None, "--where-db", help="with --db: a DSN of the role filters run as "
                                           "(one that can read only this table)"),
    statement_timeout: float = typer.Option(5.0, "--statement-timeout", help="seconds a request's search may run"),
) -> None:
    """Answer GET /search?q=…&k=… with the nearest rows as JSON, the model loaded once."""
    if where_db and not allow_where:
        raise EmbedfleetError("--where-db names the role filters run as: give --allow-where with it")
    if statement_timeout <= 0:
        raise EmbedfleetError(f"--statement-timeout {statement_timeout:g}: give a number of seconds above 0")
    from embedfleet.encode import one_thread_math

    one_thread_math()  # a request's query at a time: its own thread, several requests at once
    from embedfleet.serve import serve as run_serve
    from embedfleet.store.embedded import resolve_dsn, uses_embedded

    dsn = resolve_dsn(db)
    where_dsn = _filter_role(dsn, table, where_db, uses_embedded(db)) if allow_where else None
    try:
        run_serve(dsn, table, host=host, port=port, k=k, model=model, device=device, where_dsn=where_dsn,
                  statement_timeout=statement_timeout)
    except KeyboardInterrupt:  # uvicorn stops on SIGINT/SIGTERM, then raises the signal again
        pass
    _stopped_on_purpose()


def _filter_role(dsn: str, table: str, where_db: str | None, embedded: bool) -> str:
    """The DSN strangers' filters run on: the embedded server's reader role (made here), the --where-db
    given, or --db itself where its role reads only `table`; anything else is refused with the role to make."""
    from embedfleet.store.ledger import connect
    from embedfleet.store.roles import check_reader, ensure_reader, reader_dsn
    from embedfleet.store.schema import embedding_info

    with connect(dsn) as conn:
        embedding_info(conn, table)  # the table exists, before any role is made for it
        if where_db is None and embedded:
            where_db = reader_dsn(dsn, ensure_reader(conn, table))
        elif where_db is None:
            check_reader(conn, table, where_db=False)
            return dsn
    with connect(where_db) as conn:
        check_reader(conn, table, where_db=True)
    return where_db


@app.command()
def verify(
    table: List[str] = typer.Option(..., "--table", help="repeat for tables searched against each other "
                                    "(documents and their questions)"),
    db: Optional[str] = DbOpt,
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Check a table's rows against the ledger, its dimension, unit norms, NaN and zero vectors.

    With several tables, also that one model embedded them all."""
    from embedfleet.store.embedded import resolve_dsn
    from embedfleet.store.ledger import connect
    from embedfleet.store.search import verify as run_verify, verify_together

    with connect(resolve_dsn(db)) as conn:
        doc = run_verify(conn, table[0]) if len(table) == 1 else verify_together(conn, table)
    if json_out:
        _emit(doc)
    else:
        for report in doc.get("tables", [doc]):
            made = f", {report['model']}" + (f", prompt {report['prompt']!r}" if report["prompt"] else "") \
                + (f", passages {report['passages']}" if report["passages"] else "") if report["model"] else ""
            typer.echo(f"{report['table']}: {report['rows']:,} rows, dim {report['dim']} ({report['vector_type']}), "
                       f"ledger {report['ledger_rows']}{made}")
            for kind, ids in report["offending_ids"].items():
                typer.echo(f"  {kind}: {report['problems'][kind]} rows, e.g. {', '.join(ids[:10])}")
            if not report["count_matches_ledger"]:
                typer.echo(f"  row count {report['rows']} differs from the ledger's {report['ledger_rows']}")
            if report["overwritten"]:
                typer.echo(f"  {report['overwritten']:,} of the {report['ledger_records']:,} records written replaced "
                           "the row of another record of their job with the same id (duplicate ids in the inputs): "
                           "the table keeps the last of each")
        if "same_model" in doc and not doc["same_model"]:
            typer.echo("  the tables were embedded by different models or dimensions: their vectors do not compare")
        typer.echo("OK" if doc["ok"] else "PROBLEMS FOUND")
    if not doc["ok"]:
        raise typer.Exit(1)


@app.command()
def train(
    table: str = typer.Option(..., "--table", help="a table `embedfleet ingest` wrote (or any with a vector column)"),
    label: str = typer.Option(..., "--label", help="the column to predict"),
    task: str = typer.Option(..., "--task", help="classify | regress"),
    head: str = typer.Option("linear", "--head", help="linear | mlp"),
    epochs: int = typer.Option(10, "--epochs"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="rows a step, across all devices (default: "
                                             "an eighth of the train rows as a power of two, at most 4096)"),
    lr: float = typer.Option(1e-3, "--lr", help="AdamW learning rate (warm-up, then cosine decay)"),
    where: Optional[str] = typer.Option(None, "--where", help="SQL filter on the rows (read-only)"),
    val_fraction: float = typer.Option(0.1, "--val-fraction", help="share of rows, by id hash, kept for validation"),
    devices: str = typer.Option("auto", "--devices", help="auto | cpu | cuda | cuda:0,1,… (one process each)"),
    workers: Optional[int] = typer.Option(None, "--workers", help="processes (default one per device; --devices cpu "
                                          "--workers 2: two gloo processes)"),
    cache: str = typer.Option("auto", "--cache", help="auto | gpu | ram | stream: where the vectors live"),
    seed: int = typer.Option(0, "--seed"),
    out: Optional[str] = typer.Option(None, "--out",
                                      help="run directory (default $EMBEDFLEET_HOME/runs/TABLE-LABEL-TIME)"),
    db: Optional[str] = DbOpt,
    json_out: bool = typer.Option(False, "--json", help="print the final metrics document"),
) -> None:
    """Train a head (linear or MLP) on a table's stored vectors: one bulk read, batches on the device."""
    from embedfleet.train.trainer import TrainSettings
    from embedfleet.train.trainer import train as run_train

    run_train(TrainSettings(table=table, label=label, task=task, head=head, epochs=epochs, batch_size=batch_size,
                            lr=lr, where=where, val_fraction=val_fraction, devices=devices, workers=workers,
                            cache=cache, seed=seed, out=out, db=db, json=json_out))


@app.command()
def predict(
    run: str = typer.Option(..., "--run", help="a run directory `embedfleet train` wrote"),
    table: str = typer.Option(..., "--table"),
    where: Optional[str] = typer.Option(None, "--where", help="SQL filter on the rows (read-only)"),
    out: Optional[str] = typer.Option(None, "--out", help="FILE.parquet: id, prediction, probabilities"),
    db: Optional[str] = DbOpt,
    device: str = typer.Option("auto", "--device"),
    json_out: bool = typer.Option(False, "--json", help="print the summary as JSON"),
) -> None:
    """Apply a trained head to a table's stored vectors and print a summary.

    Where the table has a label column, the summary gives the head's agreement with it."""
    from embedfleet.train.predict import predict as run_predict

    summary = run_predict(run, table, where=where, out=out, db=db, device=device)
    if json_out:
        _emit(summary)
        return
    line = f"{summary['rows']:,} rows of {table!r} predicted"
    if summary.get("accuracy") is not None:
        line += f"; accuracy against {table}'s label {summary['accuracy']:.4f}"
        if summary.get("val_accuracy") is not None:
            line += f" (validation rows {summary['val_accuracy']:.4f})"
    if summary.get("mae") is not None:
        line += f"; MAE against {table}'s label {summary['mae']:.4f}"
    typer.echo(line)
    typer.echo(f"predicted: {orjson.dumps(summary['predicted']).decode()}")
    if out:
        typer.echo(f"wrote {out}", err=True)


@app.command()
def export(
    table: str = typer.Option(..., "--table"),
    fmt: str = typer.Option(..., "--format", help="parquet | npy | jsonl"),
    out: str = typer.Option(..., "--out", help="file (parquet, jsonl) or directory (npy, or --shards > 1)"),
    db: Optional[str] = DbOpt,
    where: Optional[str] = typer.Option(None, "--where", help="SQL filter, e.g. \"rating <= 2\" (read-only)"),
    columns: Optional[str] = typer.Option(None, "--columns", help="a,b: columns besides id and embedding "
                                                                  "(default: all; npy: none)"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32 | float16 (default: as stored)"),
    shards: int = typer.Option(1, "--shards", help="N files written in parallel, under one snapshot"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress bar"),
    json_out: bool = typer.Option(False, "--json", help="print the summary as JSON"),
) -> None:
    """Write a table's ids, columns and vectors to a file, streamed; nothing lands at --out unless it completes."""
    from embedfleet.store.embedded import resolve_dsn
    from embedfleet.store.export import export as run_export

    names = [c.strip() for c in columns.split(",") if c.strip()] if columns is not None else None
    summary = run_export(resolve_dsn(db), table, fmt, out, where=where, columns=names, dtype=dtype, shards=shards,
                         progress=not quiet)
    if json_out:
        _emit(summary)
    else:
        typer.echo(f"{summary['rows']:,} rows of {table!r} ({summary['dim']} dims, {summary['dtype']}) → "
                   f"{summary['out']} in {summary['seconds']:.1f} s", err=True)


@app.command("map")
def map_(
    table: str = typer.Option(..., "--table"),
    out: List[str] = typer.Option(..., "--out", help="map.html (one self-contained page) or map.png; repeatable"),
    db: Optional[str] = DbOpt,
    color_by: Optional[str] = typer.Option(None, "--color-by", help="column whose values colour the points"),
    sample: int = typer.Option(200_000, "--sample", help="rows at most (a random sample of larger tables)"),
    store_coords: bool = typer.Option(False, "--store-coords", help="write the 2-D coordinates into the table "
                                                                    "(columns map_x, map_y)"),
    seed: int = typer.Option(0, "--seed", help="which random sample"),
    json_out: bool = typer.Option(False, "--json", help="print the summary as JSON"),
) -> None:
    """A 2-D UMAP map of a table's vectors: hover a point for its row, click the legend to toggle colours."""
    from embedfleet.store.embedded import resolve_dsn
    from embedfleet.viz.map import build_map, require_map_extra

    require_map_extra()  # before starting a server or reading rows
    summary = build_map(resolve_dsn(db), table, out, color_by=color_by, sample=sample, store=store_coords, seed=seed)
    if json_out:
        _emit(summary)
    else:
        typer.echo(f"map of {summary['rows']:,} of {summary['total']:,} rows of {table!r} ({summary['method']}) → "
                   f"{', '.join(summary['outs'])} in {summary['seconds']:.1f} s", err=True)


@jobs_app.command("rm")
def jobs_rm(
    job: str = typer.Argument(..., help="the job's name, as `embedfleet status` lists it"),
    db: Optional[str] = DbOpt,
    drop_table: bool = typer.Option(False, "--drop-table", help="drop the job's table too (default: keep it)"),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Remove a job's ledger entries (chunks, rejects, workers); its table stays unless --drop-table."""
    from embedfleet.store.embedded import resolve_dsn
    from embedfleet.store.ledger import connect, remove_job

    with connect(resolve_dsn(db)) as conn:
        removed = remove_job(conn, job, drop_table=drop_table)
    if json_out:
        _emit(removed)
    else:
        kept = "dropped" if removed["table_dropped"] else "kept"
        typer.echo(f"removed job {job!r} ({removed['chunks']} chunks, {removed['rejects']} rejects); "
                   f"table {removed['table']!r} {kept}", err=True)


@db_app.command("uri")
def db_uri() -> None:
    """Print the embedded server's DSN (starting it if needed)."""
    from embedfleet.store.embedded import start

    typer.echo(start())


@db_app.command("start")
def db_start() -> None:
    """Start the embedded server."""
    from embedfleet.store.embedded import start

    typer.echo(f"running: {start()}", err=True)


@db_app.command("stop")
def db_stop() -> None:
    """Stop the embedded server."""
    from embedfleet.store.embedded import stop

    typer.echo("stopped" if stop() else "not running", err=True)


@cache_app.command("path")
def cache_path(json_out: bool = typer.Option(False, "--json", help='{"path": …}')) -> None:
    """Print where compiled graphs and kernels are kept ($EMBEDFLEET_HOME/cache)."""
    from embedfleet.cache import cache_dir

    if json_out:
        _emit({"path": str(cache_dir())})
    else:
        typer.echo(str(cache_dir()))


@cache_app.command("clear")
def cache_clear(json_out: bool = typer.Option(False, "--json")) -> None:
    """Remove the cache of compiled graphs, kernels and bytecode (the next big encode compiles again)."""
    from embedfleet.cache import clear

    removed = clear()
    if json_out:
        _emit(removed)
    else:
        typer.echo(f"removed {removed['path']}: {removed['files']} files, {removed['bytes'] / 1e6:.1f} MB", err=True)


@app.command()
def bench(
    shape: List[str] = typer.Option(None, "--shape", help="minilm-l6 | bert-base | qwen3-0.6b (repeatable)"),
    model: Optional[str] = typer.Option(None, "--model", help="a real model directory instead of a shape"),
    n: Optional[int] = typer.Option(None, "--n", help="texts per run (default 20000 on a GPU, 1000 on a CPU)"),
    texts: List[str] = typer.Option(None, "--texts", help="reviews | world (repeatable; default both)"),
    device: str = typer.Option("auto", "--device"),
    no_st: bool = typer.Option(False, "--no-st", help="skip the sentence-transformers baseline"),
    batch_tokens: str = typer.Option("auto", "--batch-tokens"),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """This encoder against sentence-transformers on the same texts, each measurement a fresh process.

    Each tool at its best on the device (a GPU: bf16, sentence-transformers at batch 256; a CPU: the dtype it
    is fastest in, sentence-transformers at its default batch 32). Measured: the first call (constructor
    included, also from a script importing torch and sentence-transformers), the steady state, one query."""
    from embedfleet.encode.bench import TEXT_SETS, format_bench, run_bench

    bad = [t for t in texts or [] if t not in TEXT_SETS]
    if bad:
        raise EmbedfleetError(f"--texts {bad[0]!r}: choose from {', '.join(TEXT_SETS)}")
    result = run_bench(shape or None, model, n=n, device=device, st=not no_st, batch_tokens=batch_tokens,
                       text_sets=texts or None)
    if json_out:
        _emit(result)
    else:
        typer.echo(format_bench(result))


_SIGNAL: dict = {"received": None}


def _interrupt(signum, frame) -> None:
    """Ctrl-C, and SIGTERM the same way: workers stopped, their chunks freed, the job "interrupted"."""
    _SIGNAL["received"] = signum
    raise KeyboardInterrupt


def _stopped_on_purpose() -> None:
    """A command that runs until interrupted (serve, status --watch) ends as the user asked: no message."""
    _SIGNAL["received"] = None


def _interrupted() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one does not cut the message short
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    typer.echo("interrupted: rerun the same command to resume" if _state.get("resumes") else "interrupted", err=True)
    sys.exit(128 + (_SIGNAL["received"] or signal.SIGINT))


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        rc = app(standalone_mode=False)  # returns typer.Exit's code instead of raising it
        if _SIGNAL["received"] is not None:  # typer turns an interrupt into a silent 130
            _interrupted()
        sys.exit(rc if isinstance(rc, int) else 0)
    except EmbedfleetError as e:
        if _state["debug"]:
            raise
        typer.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (KeyboardInterrupt, click.exceptions.Abort):  # older typer: click turns a KeyboardInterrupt into Abort
        _interrupted()
    except Exception as e:
        if hasattr(e, "show") and hasattr(e, "exit_code"):  # click's usage errors: bad flag, missing argument
            e.show()
            sys.exit(e.exit_code)
        if _state["debug"]:
            raise
        from embedfleet.store.errors import user_line

        line = user_line(e) or f"{type(e).__name__}: {e} (rerun with --debug for the traceback)"
        typer.echo(f"error: {line}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
