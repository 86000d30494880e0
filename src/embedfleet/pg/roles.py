"""The role users' filters run as. A `where` sent over HTTP is a stranger's SQL: it runs only under a role
that can read the served table and nothing else (no superuser, no file or admin functions, no other table),
inside a READ ONLY transaction with a statement timeout.

- The embedded server: embedfleet makes that role itself (`ensure_reader`), one per table, and connects as it.
- Your own server (--db): the --db role is used where it is such a role already; otherwise `serve` says
  which role to create and refuses filters until it is given (`--where-db`).
"""

from __future__ import annotations

import hashlib

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from embedfleet.errors import DatabaseError
from embedfleet.pg.ddl import split_table, table_sql

__all__ = ["READER_PREFIX", "ensure_reader", "reader_dsn", "reader_problem", "reader_role"]

READER_PREFIX = "embedfleet_read_"
# Built-in roles whose members reach the server's files, programs, other sessions or every table.
POWERFUL = ("pg_read_server_files", "pg_write_server_files", "pg_execute_server_program", "pg_signal_backend",
            "pg_read_all_data", "pg_write_all_data", "pg_monitor", "pg_read_all_settings")


def reader_role(table: str) -> str:
    """The role that reads `table` only: one per table, so serving a second table grants the first's role nothing."""
    return READER_PREFIX + hashlib.sha1(table.encode()).hexdigest()[:12]


def _heaps_and_table(conn: psycopg.Connection, table: str) -> list[str]:
    """`table` and, where it has them, its partitions: what reading it needs SELECT on."""
    name = table_sql(conn, table).as_string(conn)
    return [r[0] for r in conn.execute(
        "SELECT %s::regclass::text UNION SELECT relid::regclass::text FROM pg_partition_tree(%s::regclass)",
        [name, name]).fetchall()]


def ensure_reader(conn: psycopg.Connection, table: str) -> str:
    """Make (or bring back to) the role that can log in and read `table`, nothing more; returns its name.
    `conn` must be able to create roles (the embedded server's superuser)."""
    role = reader_role(table)
    ident = sql.Identifier(role)
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"embedfleet.role.{role}"])
        if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [role]).fetchone() is None:
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(ident))
        conn.execute(sql.SQL("ALTER ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS "
                             "NOINHERIT").format(ident))
        schema = split_table(conn, table)[0] or conn.execute(
            "SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = %s::regclass",
            [table_sql(conn, table).as_string(conn)]).fetchone()[0]
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(schema), ident))
        for heap in _heaps_and_table(conn, table):
            conn.execute(sql.SQL("GRANT SELECT ON {} TO {}").format(sql.SQL(heap), ident))
    return role


def reader_dsn(dsn: str, role: str) -> str:
    """`dsn` as `role` (the embedded server trusts its local socket: no password)."""
    params = conninfo_to_dict(dsn)
    params.pop("password", None)
    return make_conninfo(**{**params, "user": role})


def reader_problem(conn: psycopg.Connection, table: str) -> str | None:
    """Why the role of `conn` must not run strangers' filters on `table` (None: it may): a superuser, a member
    of a role that reaches files, programs or other sessions, or one that can read another table."""
    role, superuser = conn.execute(
        "SELECT current_user, rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()
    if superuser:
        return f"role {role} is a superuser"
    member = conn.execute(
        "SELECT r FROM unnest(%s::text[]) r WHERE to_regrole(r) IS NOT NULL AND pg_has_role(current_user, r, 'USAGE') "
        "LIMIT 1", [list(POWERFUL)]).fetchone()
    if member:
        return f"role {role} is a member of {member[0]}"
    own = _heaps_and_table(conn, table)
    other = conn.execute(
        "SELECT c.oid::regclass::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.relkind IN ('r', 'p', 'v', 'm', 'f') AND n.nspname NOT IN ('pg_catalog', 'information_schema') "
        "AND n.nspname NOT LIKE 'pg_toast%%' AND NOT (c.oid::regclass::text = ANY(%s)) "
        "AND has_table_privilege(c.oid, 'SELECT') LIMIT 1", [own]).fetchone()
    if other:
        return f"role {role} can read other tables too (e.g. {other[0]})"
    return None


def check_reader(conn: psycopg.Connection, table: str, where_db: bool) -> None:
    """Refuse a role that must not run filters, with the role to create instead."""
    problem = reader_problem(conn, table)
    if problem is None:
        return
    target = table_sql(conn, table).as_string(conn)
    role = reader_role(table)
    raise DatabaseError(
        f"--allow-where: {problem}, and filters sent over HTTP run only as a role that can read {target} and "
        f"nothing else: have an admin run CREATE ROLE {role} LOGIN PASSWORD '…'; GRANT SELECT ON {target} TO {role}; "
        f"(and USAGE on its schema), then pass --where-db postgresql://{role}:…@HOST/DB"
        + ("" if where_db else "; or leave --allow-where out"))
