"""Export: a table's ids, columns and vectors to Parquet, .npy or JSON lines, streamed.

Rows leave PostgreSQL by one binary COPY per shard, parsed by psycopg as they arrive; each vector
comes as pgvector's own bytes and a block of them becomes one numpy array, so memory is one block
(plus one Parquet row group) whatever the table's size, and float32 (vector) or float16 (halfvec)
values are the stored bits. Everything is written under a temporary name beside the target and
renamed at the end: an export that is killed leaves nothing at the target name (its temporary is
removed by the next export to the same target).

Glossary:
  shard   one output file's share of the table: a range of its heap pages (ctid). Every shard reads
          under the snapshot of one REPEATABLE READ, READ ONLY transaction, so N shards written in
          parallel hold exactly the rows one would.
  block   rows parsed from a COPY stream together: ids, column values, one array of vectors.
  sink    what a format does with blocks (ParquetSink, JsonlSink, NpySink).

Layouts of `--out PATH`:
  parquet, jsonl  PATH is the file; with --shards N > 1, a directory of part-00000-of-0000N.* files
  npy             a directory: embeddings.npy (rows × dim), ids.txt (one id a line) and ids.parquet
                  (id and any --columns), rows in the same order in all three
  A directory also gets _export.json (table, rows, dim, dtype, columns, files).
"""

from __future__ import annotations

import logging

import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import orjson
import psycopg
from psycopg import sql

from embedfleet.errors import DatabaseError, InputError
from embedfleet.pg.ddl import embedding_info, heap_pages, table_sql
from embedfleet.pg.scan import begin_snapshot, export_snapshot, page_spans, span_sql, user_filter, where_error

log = logging.getLogger(__name__)

__all__ = ["FORMATS", "Block", "Column", "column_oids", "export", "read_blocks", "read_vectors", "shard_count", "table_columns"]

FORMATS = ("parquet", "npy", "jsonl")
DTYPES = ("float32", "float16")
ROW_GROUP_BYTES = 64 << 20  # one row group: a reader holds it whole, and a table has many to split work
BLOCK_BYTES = 16 << 20  # a block's rows in memory at once (text included)
_FIRST_BLOCK_ROWS = 2048  # until the first block tells how wide a row is
_BYTEA, _TEXT = 17, 25  # oids: vectors arrive as raw bytes; other types as text
# Types psycopg loads and Arrow stores natively; any other column is exported as its text.
_NATIVE = ("text", "character varying", "real", "double precision", "integer", "bigint", "smallint", "boolean",
           "timestamp with time zone", "timestamp without time zone", "date", "text[]")
_JSON = ("jsonb", "json")
_BE = {"vector": np.dtype(">f4"), "halfvec": np.dtype(">f2")}


@dataclass(frozen=True)
class Column:
    name: str
    regtype: str  # PostgreSQL's name of its type, e.g. "timestamp with time zone", "text[]"

    @property
    def native(self) -> bool:
        return self.regtype in _NATIVE

    @property
    def json(self) -> bool:
        return self.regtype in _JSON


@dataclass(frozen=True)
class Shard:
    """One shard's work, sent to a helper process (plain data: it pickles)."""

    index: int
    dsn: str
    snapshot: str | None
    select: str  # the COPY's SELECT, rendered
    count: str  # SELECT count(*) over the same rows
    oids: tuple[int, ...]
    vtype: str
    dim: int
    dtype: str
    fmt: str
    columns: tuple[Column, ...]  # besides id and the embedding
    path: str  # parquet/jsonl: this shard's file; npy: embeddings.npy, shared by every shard
    offset: int = 0  # npy: the first row this shard writes
    ids_txt: str = ""
    ids_parquet: str = ""
    where: str | None = None  # for error messages only


@dataclass
class Block:
    ids: list[str]
    values: list[tuple]  # one tuple of values per column, in Shard.columns order
    vectors: np.ndarray  # [rows, dim], the export's dtype


# --- reading ----------------------------------------------------------------------------------


def table_columns(conn: psycopg.Connection, table: str) -> list[Column]:
    """The table's columns but id and embedding, in table order."""
    rows = conn.execute(
        "SELECT attname, atttypid::regtype::text FROM pg_attribute WHERE attrelid = %s::regclass "
        "AND attnum > 0 AND NOT attisdropped AND attname NOT IN ('id', 'embedding') ORDER BY attnum",
        [table_sql(conn, table).as_string(conn)],
    ).fetchall()
    return [Column(n, t) for n, t in rows]


