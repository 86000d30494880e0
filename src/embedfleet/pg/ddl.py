"""DDL: the ledger (schema `embedfleet`) and the target tables. Identifiers always go through
psycopg's `sql.Identifier`; names we cannot use are refused with a clear message."""

from __future__ import annotations

import os
import re
import time
from typing import Sequence

import psycopg
from psycopg import sql

from embedfleet.errors import DatabaseError, InputError
from embedfleet.pg.binary_code import code_expression, code_words

SCHEMA = "embedfleet"  # the ledger's schema
PG_MIN = 130000  # PostgreSQL 13
PGVECTOR_MIN, HALFVEC_MIN = (0, 5), (0, 7)  # HNSW came in pgvector 0.5, halfvec in 0.7

def check_identifier(name: str, what: str = "table") -> str:
    """PostgreSQL identifiers: 1–63 bytes, no NUL. Anything else is quoted, never spliced."""
    if not name or not name.strip():
        raise InputError(f"--{what} name is empty")
    if "\x00" in name:
        raise InputError(f"--{what} {name!r}: NUL characters cannot appear in a name")
    if max(len(part.encode()) for part in name.split(".", 1)) > 63:
        raise InputError(f"--{what} {name!r}: longer than PostgreSQL's 63-byte limit; pass a shorter --{what}")
    if name.lower().startswith("pg_"):
        raise InputError(f"--{what} {name!r}: names starting with pg_ are reserved by PostgreSQL")
    return name


# [schema.]name, each part bare or double-quoted as SQL writes it
QUALIFIED = re.compile(r'^(?:("(?:[^"]|"")*"|[^".]+)\.)?("(?:[^"]|"")*"|[^".]+)$')


def _unquoted(part: str) -> str:
    return part[1:-1].replace('""', '"') if len(part) > 1 and part[0] == part[-1] == '"' else part


def split_table(conn: psycopg.Connection, table: str) -> tuple[str | None, str]:
    """(schema, name): `schema.name` where `schema` exists in the database, else the whole string is one
    name in the search path (a file stem such as "reviews.v2" stays one table name). Written as SQL quotes it
    (`"MixedCase"`, `public."My Table"`), the quoted parts are the names."""
    if '"' in table and (found := QUALIFIED.match(table)) and '"' in (found.group(1) or "") + found.group(2)[:1] + found.group(2)[-1:]:
        return (_unquoted(found.group(1)) if found.group(1) else None), _unquoted(found.group(2))
    schema, dot, name = table.partition(".")
    if dot and name and conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", [schema]).fetchone():
        return schema, name
    return None, table


def join_name(schema: str, name: str) -> str:
    """`schema.name` as `split_table` reads it back: plain where it can be (`public.papers_embeddings`), written
    as SQL quotes it where a dot in the schema or a double quote would be read otherwise."""
    if "." in schema or '"' in schema + name:
        return sql.Identifier(schema, name).as_string(None)
    return f"{schema}.{name}"


def qualified(conn: psycopg.Connection, table: str) -> str:
    """`table` schema-qualified: in the schema it is in, else the one CREATE TABLE would put it in."""
    if split_table(conn, table)[0] is not None:
        return table
    schema = conn.execute("SELECT coalesce((SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON "
                          "n.oid = c.relnamespace WHERE c.oid = to_regclass(%s)), current_schema())",
                          [_regclass(conn, table)]).fetchone()[0]
    return f"{schema}.{table}" if schema else table


def spellings(conn: psycopg.Connection, table: str) -> list[str]:
    """The names one table goes by: as given, schema-qualified, and bare where its schema is the search
    path's first."""
    full = qualified(conn, table)
    schema, name = split_table(conn, full)
    bare = name if schema is not None and schema == conn.execute("SELECT current_schema()").fetchone()[0] else None
    # written plain or quoted as SQL writes it (`"My Schema"."Odd Table"`): one table
    forms = (join_name(schema, name), sql.Identifier(schema, name).as_string(None)) if schema is not None else ()
    return list(dict.fromkeys(n for n in (table, full, *forms, bare) if n))


