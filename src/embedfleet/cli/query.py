"""`search`, `serve`, `verify`: reading back what was stored."""

from __future__ import annotations

import sys
from typing import List, Optional

import orjson
import typer

from embedfleet.cli.app import check_where, DbOpt, TrustOpt, app, emit, knobs, stopped_on_purpose
from embedfleet.errors import EmbedfleetError, InputError


MAX_STATEMENT_TIMEOUT = 2_147_483  # seconds: PostgreSQL's statement_timeout is at most 2^31 - 1 ms


def check_statement_timeout(seconds: float) -> None:
    """--statement-timeout as the server takes it, or one line."""
    if not 0 < seconds <= MAX_STATEMENT_TIMEOUT:  # (NaN compares false: refused too)
        raise EmbedfleetError(f"--statement-timeout {seconds:g}: give a number of seconds above 0 and at most "
                              f"{MAX_STATEMENT_TIMEOUT:,}")


@app.command()
def search(
    query: Optional[str] = typer.Argument(None, help="text to search for (or --queries FILE)"),
    table: str = typer.Option(..., "--table"),
    db: Optional[str] = DbOpt,
    k: int = typer.Option(10, "-k", "--k", help="results"),
    where: Optional[str] = typer.Option(None, "--where", callback=check_where, help="SQL filter, e.g. \"rating <= 2\" (read-only)"),
    model: Optional[str] = typer.Option(None, "--model", help="default: the model the table was built with"),
    trust_remote_code: bool = TrustOpt,
    device: str = typer.Option("cpu", "--device", help="cpu (one query needs no GPU) | auto | cuda | cuda:N"),
    queries: Optional[str] = typer.Option(None, "--queries", help="file of queries, one a line ('-': stdin): "
                                          "prints one JSON line of results each, the model loaded once"),
    group_by_parent: bool = typer.Option(False, "--group-by-parent",
                                         help="the best passage of each of the k nearest records (--passages tables)"),
    statement_timeout: float = typer.Option(5.0, "--statement-timeout", help="seconds a search may run on the server"),
    hybrid: bool = typer.Option(False, "--hybrid", help="also rank by full-text match of the query (the table's "
                                "full-text index: `embedfleet index --fts`), the two rankings fused by RRF"),
    rrf_k: Optional[int] = typer.Option(None, "--rrf-k", help="with --hybrid: reciprocal rank fusion's constant "
                                        "(default 60)"),
    rescore: Optional[int] = typer.Option(None, "--rescore", help="a binary index's candidates ranked by the full "
                                          "vectors (default 10 × k, at least 40)"),
    rerank: Optional[str] = typer.Option(None, "--rerank", help="a cross-encoder (sentence-transformers CrossEncoder "
                                         "directory or hub id) that reorders the first --rerank-depth rows"),
    rerank_depth: Optional[int] = typer.Option(None, "--rerank-depth", help="with --rerank: the rows it scores "
                                               "(default 50)"),
    json_out: bool = typer.Option(False, "--json", help="one JSON document (with --queries: a line of "
                                  "JSON for each query)"),
) -> None:
    """Nearest rows to QUERY (cosine), embedded with the table's own model and query prompt."""
    if (query is None) == (queries is None):
        raise EmbedfleetError("give a QUERY or --queries FILE (one of them)")
    if query is not None and not query.strip():
        raise EmbedfleetError("the query is empty: give the text to search for")
    check_statement_timeout(statement_timeout)
    if queries is None:
        from embedfleet.encode import one_thread_math

        one_thread_math()
    from embedfleet.pg.embedded import resolve_dsn
    from embedfleet.query.search import query_lines, run_search

    from embedfleet.sources.records import sanitize

    # a query argument's bytes that are not UTF-8 reach Python as lone surrogates: U+FFFD, as ingest stores them
    texts = query_lines(queries) if queries is not None else [sanitize(query)]
    failed = []
    for n, (text, results, scan, error) in enumerate(run_search(
            resolve_dsn(db, knobs()), table, texts, k=k, where=where, model=model, device=device, settings=knobs(),
            trust_remote_code=trust_remote_code, hybrid=hybrid, rrf_k=rrf_k, rescore=rescore, rerank=rerank,
            rerank_depth=rerank_depth, group_by_parent=group_by_parent, statement_timeout=statement_timeout), 1):
        if error is not None and queries is None:
            raise InputError(error)
        if queries is not None:
            line = {"query": text, "results": results, "scan": scan} if error is None else {"query": text,
                                                                                              "error": error}
            sys.stdout.write(orjson.dumps(line, default=str).decode() + "\n")
            if error is not None:
                failed.append(n)
                shown = text if len(text) <= 60 else text[:57] + "…"
                typer.echo(f"error: --queries {queries}: query {n} ({shown!r}), the others answered: {error}",
                           err=True)
        elif json_out or not results:
            if not results:  # said on stderr, as --json's empty list is on stdout
                typer.echo(f"no rows of {table!r}" + (" pass the filter" if where else " to search (none has a vector)"),
                           err=True)
            if json_out:
                emit({"results": results, "scan": scan})
        else:
            for r in results:
                line = " ".join(str(r["content"]).split())
                # the score the rows are ordered by comes first: the cross-encoder's, else the fused one
                lead = f"{r['rerank_score']:.4f}  " if rerank else f"{r['score']:.4f}  " if hybrid else ""
                typer.echo(f"{lead}{r['distance']:.4f}  {r['id']}  {line[:120]}")
    if failed:  # every other query answered; the exit says some were not
        raise typer.Exit(2)


