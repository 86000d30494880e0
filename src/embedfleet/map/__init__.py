"""A map of a table: its vectors in two dimensions (UMAP), as one self-contained HTML page or a PNG.

The page is our own small canvas page (map/page.html), not a plotting library's: it draws 200k points
as pixels into one 2-D canvas image (no WebGL, so it renders the same in any browser, headless ones
included, and on machines without a GPU), finds the point under the mouse through a grid, and weighs
~70 kB of script where plotly's inlined bundle is ~4.5 MB. The data rides inside the page as JSON:
coordinates and colour codes as base64 typed arrays, hover columns dictionary-encoded, so it never
fetches anything.

Large tables are sampled (default 200,000 rows, a Bernoulli sample of the table, the same one for the
same seed), and the page says so. `--store-coords` writes the coordinates back into the table as
`map_x`, `map_y` (real): the sampled rows get theirs, every other row NULL, so a table never mixes
two maps; the columns' comments say which map they come from.

UMAP comes from cuML when it is importable (a GPU), else umap-learn: both the `map` extra
(`pip install 'embedfleet[map]'`), imported only when a map is made.
"""

from __future__ import annotations

import base64
import logging
import math
import os
import time
from dataclasses import dataclass
from datetime import date, datetime
from pathlib import Path

import numpy as np
import orjson
import psycopg
from psycopg import sql

from embedfleet.errors import InputError
from embedfleet.export import Column, column_oids, read_blocks, table_columns
from embedfleet.pg.ddl import embedding_info, table_sql

__all__ = ["COORD_COLUMNS", "MapData", "build_map", "categories", "layout", "render_html", "render_png",
           "require_map_extra", "store_coords"]

log = logging.getLogger(__name__)

DEFAULT_SAMPLE = 200_000
COORD_COLUMNS = ("map_x", "map_y")
MAX_CATEGORIES = 20  # colours a legend can hold and an eye can tell apart
SMALL_LAYOUT = 1000  # rows up to which t-SNE lays the map out, in a second or two
CONTENT_CHARS = 300  # hover text: enough to recognise a row, small enough for 200k rows in one page
VALUE_CHARS = 80
NUMERIC_BINS = 8
# Tableau 20 (categories) and viridis (ordered bins); grey for rows without a value and "other".
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
           "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5",
           "#393b79", "#637939")
SEQUENTIAL = ("#440154", "#46327e", "#365c8d", "#277f8e", "#1fa187", "#4ac16d", "#a0da39", "#fde725")
GREY = "#9a9a9a"
_NUMBERS = (int, float, datetime, date)


def require_map_extra() -> None:
    """One line naming the extra when umap-learn or matplotlib is missing (checked before any work)."""
    missing = []
    for module in ("umap", "matplotlib"):
        try:
            __import__(module)
        except ImportError:
            missing.append({"umap": "umap-learn"}.get(module, module))
    if missing:
        raise InputError(f"embedfleet map needs {' and '.join(missing)}: pip install 'embedfleet[map]'")


@dataclass
class MapData:
    """The rows a map shows: ids, hover columns (content first), colour values and vectors."""

    table: str
    total: int  # rows in the table
    ids: list[str]
    hover: dict[str, list]  # column -> values (content first), already cut for the page
    color_by: str | None
    color: list | None  # the colour column's values
    vectors: np.ndarray  # [rows, dim] float32


# --- reading ----------------------------------------------------------------------------------------


def _hover_columns(columns: list[Column]) -> list[Column]:
    """Columns a hover shows: all but JSON documents (too long to read in a tooltip) and old coordinates."""
    return [c for c in columns if not c.json and c.name not in COORD_COLUMNS]


def _limit(name: str) -> int:
    return CONTENT_CHARS if name == "content" else VALUE_CHARS


def _hover_expr(c: Column) -> sql.Composable:
    """The column as a hover shows it: text cut one character past its limit (so _hover_json knows it was cut)."""
    ident = sql.Identifier(c.name)
    limit = _limit(c.name) + 1
    if c.regtype in ("text", "character varying"):
        return sql.SQL("left({}, {})").format(ident, sql.Literal(limit))
    if c.regtype == "text[]":
        return sql.SQL("left(array_to_string({}, ', '), {})").format(ident, sql.Literal(limit))
    if c.native:
        return ident
    return sql.SQL("left({}::text, {})").format(ident, sql.Literal(limit))