def ensure_schema(conn: psycopg.Connection, schema: str) -> str | None:
    """Schema `schema` in `conn`'s database, made where it is missing; one line where the role cannot make it.
    Returns its name where this call made it."""
    if conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", [schema]).fetchone():
        return None
    try:
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
    except psycopg.errors.InsufficientPrivilege:
        raise DatabaseError(f"the target table goes in schema {schema}, as its source's, and this database has none "
                            f"that the role may make: pass --table NAME, or GRANT CREATE ON DATABASE "
                            f"{conn.info.dbname} to the role") from None
    return schema


def drop_empty_schema(conn: psycopg.Connection, schema: str) -> None:
    """Schema `schema` dropped where nothing is in it (a job refused after making it); kept otherwise."""
    try:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} RESTRICT").format(sql.Identifier(schema)))
    except psycopg.Error:  # something else was made in it meanwhile, or the connection is gone: leave it
        pass


def table_sql(conn: psycopg.Connection, table: str) -> sql.Identifier:
    """The table's identifier, schema-qualified where `table` names an existing schema."""
    return sql.Identifier(*(p for p in split_table(conn, table) if p is not None))


def _regclass(conn: psycopg.Connection, table: str) -> str:
    return table_sql(conn, table).as_string(conn)


# `tree`: the table and, recursively, its partitions or children by inheritance; those of relkind 'p' hold no rows
_TREE = ("WITH RECURSIVE tree AS (SELECT %s::regclass::oid AS oid "
         "UNION SELECT i.inhrelid FROM pg_inherits i JOIN tree t ON i.inhparent = t.oid) ")


def heaps(conn: psycopg.Connection, table: str) -> list[tuple[int, str]]:
    """(oid, name) of each table a query of `table` reads rows from, in oid order: itself, or a partitioned
    table's partitions, or a parent by inheritance and its children."""
    return conn.execute(_TREE + "SELECT c.oid::int8, c.oid::regclass::text FROM tree JOIN pg_class c USING (oid) "
                        "WHERE c.relkind <> 'p' ORDER BY c.oid", [_regclass(conn, table)]).fetchall()


def heap_pages(conn: psycopg.Connection, table: str) -> tuple[int, float | None]:
    """(pages, rows a page) of the heap pages a ctid range of `table` can name. A query of a partitioned
    table, or of a parent by inheritance, reads its children's heaps too, and a ctid range those pages of
    each: the pages are the largest heap's, the rows a page all the heaps' rows over them (from the
    statistics: None before the first ANALYZE)."""
    pages, per_page = conn.execute(
        _TREE + "SELECT coalesce(max(pg_relation_size(c.oid)), 0) / current_setting('block_size')::int, "
        "sum(c.reltuples) FILTER (WHERE c.reltuples > 0) / nullif(max(c.relpages), 0) "
        "FROM tree JOIN pg_class c USING (oid) WHERE c.relkind <> 'p'", [_regclass(conn, table)]).fetchone()
    return pages, per_page


def schema_exists(conn: psycopg.Connection, schema: str) -> bool:
    return conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", [schema]).fetchone() is not None


def quote_ident(conn: psycopg.Connection, name: str) -> str:
    """`name` as a user would type it in a GRANT: quoted only where PostgreSQL needs it."""
    return conn.execute("SELECT quote_ident(%s)", [name]).fetchone()[0]


def role_and_database(conn: psycopg.Connection) -> tuple[str, str]:
    return conn.execute("SELECT current_user, current_database()").fetchone()