@app.command()
def serve(
    table: str = typer.Option(..., "--table"),
    db: Optional[str] = DbOpt,
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on (default: this machine only)"),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="0: any free port"),
    k: int = typer.Option(10, "-k", "--k", help="results when a request gives no k"),
    model: Optional[str] = typer.Option(None, "--model", help="default: the model the table was built with"),
    trust_remote_code: bool = TrustOpt,
    device: str = typer.Option("auto", "--device", help="auto (a GPU if there is one) | cpu | cuda | cuda:N"),
    allow_where: bool = typer.Option(False, "--allow-where", help="accept SQL filters (where=…) from clients; they "
                                     "run read-only as a role that can read only this table"),
    where_db: Optional[str] = typer.Option(None, "--where-db", help="with --db: a DSN of the role filters run as "
                                           "(one that can read only this table)"),
    statement_timeout: float = typer.Option(5.0, "--statement-timeout", help="seconds a request's search may run"),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="a bearer key every request but /health must give "
                                          "(default $EMBEDFLEET_API_KEY); needed to listen beyond loopback"),
    rerank: Optional[str] = typer.Option(None, "--rerank", help="a cross-encoder that /search?rerank=true uses"),
) -> None:
    """Answer /search (nearest rows) and /v1/embeddings (OpenAI-compatible) over HTTP, the model loaded once."""
    if where_db and not allow_where:
        raise EmbedfleetError("--where-db names the role filters run as: give --allow-where with it")
    check_statement_timeout(statement_timeout)
    from embedfleet.encode import one_thread_math

    one_thread_math()  # a request's query at a time: its own thread, several requests at once
    from embedfleet.query.serve import serve as run_serve
    from embedfleet.pg.embedded import resolve_dsn, uses_embedded

    dsn = resolve_dsn(db, knobs())
    where_dsn = _filter_role(dsn, table, where_db, uses_embedded(db, knobs())) if allow_where else None
    try:
        run_serve(dsn, table, host=host, port=port, k=k, model=model, device=device, where_dsn=where_dsn, settings=knobs(),
                  statement_timeout=statement_timeout, trust_remote_code=trust_remote_code,
                  api_key=knobs().api_key if api_key is None else api_key, rerank=rerank)
    except KeyboardInterrupt:  # uvicorn stops on SIGINT/SIGTERM, then raises the signal again
        pass
    stopped_on_purpose()


def _filter_role(dsn: str, table: str, where_db: str | None, embedded: bool) -> str:
    """The DSN strangers' filters run on: the embedded server's reader role (made here), the --where-db
    given, or --db itself where its role reads only `table`; anything else is refused with the role to make."""
    from embedfleet.pg.connect import connect
    from embedfleet.pg.roles import check_reader, ensure_reader, reader_dsn
    from embedfleet.pg.ddl import embedding_info

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
    from embedfleet.pg.embedded import resolve_dsn
    from embedfleet.pg.connect import connect
    from embedfleet.query.verify import verify as run_verify, verify_together

    with connect(resolve_dsn(db, knobs())) as conn:
        doc = run_verify(conn, table[0]) if len(table) == 1 else verify_together(conn, table)
    if json_out:
        emit(doc)
    else:
        for report in doc.get("tables", [doc]):
            made = f", {report['model']}" + (f", prompt {report['prompt']!r}" if report["prompt"] else "") \
                + (f", passages {report['passages']}" if report["passages"] else "") if report["model"] else ""
            before = f" + {report['rows_before_jobs']:,} before its first job" if report["rows_before_jobs"] else ""
            ledger = "no job of embedfleet's wrote it" if report["ledger_rows"] is None else \
                f"ledger {report['ledger_rows']:,}{before}"
            typer.echo(f"{report['table']}: {report['rows']:,} rows, dim {report['dim']} ({report['vector_type']}), "
                       f"{ledger}{made}")
            for kind, ids in report["offending_ids"].items():
                typer.echo(f"  {kind}: {report['problems'][kind]} rows, e.g. {', '.join(ids[:10])}")
            if report.get("sync"):
                pending = report["sync"]["pending"]
                typer.echo(f"  follows {report['sync']['source']} (sync): "
                           f"{'?' if pending is None else f'{pending:,}'} {'change' if pending == 1 else 'changes'} pending")
            elif report["count_matches_ledger"] is False:
                typer.echo(f"  row count {report['rows']:,} differs from the ledger's "
                           f"{report['ledger_rows'] + report['rows_before_jobs']:,}")
            if report["overwritten"]:
                typer.echo(f"  {report['overwritten']:,} of the {report['ledger_records']:,} records written replaced "
                           "the row of another record of their job with the same id (duplicate ids in the inputs): "
                           "the table keeps the last of each")
        if "same_model" in doc and not doc["same_model"]:
            typer.echo("  the tables were embedded by different models or dimensions: their vectors do not compare")
        typer.echo("OK" if doc["ok"] else "PROBLEMS FOUND")
    if not doc["ok"]:
        raise typer.Exit(1)