def pick_columns(available: list[Column], wanted: list[str] | None) -> tuple[Column, ...]:
    """--columns a,b as Columns (id and embedding always come, so naming them is a no-op). By default every column
    but the full-text index's tsvector, which only restates `content` (named, it comes too)."""
    if wanted is None:
        return tuple(c for c in available if c.name != "content_tsv")
    by_name = {c.name: c for c in available}
    out: list[Column] = []
    for name in wanted:
        if name in ("id", "embedding") or any(c.name == name for c in out):
            continue
        if name not in by_name:
            raise InputError(f"--columns: no column {name!r} in the table; it has: "
                             f"{', '.join(['id', *by_name, 'embedding'])}")
        out.append(by_name[name])
    return tuple(out)


def _select(table: sql.Composable, columns: tuple[Column, ...], where: str | None,
            pages: tuple[int, int | None] | None) -> tuple[sql.Composed, sql.Composed]:
    """(the COPY's SELECT, a count(*) of the same rows). Columns psycopg or Arrow cannot take as
    they are (jsonb, numeric, user types) are selected as text."""
    exprs = [sql.Identifier("id")]
    for c in columns:
        ident = sql.Identifier(c.name)
        exprs.append(ident if c.native else sql.SQL("{}::text").format(ident))
    exprs.append(sql.Identifier("embedding"))
    conds = []
    if where:
        conds.append(user_filter(where))
    if pages is not None and pages != (0, None):  # a TID range scan (PostgreSQL ≥ 14) reads only these pages
        conds.append(span_sql(pages))
    cond = sql.SQL(" WHERE ") + sql.SQL(" AND ").join(conds) if conds else sql.SQL("")
    return (sql.SQL("SELECT {} FROM {}{}").format(sql.SQL(", ").join(exprs), table, cond),
            sql.SQL("SELECT count(*) FROM {}{}").format(table, cond))


def column_oids(conn: psycopg.Connection, columns: tuple[Column, ...]) -> tuple[int, ...]:
    """The types a COPY of (id, `columns`, embedding) is read with: the vector as raw bytes, a
    column psycopg or Arrow cannot take as it is as text (what `_select` casts it to)."""
    oids = [_TEXT]
    for c in columns:
        oids.append(conn.execute("SELECT %s::regtype::oid", [c.regtype]).fetchone()[0] if c.native else _TEXT)
    return (*oids, _BYTEA)


def read_vectors(rows: list[tuple], vtype: str, dim: int, dtype: str) -> np.ndarray:
    """The last field of each COPY row (pgvector's binary vector: uint16 dim, uint16 0, big-endian
    float32, or float16 for halfvec) as one [rows, dim] array of `dtype`."""
    raw = [r[-1] for r in rows]
    if None in raw:
        rid = rows[raw.index(None)][0]
        raise DatabaseError(f"row {rid!r} has no embedding; `embedfleet verify` lists such rows")
    be = _BE[vtype]
    width = 4 + dim * be.itemsize
    buf = b"".join(raw)
    if len(buf) != width * len(raw):
        raise DatabaseError(f"vectors of another dimension than {dim} in the table; `embedfleet verify` lists them")
    a = np.frombuffer(buf, dtype=np.uint8).reshape(len(raw), width)
    if len(raw) and not (a[:, :2].copy().view(">u2") == dim).all():
        raise DatabaseError(f"vectors of another dimension than {dim} in the table; `embedfleet verify` lists them")
    return a[:, 4:].view(be).astype(dtype)  # a byte swap (or a cast the user asked for): the stored values


def read_blocks(cur: psycopg.Cursor, select: str, oids: tuple[int, ...], vtype: str, dim: int,
                dtype: str) -> Iterator[Block]:
    """Rows of `select` (id, other columns, embedding last; `oids` their types, see column_oids) in
    blocks of about BLOCK_BYTES, by one binary COPY on `cur`."""
    size = _FIRST_BLOCK_ROWS
    with cur.copy(sql.SQL("COPY ({}) TO STDOUT (FORMAT BINARY)").format(sql.SQL(select))) as copy:
        copy.set_types(oids)
        rows: list[tuple] = []
        for row in copy.rows():
            rows.append(row)
            if len(rows) >= size:
                block = _block(rows, vtype, dim, dtype)
                yield block
                size = _next_size(block)
                rows = []
        if rows:
            yield _block(rows, vtype, dim, dtype)