def read_sample(conn: psycopg.Connection, table: str, sample: int, color_by: str | None, seed: int = 0) -> MapData:
    """Every row when the table has at most `sample`, else a Bernoulli sample of a few more, cut to `sample` at
    random (the same rows for the same seed)."""
    vtype, dim = embedding_info(conn, table)
    columns = table_columns(conn, table)
    by_name = {c.name: c for c in columns}
    if color_by is not None and color_by not in by_name:
        raise InputError(f"--color-by: no column {color_by!r} in table {table!r}; it has: "
                         f"{', '.join(c.name for c in columns)}")
    hover = _hover_columns(columns)
    exprs = [sql.Identifier("id")] + [_hover_expr(c) for c in hover]
    as_read = [_as_read(c) for c in hover]  # the types of what the SELECT yields
    if color_by:  # colours from the whole value (a text[] by its first element: arXiv's primary category)
        c = by_name[color_by]
        ident = sql.Identifier(c.name)
        if c.regtype == "numeric":  # an amount is a number to bin, not a label: read as a double
            c = Column(c.name, "double precision")
            ident = sql.SQL("{}::float8").format(ident)
        exprs.append(sql.SQL("{}[1]").format(ident) if c.regtype == "text[]" else
                     ident if c.native else sql.SQL("{}::text").format(ident))
        as_read.append(_as_read(c))
    total = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table_sql(conn, table))).fetchone()[0]
    source = table_sql(conn, table)
    if total > sample:
        # enough that a Bernoulli sample falls short of `sample` about never, however small: four standard
        # deviations and ten rows over (a fixed share over fell short for small samples)
        percent = min(100.0, 100.0 * (sample + 4 * sample ** 0.5 + 10) / total)
        source = sql.SQL("{} TABLESAMPLE BERNOULLI ({}) REPEATABLE ({})").format(
            source, sql.Literal(percent), sql.Literal(seed))
    select = sql.SQL("SELECT {}, embedding FROM {}").format(sql.SQL(", ").join(exprs), source)
    ids: list[str] = []
    values: list[list] = [[] for _ in as_read]
    vectors = []
    with conn.cursor() as cur:
        for block in read_blocks(cur, select.as_string(conn), column_oids(conn, tuple(as_read)), vtype, dim,
                                 "float32"):
            ids += block.ids
            for acc, col in zip(values, block.values):
                acc += col
            vectors.append(block.vectors)
    vecs = np.concatenate(vectors) if vectors else np.zeros((0, dim), np.float32)
    if len(ids) > sample:
        keep = np.sort(np.random.default_rng(seed).choice(len(ids), sample, replace=False))
        ids, vecs = [ids[i] for i in keep], vecs[keep]
        values = [[v[i] for i in keep] for v in values]
    color = values.pop() if color_by else None
    by_column = {c.name: v for c, v in zip(hover, values)}
    ordered = {"content": by_column.pop("content")} if "content" in by_column else {}
    return MapData(table, total, ids, {**ordered, **by_column}, color_by, color, vecs)


def _as_read(c: Column) -> Column:
    """What a hover or colour expression yields: the column's own type, or text where it was cast or cut."""
    return c if c.native and c.regtype != "text[]" else Column(c.name, "text")


# --- pure pieces --------------------------------------------------------------------------------------


