"""Reading a whole table in parallel, the one way export, map and training do it: every connection in one
snapshot (REPEATABLE READ, READ ONLY; the first exports it, the others join it), each reading its page span
(a run of heap pages, by a TID range scan) with the user's filter, and binary COPY parsed in bulk (`pg.copybin`).
"""

from __future__ import annotations

import re

import psycopg
from psycopg import sql

from embedfleet.errors import InputError, OptionError

__all__ = ["begin_snapshot", "export_snapshot", "filter_names", "one_expression", "page_spans", "span_sql", "user_filter"]

# What a physical read sets: the heap's order, the same on every connection and every rank (no index or bitmap
# scan a filter might invite, no parallel workers, no scan joining one already running elsewhere).
_PHYSICAL = ("enable_indexscan", "enable_indexonlyscan", "enable_bitmapscan", "synchronize_seqscans", "jit")


def begin_snapshot(conn: psycopg.Connection, snapshot: str | None = None, physical: bool = False) -> None:
    """Begin a REPEATABLE READ, READ ONLY transaction on `conn` (in `snapshot`, another connection's, when
    given), timestamps in UTC; `physical`: rows in the heap's order, no statement timeout."""
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
    if snapshot:
        conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)))
    conn.execute("SET LOCAL timezone = 'UTC'")
    if physical:
        for setting in _PHYSICAL:
            conn.execute(sql.SQL("SET LOCAL {} = off").format(sql.Identifier(setting)))
        conn.execute("SET LOCAL max_parallel_workers_per_gather = 0")
        conn.execute("SET LOCAL statement_timeout = 0")


def export_snapshot(conn: psycopg.Connection) -> str:
    """The snapshot of `conn`'s transaction, for other connections to join (`begin_snapshot`)."""
    return conn.execute("SELECT pg_export_snapshot()").fetchone()[0]


def page_spans(pages: int, parts: int, min_pages: int = 1) -> list[tuple[int, int | None]]:
    """`parts` runs of `pages` heap pages of about equal size, the last open-ended (pages added since are
    its); one span of the whole table when fewer than `min_pages` a part would be left."""
    if parts <= 1 or pages < min_pages * parts:
        return [(0, None)]
    cuts = [pages * i // parts for i in range(parts)]
    return [(a, b) for a, b in zip(cuts, cuts[1:] + [None])]


def span_sql(span: tuple[int, int | None]) -> sql.Composable:
    """The condition on ctid that reads `span`'s pages (a TID range scan, PostgreSQL ≥ 14)."""
    start, end = span
    if start == 0 and end is None:
        return sql.SQL("true")
    lo = sql.SQL("ctid >= {}::tid").format(sql.Literal(f"({start},0)"))
    return lo if end is None else sql.SQL("{} AND ctid < {}::tid").format(lo, sql.Literal(f"({end},0)"))


def user_filter(where: str, placeholders: bool = False) -> sql.Composable:
    """A user's `--where`, parenthesised, once `one_expression` has found it one expression (it also runs in a READ
    ONLY transaction: it can only filter). `placeholders`: for a statement run with parameters, whose `%` psycopg
    would read as its own (they are doubled, so the server gets them back as written)."""
    one_expression(where)
    return sql.SQL("({})").format(sql.SQL(where.replace("%", "%%") if placeholders else where))


_DOLLAR = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)?\$")
_WORD = re.compile(r"[^\W][\w$]*(?=[^'\w$]|$)")  # not the E of E'...', which the literal's branch reads


# Functions a filter may not call, each with why: it runs in a READ ONLY transaction, which stops writes to tables
# but not these.
_NOT_FILTERS = {
    # an effect that outlives the filter's row: a setting (its statement timeout among them) or a session's lock
    "would change the session": ("set_config", "pg_advisory_lock", "pg_advisory_lock_shared",
                                 "pg_try_advisory_lock", "pg_try_advisory_lock_shared"),
    # SQL given as text, which no scan of the filter sees
    "runs SQL given as text": ("query_to_xml", "query_to_xmlschema", "query_to_xml_and_xmlschema", "cursor_to_xml",
                               "cursor_to_xmlschema", "ts_stat", "dblink", "dblink_exec", "dblink_open",
                               "dblink_send_query"),
    "acts on the server": ("pg_terminate_backend", "pg_cancel_backend", "pg_reload_conf", "pg_rotate_logfile",
                           "pg_switch_wal", "pg_create_restore_point", "pg_promote", "pg_wal_replay_pause",
                           "pg_wal_replay_resume", "pg_backup_start", "pg_backup_stop", "pg_log_backend_memory_contexts",
                           "pg_create_physical_replication_slot", "pg_create_logical_replication_slot",
                           "pg_drop_replication_slot", "pg_copy_physical_replication_slot",
                           "pg_copy_logical_replication_slot", "pg_replication_slot_advance",
                           "pg_logical_emit_message", "pg_import_system_collations", "pg_notify"),
    "reads the server's files": ("pg_read_file", "pg_read_binary_file", "pg_stat_file", "lo_import", "lo_export"),
}
_NOT_FILTER_PREFIXES = {"pg_stat_reset": "acts on the server", "pg_replication_origin_": "acts on the server",
                        "pg_ls_": "reads the server's files"}
