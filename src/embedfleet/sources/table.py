"""PostgreSQL tables as inputs (`--from-table`): a table's rows are the records, its columns their fields.

A source is planned as page spans (each read by a TID range scan, `pg.scan`), under the snapshot the job's
planner exported while it still holds it (else each read's own: rows a sync's queue will bring anyway). A row's
"line" is its ctid as one number, block × 65536 + item: a chunk's cursor is the last row committed, and a
reject names the row.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import orjson
import psycopg
from psycopg import sql

from embedfleet.errors import InputError
from embedfleet.pg.scan import begin_snapshot, user_filter
from embedfleet.sources.base import RawRecord
from embedfleet.sources.plan import ChunkSpec

__all__ = ["TableSource", "TableReader", "source_loaders", "describe", "check_fields", "resolve_columns", "text_columns", "plan_table",
           "LINE_ITEMS", "table_line", "key_line"]

log = logging.getLogger(__name__)

LINE_ITEMS = 1 << 16  # items a heap page can hold, with room to spare: a line is block × this + item
PAGE = 8192
_LINE = sql.SQL("(((ctid::text::point)[0])::bigint * 65536 + ((ctid::text::point)[1])::bigint)")

# A source column's type as the target table's column type (`--columns`), by PostgreSQL's own type names.
_TARGET = {
    "smallint": "integer", "integer": "integer", "bigint": "bigint", "real": "real", "double precision": "double",
    "numeric": "numeric",
    "boolean": "bool", "date": "date", "timestamp with time zone": "timestamptz",
    "timestamp without time zone": "timestamptz", "json": "jsonb", "jsonb": "jsonb", "text[]": "text[]",
    "character varying[]": "text[]",
}
_TEXT = ("text", "character varying", "character", "citext", "name")


@dataclass(frozen=True)
class TableSource:
    name: str  # schema-qualified, quoted where it must be: what the job names and its chunks read
    schema: str
    table: str
    key: str | None  # the single-column primary key, if there is one
    columns: dict[str, str]  # every column: its type as format_type writes it
    unique: frozenset[str] = frozenset()  # the columns a unique index (or the key) holds alone, for every row
    leaves: tuple[str, ...] = ()  # a partitioned table's partitions that hold rows (qualified): what is read
    typmods: dict[str, str] | None = None  # every column's type with its modifier (`character(8)`)


def alias_of(qualified: str) -> str:
    """The bare name (as SQL writes it) of a qualified `schema.table`: what a --where may call the table
    (`reviews.stars`); every read of a source, and the check of its --where, names the table so."""
    from embedfleet.pg.ddl import QUALIFIED

    found = QUALIFIED.match(qualified)
    return found.group(2) if found else qualified


def table_line(block: int, item: int) -> int:
    return block * LINE_ITEMS + item


def _oid(conn: psycopg.Connection, name: str) -> int | None:
    try:
        with conn.transaction():
            return conn.execute("SELECT to_regclass(%s)::oid", [name]).fetchone()[0]
    except (psycopg.errors.InvalidName, psycopg.errors.InvalidSchemaName):
        return None
    except psycopg.errors.InsufficientPrivilege as e:  # the schema's USAGE: said for the source's role and database
        role, db = conn.execute("SELECT quote_ident(current_user), current_database()").fetchone()
        schema = name.rpartition(".")[0] or "its schema"
        raise InputError(f"--from-table {name}: role {role} may not use {schema} in database {db} "
                         f"({e.diag.message_primary}): GRANT USAGE ON SCHEMA {schema} TO {role}, or name another "
                         "role in --source-db (or --db where the source is there)") from None


def describe(conn: psycopg.Connection, name: str) -> TableSource:
    """The source table `name` ([SCHEMA.]NAME as SQL reads it, else as written: `Reviews` finds "Reviews" where
    there is no reviews), or one line saying why it cannot be read."""
    oid = _oid(conn, name)
    if oid is None and '"' not in name:  # the name as written (`Reviews`), as --table takes it, where SQL finds none
        from embedfleet.pg.ddl import table_sql

        oid = _oid(conn, table_sql(conn, name).as_string(conn))
    if oid is None:
        db = conn.execute("SELECT current_database()").fetchone()[0]
        raise InputError(f"--from-table {name}: no such table in database {db} (a table in another database: "
                         "--source-db DSN)")
    schema, table, kind, qualified = conn.execute(
        "SELECT n.nspname, c.relname, c.relkind, format('%%I.%%I', n.nspname, c.relname) FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = %s", [oid]).fetchone()
    if kind == "m":
        raise InputError(f"--from-table {name}: is a materialized view, which embedfleet does not read (a "
                         "trigger cannot follow it either); read its query's tables, or CREATE TABLE … AS SELECT "
                         "from it")
    if kind not in ("r", "p"):
        raise InputError(f"--from-table {name}: is not a table (a view or foreign table has no pages to read)")
    leaves = ()
    if kind == "p":  # the parent holds no rows: its partitions' pages are read
        parts = conn.execute(
            "SELECT format('%%I.%%I', n.nspname, c.relname), c.relkind FROM pg_partition_tree(%s) p "
            "JOIN pg_class c ON c.oid = p.relid JOIN pg_namespace n ON n.oid = c.relnamespace WHERE p.isleaf "
            "ORDER BY 1", [oid]).fetchall()
        if other := [p for p, k in parts if k != "r"]:
            raise InputError(f"--from-table {name}: partition {other[0]} is not a table of this server (a foreign "
                             "table has no pages to read); embed the other partitions by name")
        leaves = tuple(p for p, _ in parts)
    if not conn.execute("SELECT has_table_privilege(%s, 'SELECT')", [oid]).fetchone()[0]:
        role = conn.execute("SELECT quote_ident(current_user)").fetchone()[0]
        raise InputError(f"--from-table {name}: role {role} cannot read it: GRANT SELECT ON {qualified} TO {role}")
    described = conn.execute(
        "SELECT attname, format_type(atttypid, NULL), format_type(atttypid, atttypmod) FROM pg_attribute "
        "WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped ORDER BY attnum", [oid]).fetchall()
    columns = {c: t for c, t, _ in described}
    keys = conn.execute(
        "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
        "WHERE i.indrelid = %s AND i.indisprimary", [oid]).fetchall()
    unique = conn.execute(  # one column, no expression, no predicate: unique over every row
        "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] "
        "WHERE i.indrelid = %s AND i.indisunique AND i.indnkeyatts = 1 AND i.indexprs IS NULL AND i.indpred IS NULL",
        [oid]).fetchall()
    return TableSource(qualified, schema, table, keys[0][0] if len(keys) == 1 else None, columns,
                       frozenset(u for (u,) in unique), leaves, {c: t for c, _, t in described})


def text_columns(source: TableSource) -> list[str]:
    return [c for c, t in source.columns.items() if t in _TEXT]


def check_fields(source: TableSource, key: str | None, text_field: str | None, template_fields: list[str],
                 columns: list[str]) -> str:
    """The id column, after checking every field the job names exists (and the text's is text): one line else."""
    have = ", ".join(source.columns)
    key = key or source.key
    if key is None:
        raise InputError(f"--from-table {source.name}: no usable key (it has no single-column primary key); "
                         f"name a unique column with --id-field (columns: {have})")
    for flag, names in (("--id-field", [key]), ("--text-field", [text_field] if text_field else []),
                        ("--text-template", [f if f in source.columns else f.split(".")[0] for f in template_fields]), ("--columns", columns)):
        for n in names:  # (a template's `meta.tag` is a path into the column meta, a jsonb)
            if n not in source.columns:
                raise InputError(f"{flag} {n!r}: {source.name} has no such column (columns: {have})")
    if text_field and source.columns[text_field] not in _TEXT:
        raise InputError(f"--text-field {text_field!r}: {source.name}.{text_field} is {source.columns[text_field]}, "
                         f"not text (text columns: {', '.join(text_columns(source)) or 'none'}); "
                         "use --text-template to format other types")
    return key


def resolve_columns(source: TableSource, columns: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """`--columns a,b` as NAME:TYPE, each typed as the source column is (a type the target cannot hold: text)."""
    from embedfleet.sources.presets import parse_columns

    if not columns:
        return None
    out = []
    for spec in columns:
        name, _, kind = spec.strip().partition(":")
        out.append(f"{name}:{kind or _TARGET.get(source.columns.get(name, ''), 'text')}")
    parse_columns(out)  # a type named wrong is one line now, before a job is recorded
    return tuple(out)


def plan_table(conn: psycopg.Connection, source: TableSource, chunk_bytes: int) -> list[ChunkSpec]:
    """Page spans of about `chunk_bytes` each, the last of each relation open-ended (of a partitioned table, its
    partitions'); a relation of no pages gives none."""
    step = max(1, chunk_bytes // PAGE)
    chunks = []
    for relation in source.leaves or (source.name,):
        pages = conn.execute("SELECT pg_relation_size(%s::regclass) / current_setting('block_size')::int",
                             [relation]).fetchone()[0]
        starts = list(range(0, pages, step))
        chunks += [ChunkSpec(relation, "table", a, b, table_line(a, 0) + 1) for a, b in zip(starts, starts[1:] + [-1])]
    return chunks


_INTEGER_KEYS = ("smallint", "integer", "bigint")


def key_line(key: str, key_type: str) -> int:
    """Where a row's reject is kept (the rejects' `line`), by its key, so the backfill's and a sync's drain's
    rejects of one row are one: an integer key itself, another key's hash."""
    if key_type in _INTEGER_KEYS:
        return int(key)
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=6).digest(), "big")


def text_copies(columns: tuple[str, ...] | None) -> sql.Composable:
    """`, "c"::text AS "c"` for each `--columns` entry copied as text (`NAME:text`): selected after `*`, the text
    PostgreSQL writes takes the place of the value Python reads (an int[], a range, a bytea), since a row's
    dict keeps the later of two columns of one name."""
    names = [c.rpartition(":")[0] for c in columns or () if c.rpartition(":")[2].strip().lower() == "text"]
    return sql.SQL("").join(sql.SQL(", {0}::text AS {0}").format(sql.Identifier(n)) for n in names)


def key_text(key: str) -> sql.Composable:
    """A row's id: its key as PostgreSQL writes it as text, the spelling a sync's queue and its deletes use
    (Python's would differ: `1E-10` against `0.0000000001`, a char(n)'s padding)."""
    return sql.SQL("{}::text").format(sql.Identifier(key))


def read_rows(cur: psycopg.Cursor, query: sql.Composable, key: str, params=None) -> tuple[list[str], list[tuple]]:
    """(column names, rows) of a query selecting `key_text(key)` first, then the row's columns: each row with
    its key's column holding that text."""
    cur.execute(query, params)
    names = [d.name for d in cur.description][1:]
    at = names.index(key)
    return names, [(*row[1:at + 1], row[0], *row[at + 2:]) for row in cur.fetchall()]


class _Lenient:
    """A loader that gives the text of a value Python cannot hold (a date past 9999 or BC, `infinity`) instead
    of failing the whole read: a field the job uses then rejects its row, saying why; one it does not is no harm."""

    def load(self, data):
        try:
            return super().load(data)
        except psycopg.DataError:
            return bytes(data).decode()


# The source's types read as Python values: those `--columns` copies typed (_TARGET), the text types, and arrays (a
# template joins their items). Every other type is read as PostgreSQL writes it, the text a template should get:
# Python's would be another value (an interval's months as 30 days, a bytea decoded). A column copied as text is
# selected as `::text` besides (`text_copies`).
_PYTHON_TYPES = ("int2", "int4", "int8", "float4", "float8", "numeric", "bool", "date", "timestamp", "timestamptz",
                 "json", "jsonb", "text", "varchar", "bpchar", "name", "_text", "_varchar")


def source_loaders(conn: psycopg.Connection, table: str) -> psycopg.Connection:
    """`conn` reading `table`'s rows: dates and timestamps Python cannot hold as their text (`_Lenient`), and the
    table's columns of any type but _PYTHON_TYPES and arrays as PostgreSQL's text (those types only: `conn` may be
    a sync's target connection too)."""
    from psycopg.types import datetime as dt
    from psycopg.types.string import TextLoader

    for name, base in (("date", dt.DateLoader), ("timestamp", dt.TimestampLoader),
                       ("timestamptz", dt.TimestamptzLoader)):
        conn.adapters.register_loader(name, type(f"Lenient{base.__name__}", (_Lenient, base), {}))
    # a domain's values come as its base type's
    others = conn.execute(
        "SELECT DISTINCT b.oid FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid "
        "JOIN pg_type b ON b.oid = CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE t.oid END "
        "WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped AND b.typname <> ALL(%s) "
        "AND b.typcategory <> 'A'",
        [table, list(_PYTHON_TYPES)]).fetchall()
    if not conn.autocommit:
        conn.rollback()  # a span's read begins its own transaction, in the job's snapshot
    for (oid,) in others:
        conn.adapters.register_loader(oid, TextLoader)
    return conn


class TableReader:
    """Reads page spans of one job's source on one connection, in the job's snapshot while it is held."""

    def __init__(self, dsn: str, table: str, key: str, snapshot: str | None = None, where: str | None = None,
                 columns: tuple[str, ...] | None = None):
        self.dsn, self.table, self.snapshot, self.where, self.key = dsn, table, snapshot, where, key
        self.copies = text_copies(columns)
        self.alias = sql.SQL(alias_of(table))
        self.conn: psycopg.Connection | None = None
        self.key_type: str | None = None

    def read(self, spec: ChunkSpec, after_line: int = 0) -> Iterator[RawRecord]:
        """Rows of the span whose line is > `after_line`, in heap order."""
        from embedfleet.pg.connect import connect

        if self.conn is None or self.conn.closed:
            self.conn = source_loaders(connect(self.dsn), self.table)
        conn = self.conn
        self._begin(conn)
        try:
            lo = max(after_line + 1, spec.first_line)
            cond = [sql.SQL("ctid >= {}::tid").format(sql.Literal(f"({lo // LINE_ITEMS},{lo % LINE_ITEMS})"))]
            if spec.end >= 0:
                cond.append(sql.SQL("ctid < {}::tid").format(sql.Literal(f"({spec.end},0)")))
            if self.where:
                cond.append(user_filter(self.where))
            query = sql.SQL("SELECT {key}, {line} AS line, *{copies} FROM {src} AS {alias} WHERE {cond}").format(
                key=key_text(self.key), line=_LINE, copies=self.copies, src=sql.SQL(spec.source), alias=self.alias,
                cond=sql.SQL(" AND ").join(cond))
            with conn.cursor() as cur:
                names, rows = read_rows(cur, query, self.key)
        finally:
            conn.rollback()
        for line, *values in rows:
            data = dict(zip(names[1:], values))
            yield RawRecord(spec.source, line, data, orjson.dumps(data, default=str).decode(), None)

    def name_rejects(self, raws: list[RawRecord], rejects: list) -> list:
        """The span's rejects kept by their rows' keys (`key_line`), not by where the rows lay in the heap: what
        `jobs rejects` shows, and what a later sync of the row clears."""
        if not rejects:
            return rejects
        if self.key_type is None:
            self.key_type = self.conn.execute(
                "SELECT format_type(atttypid, NULL) FROM pg_attribute WHERE attrelid = %s::regclass AND attname = %s",
                [self.table, self.key]).fetchone()[0]
            self.conn.rollback()  # a span's read begins its own transaction, in the job's snapshot
        keys = {r.line: r.data[self.key] for r in raws if r.data is not None and r.data[self.key] is not None}
        return [dataclasses.replace(j, line=key_line(keys[j.line], self.key_type)) if j.line in keys else j
                for j in rejects]

    def _begin(self, conn: psycopg.Connection) -> None:
        if self.snapshot:
            try:
                begin_snapshot(conn, self.snapshot)
                return
            except psycopg.Error:  # the planner's transaction has ended (a resumed job): this read's own snapshot
                conn.rollback()
                log.info("the job's snapshot is gone (its planner has ended): reading in snapshots of this process's own")
                self.snapshot = None
        begin_snapshot(conn)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