def categories(values: list, limit: int = MAX_CATEGORIES) -> tuple[list[str], list[str], np.ndarray]:
    """(labels, colours, a code per value) for a legend. Few distinct values: one entry each, the most
    frequent first; numbers and times with many: NUMERIC_BINS quantile ranges in order; other values
    with many: the limit - 1 most frequent and "other". None is "(none)", in grey."""
    n = len(values)
    present = [v for v in values if v is not None]
    distinct = set(present)
    if len(distinct) > limit and present and all(isinstance(v, _NUMBERS) and not isinstance(v, bool) for v in present):
        return _bins(values)
    counts: dict = {}
    for v in present:
        counts[v] = counts.get(v, 0) + 1
    if present and all(isinstance(v, _NUMBERS) and not isinstance(v, bool) for v in present):
        ranked = sorted(counts)  # numbers and times in their own order, as a reader scans a scale
    else:
        ranked = sorted(counts, key=lambda v: (-counts[v], str(v)))
    top = ranked if len(ranked) <= limit else ranked[: limit - 1]
    index = {v: k for k, v in enumerate(top)}
    labels = [_label(v) for v in top]
    colours = [PALETTE[k % len(PALETTE)] for k in range(len(top))]
    other = none = None
    if len(ranked) > len(top):
        other = len(labels)
        labels.append(f"other ({len(ranked) - len(top):,} values)")
        colours.append(GREY)
    if len(present) < n:
        none = len(labels)
        labels.append("(none)")
        colours.append("#d0d0d0")
    codes = np.fromiter((none if v is None else index.get(v, other) for v in values), dtype=np.uint16, count=n)
    return labels, colours, codes


def _bins(values: list) -> tuple[list[str], list[str], np.ndarray]:
    present = [v for v in values if v is not None]
    kind = type(present[0])
    as_number = (lambda v: v.timestamp()) if kind is datetime else (lambda v: v.toordinal()) if kind is date else float
    x = np.array([as_number(v) for v in present], dtype=np.float64)
    edges = np.unique(np.quantile(x, np.linspace(0, 1, NUMERIC_BINS + 1)))
    inner = edges[1:-1]
    shown = [present[int(np.argmin(np.abs(x - e)))] for e in edges]  # each edge as a value of the column
    labels = [f"{_label(shown[k])} – {_label(shown[k + 1])}" for k in range(len(edges) - 1)] or [_label(present[0])]
    colours = [SEQUENTIAL[round(k * (len(SEQUENTIAL) - 1) / max(1, len(labels) - 1))] for k in range(len(labels))]
    missing = np.array([v is None for v in values], dtype=bool)
    codes = np.full(len(values), len(labels), dtype=np.uint16)  # "(none)", if any value is missing
    codes[~missing] = np.searchsorted(inner, x, side="right")
    if missing.any():
        labels.append("(none)")
        colours.append("#d0d0d0")
    return labels, colours, codes


def _label(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, datetime):
        return v.strftime("%Y-%m-%d %H:%M")
    return str(v)


def _hover_json(name: str, values: list) -> dict:
    """A column for the page, long text cut with "…": as it is when nearly every value differs (ids,
    content), else its distinct values once and a code per row."""
    limit = _limit(name)
    cells = [None if v is None else _label(v) for v in values]
    cells = [c[:limit] + "…" if c is not None and len(c) > limit else c for c in cells]
    distinct: dict = {}
    codes = [distinct.setdefault(c, len(distinct)) for c in cells]
    if len(distinct) > 0.5 * len(cells):
        return {"values": cells, "codes": None}
    return {"values": list(distinct), "codes": _b64(np.array(codes, dtype=np.uint32))}


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes()).decode()


# --- layout, pages, coordinates ----------------------------------------------------------------------


def layout(vectors: np.ndarray, seed: int = 0, n_neighbors: int = 15, min_dist: float = 0.1) -> tuple[np.ndarray, str]:
    """2-D coordinates [rows, 2] float32 (cosine) and which method made them: t-SNE for a small table
    (umap-learn's start-up alone, its functions compiling, takes far longer), else UMAP."""
    n = len(vectors)
    if n < 3:  # UMAP needs neighbours; one or two points go on a line
        return np.stack([np.arange(n, dtype=np.float32), np.zeros(n, np.float32)], axis=1), "none"
    if n <= SMALL_LAYOUT:
        from sklearn.manifold import TSNE  # umap-learn's own dependency: installed with the map extra

        coords = TSNE(n_components=2, metric="cosine", init="pca", perplexity=min(30.0, (n - 1) / 3),
                      random_state=seed).fit_transform(vectors)
        return np.asarray(coords, dtype=np.float32), "t-sne"
    neighbours = max(2, min(n_neighbors, n - 1))
    try:
        from cuml.manifold import UMAP as GpuUMAP  # noqa: N811

        coords = GpuUMAP(n_components=2, n_neighbors=neighbours, min_dist=min_dist, metric="cosine",
                         random_state=seed).fit_transform(vectors)
        return np.asarray(getattr(coords, "get", lambda: coords)(), dtype=np.float32), "cuml"
    except ImportError:
        pass
    except Exception as e:  # a cuML that imports but cannot run here (no GPU): the CPU one still can
        log.warning("cuML's UMAP failed (%s); using umap-learn", str(e).splitlines()[0] if str(e) else type(e).__name__)
    import umap

    # no random_state: umap-learn then runs on every core (with one it is serial)
    reducer = umap.UMAP(n_components=2, n_neighbors=neighbours, min_dist=min_dist, metric="cosine")
    return np.asarray(reducer.fit_transform(vectors), dtype=np.float32), "umap-learn"