def check_write_privileges(conn: psycopg.Connection, table: str, index: bool) -> None:
    """Before any work: can this role write the ledger and `table` (and index it)? One line naming the
    missing privilege, on what, and the GRANT that fixes it."""
    from embedfleet.ledger import LEDGER_VERSION, check_ledger_privileges, ledger_version

    role, _ = role_and_database(conn)
    quote = lambda name: quote_ident(conn, name)  # noqa: E731
    usage = conn.execute("SELECT to_regnamespace(%s) IS NULL OR has_schema_privilege(%s, 'USAGE')",
                         [SCHEMA, SCHEMA]).fetchone()[0]
    if usage and ledger_version(conn) < LEDGER_VERSION:  # (its version is read in the schema)
        check_ledger_privileges(conn)
    else:
        missing = [t for (t,) in conn.execute(  # by oid: asking by name needs the schema's USAGE first
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s "
            "AND c.relname = ANY(ARRAY['jobs', 'chunks', 'rejects', 'workers', 'meta', 'meta_loaded']) "
            "AND NOT has_table_privilege(c.oid, 'SELECT, INSERT, UPDATE') ORDER BY c.relname", [SCHEMA]).fetchall()]
        grants = ([] if usage else [f"GRANT USAGE ON SCHEMA {SCHEMA} TO {quote(role)}"]) + (
            [f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {SCHEMA} TO {quote(role)}"] if missing else [])
        if grants:
            lacks = ", ".join(([f"USAGE on schema {SCHEMA}"] if not usage else []) +
                              ([f"SELECT, INSERT, UPDATE on {SCHEMA}.{missing[0]}"] if missing else []))
            raise DatabaseError(f"role {role} cannot write the ledger (no {lacks}): {'; '.join(grants)}")
    schema, name = split_table(conn, table)
    target = table_sql(conn, table).as_string(conn)
    if table_exists(conn, table):
        if not conn.execute("SELECT has_table_privilege(%s, 'SELECT, INSERT, UPDATE')", [target]).fetchone()[0]:
            raise DatabaseError(f"role {role} cannot write table {target} (no INSERT, UPDATE on it): "
                                f"GRANT SELECT, INSERT, UPDATE ON {target} TO {quote(role)}; or pass another --table")
        owner = conn.execute("SELECT pg_has_role(relowner, 'USAGE') FROM pg_class WHERE oid = %s::regclass",
                             [target]).fetchone()[0]
        if index and not owner and vector_index(conn, table) is None:
            raise DatabaseError(f"role {role} does not own table {target}, and only its owner can build the "
                                f"search index at the end: ALTER TABLE {target} OWNER TO {quote(role)}; "
                                "or pass --no-index")
        return
    schema = schema or conn.execute("SELECT current_schema()").fetchone()[0]
    if schema is None:
        raise DatabaseError(f"role {role} has no schema to create table {name!r} in (the search_path names none "
                            "that exists): pass --table SCHEMA.NAME")
    if not conn.execute("SELECT has_schema_privilege(%s, 'CREATE') AND has_schema_privilege(%s, 'USAGE')",
                        [schema, schema]).fetchone()[0]:
        raise DatabaseError(
            f"role {role} cannot create table {name!r} in schema {schema} (no CREATE on schema {schema}): "
            f"GRANT USAGE, CREATE ON SCHEMA {quote(schema)} TO {quote(role)}; or pass --table SCHEMA.{name} "
            f"for a schema {role} can create tables in")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(".")[:3] if x.isdigit())


def pgvector_problem(version: tuple[int, ...], dtype: str) -> str | None:
    """Why this pgvector cannot serve a job (None: it can)."""
    shown = ".".join(map(str, version))
    if version < PGVECTOR_MIN:
        return (f"pgvector {shown} is too old: embedfleet's search index (HNSW) needs pgvector ≥ 0.5; "
                "install a newer pgvector, then ALTER EXTENSION vector UPDATE")
    if dtype == "half" and version < HALFVEC_MIN:
        return (f"--dtype half needs pgvector ≥ 0.7 for halfvec; this server has {shown} "
                "(ALTER EXTENSION vector UPDATE after installing a newer pgvector, or use --dtype float)")
    return None


def check_server(conn: psycopg.Connection, dtype: str) -> tuple[int, ...]:
    """Before any work: PostgreSQL ≥ 13, and pgvector installed (or installable) at a version that has HNSW
    (and halfvec for --dtype half). Returns pgvector's version."""
    num, shown = conn.execute("SELECT current_setting('server_version_num')::int, "
                              "current_setting('server_version')").fetchone()
    if num < PG_MIN:
        raise DatabaseError(f"PostgreSQL {shown.split()[0]} is too old: embedfleet needs PostgreSQL 13 or newer")
    installed, available = conn.execute(
        "SELECT (SELECT extversion FROM pg_extension WHERE extname = 'vector'), "
        "(SELECT default_version FROM pg_available_extensions WHERE name = 'vector')").fetchone()
    if installed is None and available is None:
        raise DatabaseError("pgvector is not installed on this server: install it "
                            "(https://github.com/pgvector/pgvector), or run without --db for the embedded server")
    have = _version(installed or available)
    problem = pgvector_problem(have, dtype)
    if problem:
        raise DatabaseError(problem)
    return have


def ensure_vector(conn: psycopg.Connection) -> tuple[int, ...]:
    """Make sure pgvector is installed; return its version as a tuple."""
    row = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()
    if row is None:
        try:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(hashtext('embedfleet.vector'))")
                conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        except psycopg.Error as e:
            role, db = role_and_database(conn)
            raise DatabaseError(
                f"pgvector is not enabled in database {db} and role {role} cannot enable it "
                f"({e.diag.message_primary}): have an admin run CREATE EXTENSION vector in {db}, "
                "or run without --db for the embedded server"
            ) from None
        row = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()
    return _version(row[0])


def vector_type(conn: psycopg.Connection, dtype: str) -> str:
    problem = pgvector_problem(ensure_vector(conn), dtype)
    if problem:
        raise DatabaseError(problem)
    return "halfvec" if dtype == "half" else "vector"


def free_connections(conn: psycopg.Connection) -> int:
    """Connections the server can still accept from an ordinary role: max_connections, less those
    reserved (for superusers, and since PostgreSQL 16 for pg_use_reserved_connections) and those open."""
    return conn.execute(
        "SELECT current_setting('max_connections')::int - current_setting('superuser_reserved_connections')::int"
        " - coalesce(current_setting('reserved_connections', true)::int, 0)"
        " - (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')::int"
    ).fetchone()[0]


def table_exists(conn: psycopg.Connection, table: str) -> bool:
    return conn.execute("SELECT to_regclass(%s) IS NOT NULL", [_regclass(conn, table)]).fetchone()[0]


def drop_table(conn: psycopg.Connection, table: str) -> None:
    """Drop `table` (and its partitions); one a job made and that holds nothing, or what `jobs rm --drop-table` asks."""
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(table_sql(conn, table)))