def _block(rows: list[tuple], vtype: str, dim: int, dtype: str) -> Block:
    cols = list(zip(*rows))
    return Block(list(cols[0]), cols[1:-1], read_vectors(rows, vtype, dim, dtype))


def _next_size(block: Block) -> int:
    """Rows for the next block so it holds about BLOCK_BYTES (long articles make few rows a block)."""
    n = len(block.ids)
    text = sum(sum(map(len, filter(None, col))) for col in block.values if any(isinstance(v, str) for v in col[:64]))
    per_row = block.vectors.nbytes / n + (text + sum(map(len, block.ids))) / n + 16 * len(block.values)
    return int(min(65536, max(64, BLOCK_BYTES // per_row)))


# --- writing ----------------------------------------------------------------------------------


def _arrow_type(c: Column):
    import pyarrow as pa

    return {
        "real": pa.float32(), "double precision": pa.float64(), "integer": pa.int32(), "bigint": pa.int64(),
        "smallint": pa.int16(), "boolean": pa.bool_(), "timestamp with time zone": pa.timestamp("us", tz="UTC"),
        "timestamp without time zone": pa.timestamp("us"), "date": pa.date32(), "text[]": pa.list_(pa.string()),
    }.get(c.regtype, pa.string())


def _arrow_schema(columns: tuple[Column, ...], dim: int | None, dtype: str):
    import pyarrow as pa

    fields = [pa.field("id", pa.string(), nullable=False)] + [pa.field(c.name, _arrow_type(c)) for c in columns]
    if dim is not None:
        value = pa.float16() if dtype == "float16" else pa.float32()
        fields.append(pa.field("embedding", pa.list_(value, dim)))  # a fixed-size list
    return pa.schema(fields)


class ParquetSink:
    """Blocks into a Parquet file, one row group per ROW_GROUP_BYTES of rows (the vector a
    fixed-size list, left out of dictionaries and statistics: they cost time and help no reader)."""

    def __init__(self, path: str, columns: tuple[Column, ...], dim: int | None, dtype: str, metadata: dict):
        import pyarrow.parquet as pq

        self.columns, self.dim, self.dtype = columns, dim, dtype
        self.schema = _arrow_schema(columns, dim, dtype).with_metadata({"embedfleet": orjson.dumps(metadata)})
        scalar = ["id"] + [c.name for c in columns]
        self.writer = pq.ParquetWriter(path, self.schema, compression="zstd", use_dictionary=scalar,
                                       write_statistics=scalar)
        self.pending: list = []
        self.pending_bytes = 0

    def write(self, block: Block) -> None:
        import pyarrow as pa

        arrays = [pa.array(block.ids, pa.string())]
        arrays += [pa.array(v, self.schema.field(i + 1).type) for i, v in enumerate(block.values)]
        if self.dim is not None:
            arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(block.vectors.reshape(-1)), self.dim))
        batch = pa.RecordBatch.from_arrays(arrays, schema=self.schema)
        self.pending.append(batch)
        self.pending_bytes += batch.nbytes
        if self.pending_bytes >= ROW_GROUP_BYTES:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if self.pending:
            table = pa.Table.from_batches(self.pending, schema=self.schema)
            self.writer.write_table(table, row_group_size=table.num_rows)
        self.pending, self.pending_bytes = [], 0

    def close(self) -> None:
        self._flush()
        self.writer.close()


class JsonlSink:
    """One JSON object a line: id, the columns (jsonb as JSON, not as a string), embedding."""

    def __init__(self, path: str, columns: tuple[Column, ...]):
        self.f = open(path, "wb")
        self.names = [c.name for c in columns]
        self.json = [c.json for c in columns]

    def write(self, block: Block) -> None:
        names = self.names
        values = [[orjson.Fragment(v) if v is not None else None for v in col] if is_json else col
                  for col, is_json in zip(block.values, self.json)]
        dumps, opt = orjson.dumps, orjson.OPT_SERIALIZE_NUMPY
        lines = []
        for i, rid in enumerate(block.ids):
            row = {"id": rid}
            for name, col in zip(names, values):
                row[name] = col[i]
            row["embedding"] = block.vectors[i]
            lines.append(dumps(row, option=opt, default=str))
        lines.append(b"")
        self.f.write(b"\n".join(lines))

    def close(self) -> None:
        self.f.close()


class NpySink:
    """Vectors into a shared embeddings.npy at this shard's rows; ids (and columns) beside."""

    def __init__(self, shard: Shard, header: int, metadata: dict):
        self.fd = os.open(shard.path, os.O_WRONLY)
        self.pos = header + shard.offset * shard.dim * np.dtype(shard.dtype).itemsize
        self.txt = open(shard.ids_txt, "w", encoding="utf-8", newline="\n")
        self.ids = ParquetSink(shard.ids_parquet, shard.columns, None, shard.dtype, metadata)

    def write(self, block: Block) -> None:
        data = np.ascontiguousarray(block.vectors).data
        while data:  # pwrite may write less than asked
            n = os.pwrite(self.fd, data, self.pos)
            self.pos += n
            data = data[n:]
        self.txt.write(_id_lines(block.ids))
        self.ids.write(block)

    def close(self) -> None:
        os.close(self.fd)
        self.txt.close()
        self.ids.close()


def _id_lines(ids: list[str]) -> str:
    """ids.txt's lines; a backslash, newline or carriage return in an id is written \\\\, \\n, \\r."""
    text = "\n".join(ids)
    if "\\" in text or "\r" in text or text.count("\n") != len(ids) - 1:
        text = "\n".join(i.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r") for i in ids)
    return text + "\n" if ids else ""


# --- one shard (inline, or in a helper process) --------------------------------------------------

_COUNTER = None  # helper processes: rows done per shard, shared with the parent for its progress bar


def _helper_init(counter, parent: int) -> None:
    global _COUNTER
    _COUNTER = counter
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()


def _exit_with_parent(parent: int) -> None:
    """An export killed with -9 cannot stop its helpers: they leave once it is gone."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _shard_conn(shard: Shard) -> psycopg.Connection:
    conn = psycopg.connect(shard.dsn, autocommit=True)  # its transaction: begun here, in the export's snapshot
    begin_snapshot(conn, shard.snapshot)
    return conn


def _count_in_helper(shard: Shard) -> int:
    with _shard_conn(shard) as conn, _where_errors(shard.where):
        return conn.execute(shard.count).fetchone()[0]


def _write_in_helper(shard: Shard, header: int, metadata: dict) -> int:
    def report(n: int) -> None:
        with _COUNTER.get_lock():
            _COUNTER[shard.index] += n

    with _shard_conn(shard) as conn:
        return write_shard(conn, shard, header, metadata, report)


def write_shard(conn: psycopg.Connection, shard: Shard, header: int, metadata: dict,
                report: Callable[[int], None]) -> int:
    """Stream the shard's rows into its sink on `conn` (already in the export's snapshot); its rows."""
    if shard.fmt == "parquet":
        sink = ParquetSink(shard.path, shard.columns, shard.dim, shard.dtype, metadata)
    elif shard.fmt == "jsonl":
        sink = JsonlSink(shard.path, shard.columns)
    else:
        sink = NpySink(shard, header, metadata)
    rows = 0
    try:
        with conn.cursor() as cur, _where_errors(shard.where):
            for block in read_blocks(cur, shard.select, shard.oids, shard.vtype, shard.dim, shard.dtype):
                sink.write(block)
                rows += len(block.ids)
                report(len(block.ids))
    finally:
        sink.close()
    return rows


@contextmanager
def _where_errors(where: str | None) -> Iterator[None]:
    """The server's errors as one actionable line; those a --where can cause (syntax, names, types, a
    write refused by the READ ONLY transaction) name the --where."""
    try:
        yield
    except psycopg.Error as e:
        if not e.sqlstate:  # the connection itself failed: psycopg's own message says how
            raise
        message = e.diag.message_primary or str(e)
        if where and e.sqlstate[:2] in ("42", "22", "25", "0A", "2B", "P0"):
            raise where_error(message, where) from None
        raise DatabaseError(f"export failed: {message}") from None


# --- the whole export ------------------------------------------------------------------------------


@dataclass
class _Target:
    """Where the export goes and the temporary it is built in."""

    final: Path
    tmp: Path
    is_dir: bool

    def file(self, name: str) -> str:
        return str(self.tmp / name) if self.is_dir else str(self.tmp)


def _target(out: str, fmt: str, shards: int) -> _Target:
    final = Path(out).expanduser().absolute()
    is_dir = fmt == "npy" or shards > 1
    if fmt == "npy" and final.suffix == ".npy":
        raise InputError(f"--out {out}: --format npy writes a directory (embeddings.npy, ids.txt, ids.parquet); "
                         "give a directory path")
    if not final.parent.is_dir():
        raise InputError(f"--out {out}: directory {final.parent} does not exist")
    if final.exists() and (final.is_dir() != is_dir or (is_dir and not _ours(final))):
        what = ("an earlier export as a directory (--format npy or shards): this one writes a file" if _ours(final)
                else "a directory that is not an embedfleet export") if final.is_dir() else "a file"
        raise InputError(f"--out {out} is {what}; remove it or choose another --out")
    _remove_stale(final)
    tmp = final.parent / f".{final.name}.export-{os.getpid()}.tmp"
    if is_dir:
        tmp.mkdir()
    return _Target(final, tmp, is_dir)


def _ours(path: Path) -> bool:
    return (path / "_export.json").is_file() or not any(path.iterdir())


def _remove_stale(final: Path) -> None:
    """Temporaries of exports to this target whose process is gone (killed: no cleanup ran)."""
    for p in final.parent.glob(f".{final.name}.export-*.tmp"):
        pid = p.name.rsplit("-", 1)[1][: -len(".tmp")]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _publish(target: _Target) -> None:
    """The finished export takes the target's name in one rename (an older export of ours moves aside first)."""
    if not target.is_dir:
        with open(target.tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(target.tmp, target.final)
        return
    for p in target.tmp.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    old = None
    if target.final.exists():
        old = target.final.parent / f".{target.final.name}.export-{os.getpid()}.old.tmp"
        os.rename(target.final, old)
    os.rename(target.tmp, target.final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# A part gets at least this many heap pages (128 kB): more parts than that only adds files and connections.
MIN_SHARD_PAGES = 16


def shard_count(pages: int, asked: int) -> int:
    """How many parts `--shards asked` writes of a table of `pages` heap pages: at most one per MIN_SHARD_PAGES."""
    return max(1, min(asked, pages // MIN_SHARD_PAGES))


def _page_ranges(conn: psycopg.Connection, table: str, shards: int) -> list[tuple[int, int | None]]:
    """`shards` page spans of the table's heap (`heap_pages`: a partitioned table's, its largest partition's,
    read from each) of about equal size; the last is open-ended."""
    return page_spans(heap_pages(conn, table)[0], shards)


def _estimate_rows(conn: psycopg.Connection, table: str) -> int | None:
    pages, per_page = heap_pages(conn, table)
    if not per_page:  # never analyzed
        return None
    return round(pages * per_page) or None


def export(dsn: str, table: str, fmt: str, out: str, *, where: str | None = None, columns: list[str] | None = None,
           dtype: str | None = None, shards: int = 1, progress: bool = True) -> dict:
    """Write `table` to `out` (see the module's docstring for layouts); returns a summary:
    table, format, out, rows, dim, dtype, vector_type, columns, files, seconds, bytes."""
    if fmt not in FORMATS:
        raise InputError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise InputError(f"--dtype {dtype!r}: choose float32 or float16")
    if shards < 1:
        raise InputError("--shards must be at least 1")
    t0 = time.perf_counter()
    with psycopg.connect(dsn) as conn:
        vtype, dim = embedding_info(conn, table)
        if vtype not in _BE:
            raise DatabaseError(f"table {table!r}: cannot export an embedding of type {vtype}")
        dtype = dtype or ("float16" if vtype == "halfvec" else "float32")
        all_columns = table_columns(conn, table)
        if columns is None and fmt == "npy":
            columns = []  # ids.parquet: just the ids unless asked
        chosen = pick_columns(all_columns, columns)
        if dim <= 0:  # a vector column declared without a dimension: take the first row's
            dim = conn.execute(sql.SQL("SELECT vector_dims(embedding) FROM {} LIMIT 1").format(
                table_sql(conn, table))).fetchone()
            dim = dim[0] if dim else 0
        oids = column_oids(conn, chosen)
        estimate = None if where else _estimate_rows(conn, table)
        asked, shards = shards, shard_count(heap_pages(conn, table)[0], shards)
        if shards < asked:
            log.info("--shards %d: table %s has %d pages, so %d part(s) of at least %d pages each", asked, table,
                     heap_pages(conn, table)[0], shards, MIN_SHARD_PAGES)
        conn.rollback()
        target = _target(out, fmt, asked)
        try:
            conn.autocommit = True
            begin_snapshot(conn)
            metadata = {"table": table, "vector_type": vtype, "dim": dim, "dtype": dtype}
            tasks = _shards(conn, dsn, table, fmt, chosen, where, shards, target, oids, vtype, dim, dtype,
                            parts=asked > 1)
            per_part = _run(conn, tasks, metadata, estimate, progress)
            rows = sum(per_part)
            files = _finish(target, tasks, fmt, per_part)
            summary = {"table": table, "format": fmt, "out": str(target.final), "rows": rows, "dim": dim,
                       "dtype": dtype, "vector_type": vtype, "columns": ["id", *(c.name for c in chosen), "embedding"],
                       "where": where, "shards": shards, "files": files}
            if target.is_dir:
                (target.tmp / "_export.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
            summary["bytes"] = sum(os.path.getsize(target.file(f)) for f in files)
            _publish(target)
        except BaseException:
            shutil.rmtree(target.tmp, ignore_errors=True) if target.is_dir else target.tmp.unlink(missing_ok=True)
            raise
        finally:
            if not conn.closed:
                conn.rollback()
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    return summary


def _shards(conn: psycopg.Connection, dsn: str, table: str, fmt: str, columns: tuple[Column, ...], where: str | None,
            shards: int, target: _Target, oids: tuple[int, ...], vtype: str, dim: int, dtype: str,
            parts: bool) -> list[Shard]:
    """The work of each shard; with more than one, under a snapshot exported from `conn`'s transaction.
    `parts`: the files are named as parts (part-00000-of-0000N), however many there are."""
    snapshot = export_snapshot(conn) if shards > 1 else None
    tasks = []
    for i, pages in enumerate(_page_ranges(conn, table, shards) if shards > 1 else [None]):
        select, count = _select(table_sql(conn, table), columns, where, pages)
        part = _part_name(i, shards) if parts else ""
        tasks.append(Shard(
            index=i, dsn=dsn, snapshot=snapshot, select=select.as_string(conn), count=count.as_string(conn),
            oids=oids, vtype=vtype, dim=dim, dtype=dtype, fmt=fmt, columns=columns,
            path=target.file("embeddings.npy" if fmt == "npy" else f"{part}.{fmt}" if part else ""),
            ids_txt=target.file(f"ids.txt.{part}" if part else "ids.txt"),
            ids_parquet=target.file(f"ids.parquet.{part}" if part else "ids.parquet"), where=where))
    return tasks


def _part_name(i: int, parts: int) -> str:
    return f"part-{i:05d}-of-{parts:05d}"


def _run(conn: psycopg.Connection, tasks: list[Shard], metadata: dict, estimate: int | None,
         progress: bool) -> list[int]:
    """Count (npy), lay out embeddings.npy, then write every shard: inline on `conn` for one shard,
    else on helper processes, one a core at most. Returns the rows each shard wrote."""
    bar = _Bar(progress, estimate)
    try:
        if len(tasks) == 1:
            shard = tasks[0]
            header, total = 0, None
            if shard.fmt == "npy":
                with _where_errors(shard.where):
                    total = conn.execute(shard.count).fetchone()[0]
                header = _lay_out_npy(shard.path, total, shard.dim, shard.dtype)
                bar.total(total)
            return [_check(write_shard(conn, shard, header, metadata, bar.advance), total)]
        import multiprocessing as mp

        spawn = mp.get_context("spawn")  # not fork: a child must not share the parent's libpq socket
        counter = spawn.Array("q", len(tasks))
        with ProcessPoolExecutor(min(len(tasks), os.cpu_count() or 1), mp_context=spawn, initializer=_helper_init,
                                 initargs=(counter, os.getpid())) as pool:
            header, total = 0, None
            if tasks[0].fmt == "npy":
                counts = list(pool.map(_count_in_helper, tasks))
                header = _lay_out_npy(tasks[0].path, sum(counts), tasks[0].dim, tasks[0].dtype)
                offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
                tasks = [replace(t, offset=o) for t, o in zip(tasks, offsets)]
                total = sum(counts)
                bar.total(total)
            futures = [pool.submit(_write_in_helper, t, header, metadata) for t in tasks]
            pending = set(futures)
            while pending:
                done, pending = wait(pending, timeout=0.25, return_when=FIRST_EXCEPTION)
                bar.set(sum(counter[:]))
                for f in done:
                    if f.exception() is not None:
                        for other in pending:
                            other.cancel()
                        raise f.exception()
            per_shard = [f.result() for f in futures]
            _check(sum(per_shard), total)
            return per_shard
    finally:
        bar.close()


def _check(rows: int, counted: int | None) -> int:
    """embeddings.npy was laid out for `counted` rows: exactly those must have been written."""
    if counted is not None and rows != counted:
        raise DatabaseError(f"export read {rows} rows where its snapshot counted {counted}; run it again")
    return rows


def _lay_out_npy(path: str, rows: int, dim: int, dtype: str) -> int:
    """embeddings.npy at its full size (sparse until written); returns where the rows begin."""
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": np.dtype(dtype).str, "fortran_order": False,
                                                 "shape": (rows, dim)})
        header = f.tell()
        f.truncate(header + rows * dim * np.dtype(dtype).itemsize)
    return header


def _finish(target: _Target, tasks: list[Shard], fmt: str, rows: list[int]) -> list[str]:
    """Join the shards' id files (npy), or leave out the parts that hold no row (renumbering the rest); the
    export's files, relative to its directory."""
    if fmt != "npy":
        if not target.is_dir:  # one file: named as it will be, not as it is being built
            return [target.final.name]
        names = [os.path.basename(t.path) for t in tasks]
        kept = [name for name, n in zip(names, rows) if n] or names[:1]  # no row at all: one part, its schema
        if len(kept) == len(names):
            return names
        for name in set(names) - set(kept):
            os.unlink(target.file(name))
        final = []
        for i, name in enumerate(kept):
            final.append(f"{_part_name(i, len(kept))}.{fmt}")
            os.rename(target.file(name), target.file(final[-1]))
        return final
    if len(tasks) > 1:
        import pyarrow.parquet as pq

        with open(target.file("ids.txt"), "wb") as out:
            for t in tasks:
                with open(t.ids_txt, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
                os.unlink(t.ids_txt)
        writer = None
        for t in tasks:
            part = pq.ParquetFile(t.ids_parquet)
            writer = writer or pq.ParquetWriter(target.file("ids.parquet"), part.schema_arrow, compression="zstd")
            for g in range(part.num_row_groups):
                writer.write_table(part.read_row_group(g))
            part.close()
            os.unlink(t.ids_parquet)
        writer.close()
    return ["embeddings.npy", "ids.txt", "ids.parquet"]


class _Bar:
    """A rich progress bar on stderr (rows, rows/s); a no-op when not wanted."""

    def __init__(self, enabled: bool, total: int | None):
        self.p = None
        if enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            self.p = Progress(TextColumn("export"), BarColumn(), TaskProgressColumn(), MofNCompleteColumn(),
                              TextColumn("{task.fields[rate]} rows/s"), TimeElapsedColumn(), TimeRemainingColumn(),
                              console=Console(stderr=True), transient=False)
            self.task = self.p.add_task("export", total=total, rate="-")
            self.t0 = time.perf_counter()
            self.p.start()

    def total(self, n: int) -> None:
        if self.p:
            self.p.update(self.task, total=n)

    def advance(self, n: int) -> None:
        if self.p:
            self.set(self.p.tasks[0].completed + n)

    def set(self, done: int) -> None:
        if self.p:
            rate = done / max(1e-9, time.perf_counter() - self.t0)
            self.p.update(self.task, completed=done, rate=f"{rate:,.0f}")

    def close(self) -> None:
        if self.p:
            t = self.p.tasks[0]
            if t.total is not None and t.completed > t.total:  # an estimate that was short
                self.p.update(self.task, total=t.completed)
            self.p.stop()
