"""The command line. Thin: each command parses flags and calls one function.

    ingest   inputs → embeddings → PostgreSQL, on every local device   (runtime/local.py → runtime/worker.py)
    worker   join a running job from any host                           (runtime/worker.py)
    status   the ledger's view of every job
    search   nearest neighbours of a query text
    verify   row counts, dimensions, norms
    export   a table's ids, columns and vectors to Parquet, .npy or JSON lines (store/export.py)
    map      a 2-D UMAP of a table's vectors, as one self-contained HTML page or a PNG (viz/map.py)
    db       the embedded PostgreSQL
    bench    this encoder vs sentence-transformers on one GPU

With --json, stdout carries exactly one JSON document; logs and progress go to stderr.
Errors a user can act on print one line and exit non-zero (no traceback unless --debug).
"""

from __future__ import annotations

import logging
import sys
from typing import List, Optional

import orjson
import typer

from embedfleet.errors import EmbedfleetError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Embed large text corpora on every GPU you can reach, into PostgreSQL/pgvector, exactly once.")
db_app = typer.Typer(no_args_is_help=True, help="The embedded PostgreSQL server (used when no --db is given).")
app.add_typer(db_app, name="db")

_state = {"debug": False}
DbOpt = typer.Option(None, "--db", help="postgresql://… DSN (default: $EMBEDFLEET_DB, else the embedded server)")


def _emit(doc) -> None:
    sys.stdout.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2, default=str).decode() + "\n")


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks.")) -> None:
    _state["debug"] = debug
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("pgserver").setLevel(logging.DEBUG if debug else logging.WARNING)