def table_rows(conn: psycopg.Connection, table: str) -> int:
    """The rows `table` holds (0: no such table)."""
    if not table_exists(conn, table):
        return 0
    return conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table_sql(conn, table))).fetchone()[0]


# A review row with a 384-float vector passes the default 2 kB TOAST threshold, and the vector, its
# largest value, is the one moved out of line: every insert would also write the TOAST table and its
# index, and every read fetch the vector back. Toasting only rows that do not fit a page keeps vectors
# inline (docs/decisions/toast-and-autovacuum.md).
# No autovacuum while the job loads it (`finish_table` turns it back on): PostgreSQL would vacuum the
# table again and again as rows arrive, and with data checksums (on by default since PostgreSQL 18)
# marking a page visited logs a full copy of it, if it is the page's first change since a checkpoint,
# into the WAL the writers share. PostgreSQL's own advice for bulk loads: no autovacuum during, ANALYZE after.
HEAP_OPTIONS = sql.SQL("WITH (toast_tuple_target = 8160, autovacuum_enabled = off)")


def check_embedding_column(conn: psycopg.Connection, table: str, dim: int, vtype: str) -> None:
    """An existing `table` must hold `vtype(dim)` embeddings: a job never writes vectors of another size into it."""
    row = conn.execute(
        "SELECT format_type(atttypid, atttypmod) FROM pg_attribute "
        "WHERE attrelid = %s::regclass AND attname = 'embedding' AND NOT attisdropped",
        [table_sql(conn, table).as_string(conn)],
    ).fetchone()
    want = f"{vtype}({dim})"
    if row is None or row[0] != want:
        have = row[0] if row else "no embedding column"
        raise DatabaseError(f"table {table!r} already exists with {have}, not {want}; pass another --table")