def _note(data: MapData, method: str) -> str:
    shown = len(data.ids)
    what = (f"{shown:,} of {data.total:,} rows, a random sample (--sample to change)" if shown < data.total
            else f"all {shown:,} rows")
    how = {"t-sne": "t-SNE (scikit-learn", "none": "a line (too few rows to lay out"}.get(method, f"UMAP ({method}")
    return f"{what} · {how}, cosine) of {data.vectors.shape[1]}-dimensional vectors"


def _colours(data: MapData) -> tuple[list[str], list[str], np.ndarray]:
    if data.color is None:
        return ["all rows"], [PALETTE[0]], np.zeros(len(data.ids), dtype=np.uint16)
    return categories(data.color)


def render_html(data: MapData, coords: np.ndarray, path: str, method: str) -> None:
    labels, colours, codes = _colours(data)
    doc = {
        "title": f"{data.table}", "note": _note(data, method), "n": len(data.ids),
        "x": _b64(coords[:, 0].astype(np.float32)), "y": _b64(coords[:, 1].astype(np.float32)),
        "color": {"name": data.color_by, "labels": labels, "colors": colours, "codes": _b64(codes)},
        "hover": [{"name": "id", "values": data.ids, "codes": None}]
        + [{"name": name, **_hover_json(name, values)} for name, values in data.hover.items()],
    }
    # "<" only occurs inside JSON strings, where \u003c means the same: no "</script>" can end the block early
    payload = orjson.dumps(doc).replace(b"<", b"\\u003c")
    template = (Path(__file__).with_name("page.html")).read_bytes()
    page = template.replace(b"/*EMBEDFLEET_DATA*/", payload, 1).replace(
        b"<title>embedfleet map</title>", f"<title>{_escape(data.table)} · embedfleet map</title>".encode(), 1)
    _write_atomically(path, page)


