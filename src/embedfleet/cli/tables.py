"""`export` and `map`: a table's rows out to files and pictures."""

from __future__ import annotations

from typing import List, Optional

import typer

from embedfleet.cli.app import check_where, DbOpt, app, emit, knobs


@app.command()
def export(
    table: str = typer.Option(..., "--table"),
    fmt: str = typer.Option(..., "--format", help="parquet | npy | jsonl"),
    out: str = typer.Option(..., "--out", help="file (parquet, jsonl) or directory (npy, or --shards > 1)"),
    db: Optional[str] = DbOpt,
    where: Optional[str] = typer.Option(None, "--where", callback=check_where, help="SQL filter, e.g. \"rating <= 2\" (read-only)"),
    columns: Optional[str] = typer.Option(None, "--columns", help="a,b: columns besides id and embedding "
                                                                  "(default: all but content_tsv; npy: none)"),
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
    """A 2-D map of a table's vectors (UMAP; t-SNE up to 1,000 rows): hover a point for its row.

    Click the legend to toggle colours."""
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
    index: Optional[str] = typer.Option(None, "--index", help="hnsw | binary: rebuild the vector index as HNSW (as the "
                                        "width allows) or over the binary-quantized vectors"),
    fts_config: Optional[str] = typer.Option(None, "--fts-config", help="its text search configuration (simple, "
                                             "english…; default simple)"),
    db: Optional[str] = DbOpt,
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Index a table embedfleet wrote: --fts (a full-text index for hybrid search), --index hnsw|binary."""
    from embedfleet.errors import EmbedfleetError

    if not fts and index is None:
        raise EmbedfleetError("name the index: --fts (a full-text index of the content) or --index hnsw|binary")
    if fts_config is not None and not fts:
        raise EmbedfleetError(f"--fts-config {fts_config} configures --fts's full-text index: add --fts, or leave "
                              "--fts-config out")
    from embedfleet.pg.connect import connect
    from embedfleet.pg.ddl import embedding_info
    from embedfleet.pg.embedded import resolve_dsn
    from embedfleet.pg.fts import FTS_COLUMN, add_fts
    from embedfleet.pg.index_build import rebuild_index

    doc: dict = {"table": table}
    dsn = resolve_dsn(db, knobs())
    with connect(dsn) as conn:
        embedding_info(conn, table)  # one line for a table that is not there
        if index is not None:
            from embedfleet.pg.ddl import index_plan

            name, built = rebuild_index(conn, table, index, dsn)
            doc.update(index=index, index_name=name, index_built=built)
            vtype, dim = embedding_info(conn, table)
            words = index_plan(dim, vtype, index)[1]  # what `index` is at this width
        if fts:
            added, fts_config = add_fts(conn, table, fts_config)
            doc.update(fts=True, fts_config=fts_config, added=added, column=FTS_COLUMN)
    if json_out:
        emit(doc)
        return
    if index is not None:
        typer.echo(f"table {table!r}: {'built' if doc['index_built'] else 'already has'} its {index} index: "
                   f"{words} ({doc['index_name']})", err=True)
    if fts:
        typer.echo(f"table {table!r}: {'added' if doc['added'] else 'already has'} a full-text index ({fts_config}); "
                   "search --hybrid uses it", err=True)