def check_table_columns(conn: psycopg.Connection, table: str, columns: Sequence) -> None:
    """An existing `table` must have every column the job writes (a --columns field it was made without), each of
    the type the job writes: rows go in by binary COPY, where another type's bytes would be read as this one's
    (a double's bits as a bigint) or stop the COPY."""
    have = dict(conn.execute(
        "SELECT attname, atttypid::regtype::text FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
        "AND NOT attisdropped", [table_sql(conn, table).as_string(conn)]).fetchall())
    target = table_sql(conn, table).as_string(conn)
    for c in columns:
        name = sql.Identifier(c.name).as_string(conn)
        if c.name not in have:
            raise DatabaseError(f"table {table!r} already exists without column {c.name!r}: pass another --table, or "
                                f"add it first (ALTER TABLE {target} ADD COLUMN {name} {c.pgtype})")
        wanted = conn.execute("SELECT %s::regtype::text", [c.pgtype]).fetchone()[0]
        if have[c.name] != wanted:
            spelled = {"double precision": "double", "timestamp with time zone": "timestamptz"}.get(have[c.name],
                                                                                                  have[c.name])
            raise InputError(f"table {table!r} already has column {c.name!r} as {have[c.name]}, not {wanted}: give "
                             f"its type (--columns {c.name}:{spelled}), or pass another --table")


def ensure_table(conn: psycopg.Connection, table: str, columns: Sequence, dim: int, vtype: str,
                 partitions: int | None = None, fts: str | None = None) -> None:
    """Create the target table if needed, as `partitions` hash partitions of its id when given, with the full-text
    column of text search configuration `fts` where given (each row's computed as it is written); refuse one
    whose embedding has another dimension or type."""
    check_identifier(table)
    ident = table_sql(conn, table)
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"embedfleet.table.{table}"])
        if table_exists(conn, table):
            check_embedding_column(conn, table, dim, vtype)
            return
        cols = [
            sql.SQL("id text PRIMARY KEY"),
            sql.SQL("content text NOT NULL"),
            sql.SQL("embedding {}({})").format(sql.SQL(vtype), sql.Literal(dim)),
        ] + [sql.SQL("{} {}").format(sql.Identifier(c.name), sql.SQL(c.pgtype)) for c in columns]
        if fts:
            from embedfleet.pg.fts import fts_column

            cols.append(fts_column(fts))
        if not partitions:
            conn.execute(sql.SQL("CREATE TABLE {} ({}) {}").format(ident, sql.SQL(", ").join(cols), HEAP_OPTIONS))
            return
        # A table grows under one lock, 512 kB at a time, and behind several GPUs its writers queue there;
        # each partition grows under its own (docs/decisions/partitions.md).
        conn.execute(sql.SQL("CREATE TABLE {} ({}) PARTITION BY HASH (id)").format(ident, sql.SQL(", ").join(cols)))
        for i, part in enumerate(partition_names(conn, table, partitions)):
            conn.execute(sql.SQL("CREATE TABLE {} PARTITION OF {} FOR VALUES WITH (MODULUS {}, REMAINDER {}) {}").format(
                sql.Identifier(*part), ident, sql.Literal(partitions), sql.Literal(i), HEAP_OPTIONS))