def _escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def render_png(data: MapData, coords: np.ndarray, path: str, method: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed

    labels, colours, codes = _colours(data)
    fig = Figure(figsize=(12, 9), dpi=150, layout="constrained")
    ax = fig.add_subplot()
    size = float(np.clip(3000 / max(1, len(codes)) ** 0.75, 0.3, 12))
    for k, (label, colour) in enumerate(zip(labels, colours)):
        mask = codes == k
        if mask.any():
            ax.scatter(coords[mask, 0], coords[mask, 1], s=size, c=colour, label=label, linewidths=0, rasterized=True)
    ax.set_title(f"{data.table}\n{_note(data, method)}", fontsize=10)
    ax.set_xticks([])
    ax.set_yticks([])
    if data.color_by:
        ax.legend(title=data.color_by, markerscale=max(1.0, 6 / math.sqrt(size)), loc="center left",
                  bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    tmp = _tmp(path)
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _tmp(path: str) -> str:
    p = Path(path)
    return str(p.with_name(f".{p.name}.map-{os.getpid()}.tmp"))


def _write_atomically(path: str, data: bytes) -> None:
    tmp = _tmp(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_coord_columns(conn: psycopg.Connection, table: str) -> None:
    """`map_x` and `map_y` are map's to write only where it made them (their comment says so) or they are not there:
    a column of the user's own of that name is never written over."""
    t = table_sql(conn, table).as_string(conn)
    for col in COORD_COLUMNS:
        row = conn.execute("SELECT format_type(atttypid, atttypmod), col_description(attrelid, attnum) FROM pg_attribute "
                           "WHERE attrelid = %s::regclass AND attname = %s AND NOT attisdropped", [t, col]).fetchone()
        if row and not (row[0] == "real" and (row[1] or "").startswith("embedfleet map:")):
            raise InputError(f"--store-coords: table {table!r} has a column {col!r} of its own (not one map wrote): "
                             "it would be written over; rename it, or leave out --store-coords")


def store_coords(conn: psycopg.Connection, table: str, ids: list[str], coords: np.ndarray, note: str) -> None:
    """map_x, map_y (real) for the mapped rows, NULL for every other row, in one transaction."""
    t = table_sql(conn, table)
    x, y = (sql.Identifier(c) for c in COORD_COLUMNS)
    with conn.transaction():
        conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} real, ADD COLUMN IF NOT EXISTS {} real").format(
            t, x, y))
        conn.execute(sql.SQL("UPDATE {t} SET {x} = NULL, {y} = NULL WHERE {x} IS NOT NULL OR {y} IS NOT NULL").format(
            t=t, x=x, y=y))
        conn.execute("CREATE TEMP TABLE embedfleet_map_coords (id text PRIMARY KEY, x real, y real) ON COMMIT DROP")
        with conn.cursor().copy("COPY embedfleet_map_coords (id, x, y) FROM STDIN") as copy:
            for rid, (cx, cy) in zip(ids, coords.tolist()):
                copy.write_row((rid, cx, cy))
        conn.execute(sql.SQL("UPDATE {t} SET {x} = c.x, {y} = c.y FROM embedfleet_map_coords c WHERE {t}.id = c.id"
                             ).format(t=t, x=x, y=y))
        for col in (x, y):
            conn.execute(sql.SQL("COMMENT ON COLUMN {}.{} IS {}").format(t, col, sql.Literal(f"embedfleet map: {note}")))


def build_map(dsn: str, table: str, outs: list[str], *, color_by: str | None = None, sample: int = DEFAULT_SAMPLE,
              store: bool = False, seed: int = 0) -> dict:
    """Read (a sample of) `table`, lay it out with UMAP, write each of `outs` (.html or .png), and
    optionally store the coordinates. Returns a summary: table, rows, total, method, outs, seconds."""
    for out in outs:
        suffix = Path(out).suffix.lower()
        if suffix not in (".html", ".htm", ".png"):
            raise InputError(f"--out {out}: write a .html page or a .png image")
        if not Path(out).expanduser().absolute().parent.is_dir():
            raise InputError(f"--out {out}: directory {Path(out).parent} does not exist")
    if sample < 1:
        raise InputError("--sample must be at least 1")
    require_map_extra()
    times = {}
    t0 = time.perf_counter()
    with psycopg.connect(dsn, autocommit=True) as conn:
        if store:
            check_coord_columns(conn, table)
        with conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            data = read_sample(conn, table, sample, color_by, seed)
        times["read_s"] = time.perf_counter() - t0
        if not data.ids:
            raise InputError(f"table {table!r} has no rows to map" + (" (it is empty)" if not data.total else ""))
        log.info("map: %s rows of %s read in %.1f s; laying them out…", f"{len(data.ids):,}", f"{data.total:,}", times["read_s"])
        t1 = time.perf_counter()
        coords, method = layout(data.vectors, seed)
        # `umap_s` is the name scripts read; `layout_s` is what it is whatever the method
        times["umap_s"] = times["layout_s"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        for out in outs:
            (render_png if Path(out).suffix.lower() == ".png" else render_html)(data, coords, out, method)
        times["render_s"] = time.perf_counter() - t2
        if store:
            t3 = time.perf_counter()
            store_coords(conn, table, data.ids, coords, f"{_note(data, method)}, {datetime.now():%Y-%m-%d %H:%M}")
            times["store_s"] = time.perf_counter() - t3
    return {"table": table, "rows": len(data.ids), "total": data.total, "method": method,
            "outs": [str(Path(o).absolute()) for o in outs], "stored": list(COORD_COLUMNS) if store else [],
            **{k: round(v, 3) for k, v in times.items()}, "seconds": round(time.perf_counter() - t0, 3)}
