"""`export` and `map`: a table's rows out to files and pictures."""

from __future__ import annotations

from typing import List, Optional

import typer

from embedfleet.cli.app import DbOpt, app, emit, knobs


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
    from embedfleet.pg.embedded import resolve_dsn
    from embedfleet.export import export as run_export

    names = [c.strip() for c in columns.split(",") if c.strip()] if columns is not None else None
    summary = run_export(resolve_dsn(db, knobs()), table, fmt, out, where=where, columns=names, dtype=dtype, shards=shards,
                         progress=not quiet)
    if json_out:
        emit(summary)
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
    from embedfleet.pg.embedded import resolve_dsn
    from embedfleet.map import build_map, require_map_extra

    require_map_extra()  # before starting a server or reading rows
    summary = build_map(resolve_dsn(db, knobs()), table, out, color_by=color_by, sample=sample, store=store_coords, seed=seed)
    if json_out:
        emit(summary)
    else:
        typer.echo(f"map of {summary['rows']:,} of {summary['total']:,} rows of {table!r} ({summary['method']}) → "
                   f"{', '.join(summary['outs'])} in {summary['seconds']:.1f} s", err=True)


@app.command()
def index(
    table: str = typer.Option(..., "--table"),
    fts: bool = typer.Option(False, "--fts", help="add a full-text index of the content (for search --hybrid)"),
    fts_config: str = typer.Option("simple", "--fts-config", help="its text search configuration (simple, english…)"),
    db: Optional[str] = DbOpt,
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Add an index to a table embedfleet wrote: --fts, a full-text index of its content for hybrid search."""
    from embedfleet.errors import EmbedfleetError

    if not fts:
        raise EmbedfleetError("name the index to add: --fts (a full-text index of the content)")
    from embedfleet.pg.connect import connect
    from embedfleet.pg.ddl import embedding_info, table_sql
    from embedfleet.pg.embedded import resolve_dsn
    from embedfleet.pg.fts import FTS_COLUMN, add_fts

    with connect(resolve_dsn(db, knobs())) as conn:
        embedding_info(conn, table)  # one line for a table that is not there
        added = add_fts(conn, table_sql(conn, table), fts_config)
    if json_out:
        emit({"table": table, "fts": True, "fts_config": fts_config, "added": added, "column": FTS_COLUMN})
    else:
        typer.echo(f"table {table!r}: {'added' if added else 'already has'} a full-text index ({fts_config}); "
                   "search --hybrid uses it", err=True)