def partition_names(conn: psycopg.Connection, table: str, partitions: int) -> list[tuple[str, ...]]:
    """The names of `table`'s hash partitions, NAME_p0, NAME_p1…, each (schema, name) in the table's schema
    (an unqualified one's: the first in the search path, where CREATE puts it)."""
    schema, name = split_table(conn, table)
    schema = schema or conn.execute("SELECT current_schema()").fetchone()[0]
    last = f"{name}_p{partitions - 1}"
    if len(last.encode()) > 63:
        raise InputError(f"--table {table!r} with --partitions {partitions}: a partition's name ({last!r}) passes "
                         "PostgreSQL's 63-byte limit; pass a shorter --table")
    return [(*([schema] if schema else []), f"{name}_p{i}") for i in range(partitions)]


def partition_count(conn: psycopg.Connection, table: str) -> int:
    """How many partitions (or child tables) `table` has; 0: it is one relation (or gone: dropped since)."""
    return conn.execute("SELECT count(*) FROM pg_inherits WHERE inhparent = to_regclass(%s)",
                        [_regclass(conn, table)]).fetchone()[0]


def check_partitions(conn: psycopg.Connection, table: str, partitions: int | None) -> None:
    """Before any work: `--partitions` can make `table`'s partitions, or `table` exists with that many."""
    if not partitions:
        return
    names = partition_names(conn, table, partitions)
    if table_exists(conn, table):
        have = partition_count(conn, table)
        if have != partitions:
            raise DatabaseError(f"table {table!r} already exists {f'with {have} partitions' if have else 'as one relation'}, "
                                f"not {partitions} partitions: pass another --table, or leave --partitions out to "
                                "write into it as it is")
        return
    for part in names:
        if conn.execute("SELECT to_regclass(%s) IS NOT NULL", [sql.Identifier(*part).as_string(conn)]).fetchone()[0]:
            raise DatabaseError(f"--partitions {partitions}: table {'.'.join(part)!r} already exists, and table "
                                f"{table!r} needs that name for a partition: pass another --table")


def embedding_info(conn: psycopg.Connection, table: str) -> tuple[str, int]:
    """(vector type, dimension) of a table's embedding column; DatabaseError if it has none."""
    if not table_exists(conn, table):
        raise DatabaseError(f"table {table!r} does not exist; `embedfleet status` lists the jobs and their tables")
    row = conn.execute(
        "SELECT t.typname, a.atttypmod FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid "
        "WHERE a.attrelid = %s::regclass AND a.attname = 'embedding' AND NOT a.attisdropped",
        [_regclass(conn, table)],
    ).fetchone()
    if row is None:
        raise DatabaseError(f"table {table!r} has no embedding column")
    return row[0], row[1]


# pgvector's HNSW index takes `vector` up to 2,000 dimensions, `halfvec` up to 4,000 and `bit` up to 64,000;
# both vector types store up to 16,000.
HNSW_VECTOR_DIMS, HNSW_HALFVEC_DIMS, MAX_DIMS = 2000, 4000, 16000
INDEX_KINDS = ("direct", "halfvec", "bit")


INDEX_CHOICES = ("hnsw", "binary")  # --index: HNSW as the width allows, or over the binary-quantized vectors