REFUSED_FUNCTIONS = {name: why for why, names in _NOT_FILTERS.items() for name in names}


def _not_a_filter(name: str) -> str | None:
    """Why a filter may not call function `name` (lower-case), or None."""
    return REFUSED_FUNCTIONS.get(name) or next((why for p, why in _NOT_FILTER_PREFIXES.items()
                                                if name.startswith(p)), None)


def where_error(message: str, where: str) -> OptionError:
    """The server's failure of a user's filter, naming --where. Its syntax error "at or near ")"" where the filter
    has no ")" meant the parenthesis we close it with: the filter ended too soon."""
    if message == 'syntax error at or near ")"' and ")" not in where:
        message = "syntax error at its end: it stops before the condition is complete"
    return OptionError("where", message, where)


def one_expression(where: str) -> str:
    """`where` as one SQL expression, or one line saying why not. Outside string literals, quoted identifiers and
    dollar quotes it may hold no `;`, no comment and no parenthesis it does not close: pasted between the
    statement's own, it can then neither end the statement (and the READ ONLY transaction with a COMMIT) nor
    cut off the ORDER BY and LIMIT that follow it. Nor may it call what a READ ONLY transaction lets through
    (REFUSED_FUNCTIONS): a filter that lifted its own statement timeout could hold a server's connection for as
    long as it liked, and one that ended other sessions or read the server's files would do more than filter."""
    if "\x00" in where:
        raise OptionError("where", "it holds a NUL character (\\x00), which SQL text cannot hold; remove it", where)
    if called := sorted(n for n in _scan(where) if _not_a_filter(n)):
        raise OptionError("where", f"{called[0]}() {_not_a_filter(called[0])}; a filter may only read rows", where)
    return where


def filter_names(where: str) -> set[str]:
    """The names a filter (one expression) reads, as SQL folds them: bare words lower-cased, quoted ones as
    written; literals name nothing. Columns among them, and keywords and functions besides."""
    return _scan(where)


def _scan(where: str) -> set[str]:
    depth, i, n, names = 0, 0, len(where), set()

    def refuse(why: str) -> InputError:
        return OptionError("where", f"{why}; give one condition, as after WHERE", where)

    if not where.strip():
        raise refuse("it is empty")

    while i < n:
        c = where[i]
        if c == "'":  # a literal; in E'...' a backslash escapes the next character
            escapes = i > 0 and where[i - 1] in "eE" and not (i > 1 and (where[i - 2].isalnum() or where[i - 2] == "_"))
            i += 1
            while i < n and where[i] != "'" or where.startswith("''", i):
                i += 2 if where.startswith("''", i) or (escapes and where[i] == "\\") else 1
            if i >= n:
                raise refuse("a quote is not closed")
        elif c == '"':
            if i > 1 and where[i - 1] == "&" and where[i - 2] in "uU" and not (
                    i > 2 and (where[i - 3].isalnum() or where[i - 3] in "_$")):
                raise refuse('a name in Unicode escapes (U&"...") could spell any function: write the name as it is')
            start = i + 1
            i += 1
            while i < n and where[i] != '"' or where.startswith('""', i):
                i += 2 if where.startswith('""', i) else 1
            if i >= n:
                raise refuse("a double quote is not closed")
            names.add(where[start:i].replace('""', '"'))
        elif c == "$" and (m := _DOLLAR.match(where, i)) and not (i > 0 and (where[i - 1].isalnum() or where[i - 1] == "_")):
            end = where.find(m.group(0), m.end())
            if end < 0:
                raise refuse("a dollar quote is not closed")
            i = end + len(m.group(0)) - 1
        elif m := _WORD.match(where, i):  # a name, or a number (whose letters name nothing)
            if not c.isdigit():  # PostgreSQL folds only ASCII letters of a bare name
                names.add("".join(ch.lower() if ch.isascii() else ch for ch in m.group(0)))
            i = m.end() - 1
        elif c == ";":
            raise refuse("a ';' would end the statement")
        elif where.startswith("--", i) or where.startswith("/*", i):
            raise refuse("a comment would hide the rest of the statement")
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth < 0:
                raise refuse("a ')' closes a parenthesis it did not open")
        i += 1
    if depth:
        raise refuse("a '(' is not closed")
    return names