@app.command()
def ingest(
    inputs: List[str] = typer.Argument(None, help="JSONL(.gz/.zst), Parquet or CSV files; globs allowed"),
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
    limit: Optional[int] = typer.Option(None, "--limit", help="only the first N lines"),
    no_index: bool = typer.Option(False, "--no-index", help="skip the HNSW index build"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float (vector) | half (halfvec, pgvector ≥ 0.7)"),
    dim: Optional[int] = typer.Option(None, "--dim", help="Matryoshka: keep the first N dimensions"),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="prompt name or text prepended to documents"),
    config: Optional[str] = typer.Option(None, "--config", help="YAML file with any of these flags (flags win)"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress display"),
    json_out: bool = typer.Option(False, "--json", help="print the final job summary as JSON"),
) -> None:
    """Embed INPUT files into a pgvector table. Re-running the same command resumes."""
    from embedfleet.config import build_config
    from embedfleet.runtime.local import ingest as run_ingest

    cfg = build_config(dict(
        inputs=inputs, meta=meta, preset=preset, text_template=text_template, text_field=text_field,
        id_field=id_field, model=model, db=db, table=table, job=job, devices=devices, workers=workers,
        batch_tokens=batch_tokens, chunk_bytes=chunk_bytes, limit=limit, no_index=no_index, dtype=dtype,
        dim=dim, prompt=prompt, quiet=quiet,
    ), config)
    progress = run_ingest(cfg)
    summary = {"job": cfg.job, "table": cfg.table, "chunks_total": progress["chunks_total"],
               "chunks_done": progress["chunks_done"], "rows_written": progress["rows_written"],
               "rejected": progress["rejected"]}
    if json_out:
        _emit(summary)
    else:
        typer.echo(f"{cfg.job}: {summary['rows_written']:,} rows in table {cfg.table!r} "
                   f"({summary['rejected']} rejected) — try: embedfleet search \"…\" --table {cfg.table}", err=True)


@app.command()
def worker(
    job: str = typer.Option(..., "--job", help="the job to join"),
    db: Optional[str] = DbOpt,
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N"),
    worker_id: Optional[str] = typer.Option(None, "--worker-id", help="name shown in status (default host-pid)"),
) -> None:
    """Join a running job from this host: claim chunks until none are left."""
    import os
    import socket

    from embedfleet.runtime.worker import run_worker
    from embedfleet.store.embedded import resolve_dsn

    run_worker(job, resolve_dsn(db), worker_id or f"{socket.gethostname()}-{os.getpid()}", device)


@app.command()
def status(
    job: Optional[str] = typer.Option(None, "--job"),
    db: Optional[str] = DbOpt,
    json_out: bool = typer.Option(False, "--json", help="one JSON document on stdout"),
) -> None:
    """Jobs in the ledger: chunks, rows, rejects, state."""
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
    from rich.table import Table

    t = Table("job", "table", "state", "chunks", "rows", "rejected", "started", "finished")
    for j in jobs:
        t.add_row(j["job"], j["table"], j["state"], f"{j['chunks_done']}/{j['chunks_total']}",
                  f"{j['rows_written']:,}", str(j["rejected"]), (j["started"] or "")[:19], (j["finished"] or "")[:19])
    Console().print(t if jobs else "no jobs yet: embedfleet ingest FILE")


@app.command()
def search(
    query: str = typer.Argument(..., help="text to search for"),
    table: str = typer.Option(..., "--table"),
    db: Optional[str] = DbOpt,
    k: int = typer.Option(10, "-k", "--k", help="results"),
    where: Optional[str] = typer.Option(None, "--where", help="SQL filter, e.g. \"rating <= 2\" (read-only)"),
    model: Optional[str] = typer.Option(None, "--model", help="default: the model the table was built with"),
    device: str = typer.Option("auto", "--device"),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Nearest rows to QUERY (cosine), embedded with the table's own model and query prompt."""
    from embedfleet.encode.encoder import Encoder
    from embedfleet.store import search as s
    from embedfleet.store.embedded import resolve_dsn
    from embedfleet.store.ledger import connect
    from embedfleet.store.schema import embedding_info

    with connect(resolve_dsn(db)) as conn:
        embedding_info(conn, table)  # fail fast on a missing table, before loading a model
        enc = Encoder(model or s.table_model(conn, table), device=device)
        try:
            vec = enc.encode([query], prompt="query")[0]
        finally:
            enc.close()
        results = s.search(conn, table, vec, k=k, where=where)
    if json_out:
        _emit({"results": results})
        return
    for r in results:
        text = " ".join(str(r["content"]).split())
        typer.echo(f"{r['distance']:.4f}  {r['id']}  {text[:120]}")


@app.command()
def verify(
    table: str = typer.Option(..., "--table"),
    db: Optional[str] = DbOpt,
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Check a table: row count against the ledger, dimension, unit norms, NaN and zero vectors."""
    from embedfleet.store.embedded import resolve_dsn
    from embedfleet.store.ledger import connect
    from embedfleet.store.search import verify as run_verify

    with connect(resolve_dsn(db)) as conn:
        report = run_verify(conn, table)
    if json_out:
        _emit(report)
    else:
        typer.echo(f"{table}: {report['rows']:,} rows, dim {report['dim']} ({report['vector_type']}), "
                   f"ledger {report['ledger_rows']}")
        for kind, ids in report["offending_ids"].items():
            typer.echo(f"  {kind}: {report['problems'][kind]} rows, e.g. {', '.join(ids[:10])}")
        if not report["count_matches_ledger"]:
            typer.echo(f"  row count {report['rows']} differs from the ledger's {report['ledger_rows']}")
        typer.echo("OK" if report["ok"] else "PROBLEMS FOUND")
    if not report["ok"]:
        raise typer.Exit(1)


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


@app.command()
def bench(
    shape: List[str] = typer.Option(None, "--shape", help="minilm-l6 | bert-base | qwen3-0.6b (repeatable)"),
    model: Optional[str] = typer.Option(None, "--model", help="a real model directory instead of a shape"),
    n: int = typer.Option(20000, "--n", help="texts per run"),
    device: str = typer.Option("auto", "--device"),
    no_st: bool = typer.Option(False, "--no-st", help="skip the sentence-transformers baseline"),
    batch_tokens: str = typer.Option("auto", "--batch-tokens"),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Time this encoder end to end against sentence-transformers (bf16, batch 256) on the same texts."""
    from embedfleet.encode.bench import format_bench, run_bench

    result = run_bench(shape or None, model, n=n, device=device, st=not no_st, batch_tokens=batch_tokens)
    if json_out:
        _emit(result)
    else:
        typer.echo(format_bench(result))


def main() -> None:
    try:
        rc = app(standalone_mode=False)  # returns typer.Exit's code instead of raising it
        sys.exit(rc if isinstance(rc, int) else 0)
    except EmbedfleetError as e:
        if _state["debug"]:
            raise
        typer.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        typer.echo("interrupted: rerun the same command to resume", err=True)
        sys.exit(130)
    except Exception as e:
        if hasattr(e, "show") and hasattr(e, "exit_code"):  # click's usage errors: bad flag, missing argument
            e.show()
            sys.exit(e.exit_code)
        if _state["debug"]:
            raise
        typer.echo(f"error: {type(e).__name__}: {e} (rerun with --debug for the traceback)", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