def index_plan(dim: int, vtype: str, index: str = "hnsw") -> tuple[str, str]:
    """(kind, what it is, in words) of the HNSW index a `dim`-dimensional `vtype` column gets: the column itself
    ("direct"), its values cast to halfvec ("halfvec": 2,001–4,000 dimensions stored as vector), or their binary
    quantization, searched by Hamming distance and rescored by the full vectors ("bit": above 4,000, or asked
    for with `index="binary"`: 32 times smaller than the vectors' index)."""
    if index not in INDEX_CHOICES:
        raise InputError(f"--index {index!r}: use {' or '.join(INDEX_CHOICES)}")
    if dim > MAX_DIMS:
        raise InputError(f"{dim:,}-dimensional vectors: pgvector stores at most {MAX_DIMS:,}; use --dim N where the "
                         "model was trained for shorter vectors (Matryoshka)")
    if index == "binary":
        return "bit", (f"HNSW on {code_words(dim)} (--index binary: searches take its nearest by Hamming distance, "
                       "--rescore of them, and rank those by the full vectors)")
    if dim <= (HNSW_HALFVEC_DIMS if vtype == "halfvec" else HNSW_VECTOR_DIMS):
        return "direct", f"HNSW on embedding ({dim:,} dimensions, {vtype})"
    if dim <= HNSW_HALFVEC_DIMS:
        return "halfvec", (f"HNSW on embedding::halfvec({dim}) ({dim:,} dimensions: vector's HNSW stops at "
                           f"{HNSW_VECTOR_DIMS:,}, halfvec's at {HNSW_HALFVEC_DIMS:,}; the stored vectors stay float32)")
    return "bit", (f"HNSW on {code_words(dim)} ({dim:,} dimensions: above halfvec's "
                   f"{HNSW_HALFVEC_DIMS:,}; searches take its nearest by Hamming distance and rescore them by the "
                   "full vectors)")


def _index_expression(kind: str, dim: int, vtype: str, levels=None) -> sql.Composable:
    """The indexed expression and its operator class; `levels`: a "bit" index's thresholds (pg.binary_code)."""
    if kind == "halfvec":
        return sql.SQL("(embedding::halfvec({})) halfvec_cosine_ops").format(sql.Literal(dim))
    if kind == "bit":
        return sql.SQL("({}) bit_hamming_ops").format(code_expression(sql.Identifier("embedding"), levels, dim, vtype))
    return sql.SQL("embedding halfvec_cosine_ops" if vtype == "halfvec" else "embedding vector_cosine_ops")


def vector_index(conn: psycopg.Connection, table: str) -> str | None:
    """The name of an HNSW index on `table`'s embedding column (or an expression of it), or None: what a search
    can use."""
    found = index_of(conn, table)
    return found[0] if found else None


def index_of(conn: psycopg.Connection, table: str) -> tuple[str, str] | None:
    """(name, kind) of the HNSW index on `table`'s embedding (kind: one of INDEX_KINDS), or None."""
    found = indexes_of(conn, table)
    return found[0] if found else None


def indexes_of(conn: psycopg.Connection, table: str | int) -> list[tuple[str, str]]:
    """(name, kind) of each HNSW index on `table`'s embedding (a table's name, or a relation's oid), by name."""
    rows = conn.execute(
        "SELECT DISTINCT c.relname, pg_get_indexdef(i.indexrelid) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
        "JOIN pg_am am ON am.oid = c.relam LEFT JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
        "AND a.attnum > 0 WHERE i.indrelid = %s::regclass::oid AND am.amname = 'hnsw' AND i.indisvalid "
        "AND (a.attname = 'embedding' OR (a.attname IS NULL AND pg_get_indexdef(i.indexrelid) ~ '\\membedding\\M')) "
        "ORDER BY 1",
        [str(table) if isinstance(table, int) else _regclass(conn, table)],
    ).fetchall()
    return [(name, "bit" if "binary_quantize" in d else "halfvec" if "::halfvec" in d else "direct") for name, d in rows]


def index_key(conn: psycopg.Connection, table: str, index: str) -> str:
    """The indexed expression (or column) of `table`'s index `index`, as the server prints it."""
    return conn.execute("SELECT pg_get_indexdef(i.indexrelid, 1, true) FROM pg_index i JOIN pg_class c ON "
                        "c.oid = i.indexrelid WHERE i.indrelid = %s::regclass AND c.relname = %s",
                        [_regclass(conn, table), index]).fetchone()[0]


def finish_table(conn: psycopg.Connection, table: str, index: bool, timings: dict | None = None,
                 dsn: str | None = None, kind: str = "hnsw") -> tuple[str, str] | None:
    """Once a job has loaded `table`: statistics for the planner (ANALYZE reads a fixed-size sample; a
    partitioned table's partitions each on a connection of its own where `dsn` is given), autovacuum back
    to the server's setting, and an HNSW (cosine) index on the embedding unless it has one.
    Under a lock per table, so two runs finishing together do this one after the other: the second finds
    the index built. Returns the index's (name, kind) as `index_of` (None without `index`); `timings` gets each
    step's seconds."""
    ident = table_sql(conn, table)
    lock = [f"embedfleet.finish.{ident.as_string(conn)}"]
    timings = {} if timings is None else timings
    with conn.transaction():
        t0 = time.perf_counter()
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", lock)
        timings["lock_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        analyze(conn, ident, dsn)
        timings["analyze_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        # after ANALYZE: resetting an option locks its table the way each partition's ANALYZE does
        for (heap,) in conn.execute(
                "SELECT c.oid::regclass::text FROM pg_class c WHERE 'autovacuum_enabled=off' = ANY(c.reloptions) "
                "AND c.oid IN (SELECT %s::regclass UNION SELECT relid FROM pg_partition_tree(%s::regclass))",
                [ident.as_string(conn)] * 2).fetchall():
            # set by ensure_table: a table someone else made is left alone
            conn.execute(sql.SQL("ALTER TABLE {} RESET (autovacuum_enabled)").format(sql.SQL(heap)))
        timings["alter_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
    timings["commit_s"] = round(time.perf_counter() - t0, 3)
    if not index:
        return None
    from embedfleet.pg.index_build import build_index

    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", lock)
        if (found := index_of(conn, table)) is not None:
            return found
        t0 = time.perf_counter()
        plan = build_index(conn, table, kind, dsn)
        timings["index_s"] = round(time.perf_counter() - t0, 3)
        timings["index_build"] = plan._asdict()
        found = index_of(conn, table)
    if found is None:  # cannot happen unless PostgreSQL changed what CREATE INDEX makes
        raise DatabaseError(f"the HNSW index of {table!r} was created but cannot be found")
    return found


ANALYZE_SIDE_BY_SIDE = 8  # partitions sampled at once


def analyze(conn: psycopg.Connection, ident: sql.Identifier, dsn: str | None = None) -> None:
    """ANALYZE the table. A partitioned one samples each partition, then the whole: where the server can
    take the whole alone (ANALYZE ONLY, PostgreSQL 18) and spare the connections `dsn` opens, the partitions
    are sampled side by side first (docs/decisions/partitions.md)."""
    whole = sql.SQL("ANALYZE {}").format(ident)
    leaves = [leaf for (leaf,) in conn.execute(
        "SELECT relid::regclass::text FROM pg_partition_tree(%s::regclass) WHERE isleaf AND level > 0",
        [ident.as_string(conn)])]
    if dsn is None or len(leaves) < 2 or conn.info.server_version < 180000:
        conn.execute(whole)
        return
    # a few connections, not one a core, and one left for anyone else
    side_by_side = min(len(leaves), ANALYZE_SIDE_BY_SIDE, max(2, (os.cpu_count() or 2) - 1), free_connections(conn) - 1)
    if side_by_side < 2:
        conn.execute(whole)
        return
    from concurrent.futures import ThreadPoolExecutor

    def sample(leaf: str) -> None:
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(sql.SQL("ANALYZE {}").format(sql.SQL(leaf)))

    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:  # idle in it meanwhile: not timed out
        conn.execute("SET LOCAL idle_in_transaction_session_timeout = 0")
    try:
        with ThreadPoolExecutor(side_by_side) as pool:
            list(pool.map(sample, leaves))
    except psycopg.OperationalError:  # the server refused a connection: all of it on this one
        conn.execute(whole)
        return
    conn.execute(sql.SQL("ANALYZE ONLY {}").format(ident))
