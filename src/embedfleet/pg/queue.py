"""A source table's changes, queued for `embedfleet sync`: a trigger on the source writes each changed key into a
queue table in schema `embedfleet` of the source's database, and sync's workers claim them with SKIP LOCKED.

The application's writes come first, always:
- the trigger only ever INSERTs into the queue (no unique key, so no row a worker has locked is in its way), and
  does nothing at all when the queue is gone (`to_regclass` first: no error, no subtransaction);
- it runs as the role that installed it (SECURITY DEFINER, a fixed search_path): the application's role needs no
  grant on the queue;
- installing and uninstalling take the source's (and the queue's) locks for a moment: each try waits at most
  LOCK_TRY for them, since the application's writes queue behind a lock that waits, and tries again for up to
  LOCK_PATIENCE; one line if the table stays busy.

A queued key says only "look at this row again": a worker reads the row as it is now, so a change queued twice,
or queued and then undone, costs nothing wrong. TRUNCATE queues a NULL key: every row may be gone.

The trigger's cost is one more row inserted per row changed, and no more: the queue is UNLOGGED (no WAL: the
write-ahead log was most of that cost), has no index (a worker sorts what it claims and deletes by ctid) and no
sequence (claims go by the time a key was queued), and the trigger sends no NOTIFY, which cost as much again; a
follower polls the queue between LISTENs instead (docs/decisions/sync-queue.md). A server that crashes empties an
unlogged table: sync notices the server's new start time and queues every key of the source once (`requeue_all`),
so nothing changed before the crash is lost.
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass
from typing import NamedTuple

import psycopg
from psycopg import sql

from embedfleet.errors import DatabaseError, InputError

__all__ = ["Queue", "queue_for", "install", "uninstall", "installed", "following", "renamed_key", "follow_key",
           "pending", "claim", "forget", "requeue_all", "server_started"]

LOCK_TRY, LOCK_PATIENCE = 0.1, 10.0  # seconds a try waits for a lock; seconds of tries
TRIGGERS = ("row", "update", "truncate")  # after INSERT, UPDATE OF the key, DELETE; after any UPDATE; after TRUNCATE


@dataclass(frozen=True)
class Queue:
    source: str  # the source table, qualified as SQL reads it
    key: str  # its key column
    tag: str  # names the queue, its function, triggers and channel

    @property
    def table(self) -> sql.Composable:
        return sql.Identifier("embedfleet", f"queue_{self.tag}")

    @property
    def table_name(self) -> str:
        return f"embedfleet.queue_{self.tag}"

    @property
    def channel(self) -> str:
        return f"embedfleet_{self.tag}"

    @property
    def trigger_names(self) -> list[str]:
        return [f"embedfleet_{kind}_{self.tag}" for kind in TRIGGERS]

    def _function(self, kind: str) -> sql.Composable:
        return sql.Identifier("embedfleet", f"{kind}_{self.tag}")

    def _trigger(self, kind: str) -> sql.Composable:
        return sql.Identifier(f"embedfleet_{kind}_{self.tag}")


def queue_for(source: str, key: str, job: str) -> Queue:
    return Queue(source, key, hashlib.sha1(job.encode()).hexdigest()[:12])


def installed(conn: psycopg.Connection, q: Queue) -> bool:
    """The queue and its three triggers are there (the key dropped with CASCADE drops the row trigger with it;
    an install of an earlier version had two)."""
    return conn.execute("SELECT to_regclass(%s) IS NOT NULL", [q.table_name]).fetchone()[0] and conn.execute(
        "SELECT count(*) = %s FROM pg_trigger WHERE tgrelid = %s::regclass AND tgname = ANY(%s)",
        [len(TRIGGERS), q.source, q.trigger_names]).fetchone()[0]


class Following(NamedTuple):
    source: bool  # the source is there
    installed: bool  # the queue and its triggers are (the key dropped with CASCADE takes the row trigger)
    gone: list[str]  # the watched columns the source no longer has (dropped or renamed: nothing stops that DDL)
    renamed: str | None  # the key column's name now, where the trigger functions read it by another


# The key column's name now, where the row trigger's function reads it by another: the trigger's UPDATE OF names
# the column by number, which a rename keeps; the function names it as sql.Identifier quotes it.
_RENAMED_KEY = ("(SELECT a.attname FROM pg_trigger t JOIN pg_attribute a ON a.attrelid = t.tgrelid "
                "AND a.attnum = t.tgattr[0] JOIN pg_proc p ON p.oid = t.tgfoid WHERE t.tgrelid = to_regclass(%(source)s) "
                "AND t.tgname = %(row)s AND strpos(p.prosrc, 'NEW.\"' || replace(a.attname, '\"', '\"\"') || '\"') = 0)")


def following(conn: psycopg.Connection, q: Queue, watched: list[str]) -> Following:
    """What a follower checks while idle, in one statement."""
    return Following(*conn.execute(
        "SELECT to_regclass(%(source)s) IS NOT NULL, to_regclass(%(queue)s) IS NOT NULL AND (SELECT count(*) "
        "FROM pg_trigger WHERE tgrelid = to_regclass(%(source)s) AND tgname = ANY(%(names)s)) = %(n)s, "
        "ARRAY(SELECT c FROM unnest(%(watched)s::text[]) AS c WHERE NOT EXISTS (SELECT FROM pg_attribute "
        "WHERE attrelid = to_regclass(%(source)s) AND attname = c AND attnum > 0 AND NOT attisdropped)), "
        + _RENAMED_KEY, {"source": q.source, "queue": q.table_name, "names": q.trigger_names, "n": len(TRIGGERS),
                         "watched": watched, "row": q.trigger_names[0]}).fetchone())


def _check_privileges(conn: psycopg.Connection, q: Queue) -> None:
    """One line with every GRANT the role lacks to install the trigger and the queue, if it lacks any."""
    role, quoted = conn.execute("SELECT current_user, quote_ident(current_user)").fetchone()
    trigger, schema, usage, create, db_create, db = conn.execute(
        "SELECT has_table_privilege(%s::regclass, 'TRIGGER'), to_regnamespace('embedfleet') IS NOT NULL, "
        "CASE WHEN to_regnamespace('embedfleet') IS NULL THEN false ELSE has_schema_privilege('embedfleet', 'USAGE') END, "
        "CASE WHEN to_regnamespace('embedfleet') IS NULL THEN false ELSE has_schema_privilege('embedfleet', 'CREATE') END, "
        "has_database_privilege(current_database(), 'CREATE'), quote_ident(current_database())",
        [q.source]).fetchone()
    grants = [] if trigger else [f"GRANT TRIGGER ON {q.source} TO {quoted}"]
    if schema and not (usage and create):
        grants.append(f"GRANT USAGE, CREATE ON SCHEMA embedfleet TO {quoted}")
    elif not schema and not db_create:
        grants.append(f"GRANT CREATE ON DATABASE {db} TO {quoted}")
    if grants:
        raise DatabaseError(f"sync needs a trigger on {q.source} and its queue in schema embedfleet of that "
                            f"database, and role {role} lacks privileges for them: {'; '.join(grants)}")


def install(conn: psycopg.Connection, q: Queue, watched: list[str]) -> bool:
    """The queue, the trigger function and the source's triggers, made once (an installed queue is left as it
    is). `watched`: the columns whose UPDATE can change a target row. Returns whether anything was made."""
    usable = conn.execute("SELECT CASE WHEN to_regnamespace('embedfleet') IS NULL THEN true "
                          "ELSE has_schema_privilege('embedfleet', 'USAGE') END").fetchone()[0]
    if usable and installed(conn, q):  # (where the role may not use the schema, it cannot look)
        if renamed := renamed_key(conn, q):
            follow_key(conn, q, renamed, watched)
        elif not _functions_current(conn, q, watched):
            follow_key(conn, q, q.key, watched)
        if _partitions_without_truncate(conn, q):  # attached since
            _briefly_locked(conn, lambda: _truncate_on_partitions(conn, q),
                            f"{q.source}'s partitions are busy: a new one's TRUNCATE is not followed yet; rerun sync")
        return False
    _check_privileges(conn, q)

    def make() -> None:
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('embedfleet.ledger'))")  # the schema, made once
        # only where it is missing: even IF NOT EXISTS needs CREATE on the database (the ledger may make it meanwhile)
        if not conn.execute("SELECT to_regnamespace('embedfleet') IS NOT NULL").fetchone()[0]:
            conn.execute("CREATE SCHEMA IF NOT EXISTS embedfleet")
        conn.execute(sql.SQL("CREATE UNLOGGED TABLE IF NOT EXISTS {} (key text, "
                             "queued timestamptz NOT NULL DEFAULT clock_timestamp())").format(q.table))
        _make_functions(conn, q, watched)
        key, src = sql.Identifier(q.key), sql.SQL(q.source)
        for kind in TRIGGERS:  # one left of an earlier install is made again with the others
            conn.execute(sql.SQL("DROP TRIGGER IF EXISTS {} ON {}").format(q._trigger(kind), src))
        # the key in the definition: its type cannot change, nor can it be dropped, under a sync keyed by it
        conn.execute(sql.SQL("CREATE TRIGGER {} AFTER INSERT OR UPDATE OF {} OR DELETE ON {} FOR EACH ROW "
                             "EXECUTE FUNCTION {}()").format(q._trigger("row"), key, src, q._function("enqueue")))
        conn.execute(sql.SQL("CREATE TRIGGER {} AFTER UPDATE ON {} FOR EACH ROW EXECUTE FUNCTION {}()").format(
            q._trigger("update"), src, q._function("changed")))
        conn.execute(sql.SQL("CREATE TRIGGER {} AFTER TRUNCATE ON {} FOR EACH STATEMENT EXECUTE FUNCTION {}()")
                     .format(q._trigger("truncate"), src, q._function("enqueue")))
        _truncate_on_partitions(conn, q)

    try:
        _briefly_locked(conn, make, f"{q.source} is busy: its writers held it for {LOCK_PATIENCE:g} s; the trigger "
                                    "was not installed, and nothing was left half made; rerun sync")
    except psycopg.errors.InsufficientPrivilege as e:
        raise DatabaseError(f"installing sync on {q.source}: {str(e).splitlines()[0]}") from None
    return True


def _make_functions(conn: psycopg.Connection, q: Queue, watched: list[str]) -> None:
    """The trigger functions, made or remade (in the caller's transaction): they read the key as `q.key`."""
    for kind, text in _function_sources(conn, q, watched).items():
        conn.execute(sql.SQL(
            "CREATE OR REPLACE FUNCTION {}() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER "
            "SET search_path = pg_catalog, pg_temp AS {}").format(q._function(kind), sql.Literal(text)))


def _function_sources(conn: psycopg.Connection, q: Queue, watched: list[str]) -> dict[str, str]:
    """The trigger functions' bodies, by kind. The key is compared as text: a numeric key rewritten at another
    scale (2 to 2.0) is another target row's id, though the values are equal."""
    key = sql.Identifier(q.key)
    # a key that may be NULL: such a row has no target row, and its NULL must not read as a TRUNCATE's
    nullable = conn.execute("SELECT NOT attnotnull FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attname = %s",
                            [q.source, q.key]).fetchone()
    nullable = bool(nullable and nullable[0])

    def queued(row: str, *conditions: sql.Composable) -> sql.Composable:
        insert = sql.SQL("INSERT INTO {} (key) VALUES ({}.{}::text);").format(q.table, sql.SQL(row), key)
        tests = [*conditions, *([sql.SQL("{}.{} IS NOT NULL").format(sql.SQL(row), key)] if nullable else [])]
        return sql.SQL("IF {} THEN {} END IF;").format(sql.SQL(" AND ").join(tests), insert) if tests else insert

    body = sql.SQL("""
        BEGIN
            IF to_regclass({name}) IS NULL THEN
                RETURN NULL;
            END IF;
            IF TG_OP = 'TRUNCATE' THEN
                INSERT INTO {queue} (key) VALUES (NULL);
            ELSIF TG_OP = 'DELETE' THEN
                {deleted}
            ELSE
                {new}
                {old}
            END IF;
            RETURN NULL;
        END""").format(name=sql.Literal(q.table_name), queue=q.table, deleted=queued("OLD"), new=queued("NEW"),
                       old=queued("OLD", sql.SQL("TG_OP = 'UPDATE' AND OLD.{k}::text IS DISTINCT FROM NEW.{k}::text")
                                  .format(k=key)))
    # An UPDATE's trigger names the watched columns in its body, not in its definition: a column a trigger's
    # definition names cannot change type. Compared as text (json and point have no equality). Whatever the
    # comparison cannot do (a column dropped since, a type changed under this session's cached plan) queues the
    # key; a key it cannot read (dropped with CASCADE, which took the row trigger) queues nothing: the
    # application's UPDATE goes on either way, and sync says what happened.
    others = [c for c in dict.fromkeys(watched) if c != q.key]
    old = sql.SQL(", ").join([*(sql.SQL("OLD.{}::text").format(sql.Identifier(c)) for c in others), sql.NULL])
    new = sql.SQL(", ").join([*(sql.SQL("NEW.{}::text").format(sql.Identifier(c)) for c in others), sql.NULL])
    changed = sql.SQL("""
        BEGIN
            IF to_regclass({name}) IS NULL THEN
                RETURN NULL;
            END IF;
            BEGIN
                IF ROW({old}) IS NOT DISTINCT FROM ROW({new}) THEN
                    RETURN NULL;
                END IF;
                {queued}
                RETURN NULL;
            EXCEPTION WHEN OTHERS THEN
                NULL;
            END;
            BEGIN
                {queued}
            EXCEPTION WHEN OTHERS THEN
                NULL;
            END;
            RETURN NULL;
        END""").format(name=sql.Literal(q.table_name), queued=queued("NEW"), old=old, new=new)
    return {"enqueue": body.as_string(conn), "changed": changed.as_string(conn)}


def _functions_current(conn: psycopg.Connection, q: Queue, watched: list[str]) -> bool:
    """The installed trigger functions are the ones this version makes (an earlier install's are remade)."""
    want = _function_sources(conn, q, watched)
    have = dict(conn.execute("SELECT p.proname, p.prosrc FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
                             "WHERE n.nspname = 'embedfleet' AND p.proname = ANY(%s)",
                             [[f"{kind}_{q.tag}" for kind in want]]).fetchall())
    return all(have.get(f"{kind}_{q.tag}") == text for kind, text in want.items())


def renamed_key(conn: psycopg.Connection, q: Queue) -> str | None:
    """The source's key column's name now, where the trigger functions read it by another (it was renamed since
    they were made), else None."""
    return conn.execute("SELECT " + _RENAMED_KEY, {"source": q.source, "row": q.trigger_names[0]}).fetchone()[0]


def follow_key(conn: psycopg.Connection, q: Queue, key: str, watched: list[str]) -> None:
    """The trigger functions remade to read the key column as `key`, its name now. plpgsql reads NEW's fields by
    name, so until then each of the application's writes fails; the row trigger's UPDATE OF names the column by
    number, which a rename keeps."""
    with conn.transaction():
        _make_functions(conn, Queue(q.source, key, q.tag), watched)

def _partitions_without_truncate(conn: psycopg.Connection, q: Queue) -> list[str]:
    """The source's partitions (at any depth) without sync's TRUNCATE trigger: a statement trigger on the parent
    does not fire for a TRUNCATE of one partition."""
    return [r[0] for r in conn.execute(
        "SELECT format('%%I.%%I', n.nspname, c.relname) FROM pg_partition_tree(to_regclass(%s)) p "
        "JOIN pg_class c ON c.oid = p.relid JOIN pg_namespace n ON n.oid = c.relnamespace WHERE p.level > 0 "
        "AND NOT EXISTS (SELECT FROM pg_trigger t WHERE t.tgrelid = p.relid AND t.tgname = %s) ORDER BY 1",
        [q.source, f"embedfleet_truncate_{q.tag}"]).fetchall()]


def _truncate_on_partitions(conn: psycopg.Connection, q: Queue) -> None:
    for part in _partitions_without_truncate(conn, q):
        conn.execute(sql.SQL("CREATE TRIGGER {} AFTER TRUNCATE ON {} FOR EACH STATEMENT EXECUTE FUNCTION {}()")
                     .format(q._trigger("truncate"), sql.SQL(part), q._function("enqueue")))


def _briefly_locked(conn: psycopg.Connection, work, busy: str) -> None:
    """`work()` in a transaction of its own, each of its locks waited for at most LOCK_TRY (the application's
    writes queue behind a lock that waits), tried again until LOCK_PATIENCE has passed; then `busy`, one line."""
    deadline = time.monotonic() + LOCK_PATIENCE
    while True:
        try:
            with conn.transaction():
                conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(f"{int(LOCK_TRY * 1000)}ms")))
                work()
            return
        except psycopg.errors.LockNotAvailable:
            if time.monotonic() > deadline:
                raise DatabaseError(busy) from None
            time.sleep(random.uniform(LOCK_TRY, 4 * LOCK_TRY))


def uninstall(conn: psycopg.Connection, q: Queue) -> bool:
    """The source's triggers, the functions and the queue, dropped (the target table stays). Returns whether
    there was anything to drop."""
    had = conn.execute("SELECT to_regclass(%s) IS NOT NULL", [q.table_name]).fetchone()[0]
    dropped = []

    def drop() -> None:
        dropped.clear()
        # the triggers wherever they are now: on the source, or on it renamed since
        for tgname, relation in conn.execute(  # (a partitioned source's row triggers' clones go with them)
                "SELECT tgname, tgrelid::regclass::text FROM pg_trigger WHERE tgname = ANY(%s) AND tgparentid = 0",
                [q.trigger_names]).fetchall():
            conn.execute(sql.SQL("DROP TRIGGER IF EXISTS {} ON {}").format(sql.Identifier(tgname), sql.SQL(relation)))
            dropped.append(tgname)
        for kind in ("enqueue", "changed"):
            conn.execute(sql.SQL("DROP FUNCTION IF EXISTS {}()").format(q._function(kind)))
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(q.table))

    _briefly_locked(conn, drop, f"{q.source} or its queue is busy (its writers, or a sync's batch, held them for "
                                f"{LOCK_PATIENCE:g} s): nothing was removed; rerun sync --uninstall")
    return had or bool(dropped)
    return had


def pending(conn: psycopg.Connection, q: Queue) -> tuple[int, float | None]:
    """(keys queued, seconds since the oldest was queued; None when none is)."""
    if not conn.execute("SELECT to_regclass(%s) IS NOT NULL", [q.table_name]).fetchone()[0]:
        return 0, None
    n, age = conn.execute(sql.SQL("SELECT count(*), extract(epoch FROM clock_timestamp() - min(queued)) FROM {}")
                          .format(q.table)).fetchone()
    return int(n), None if age is None else float(age)


def claim(conn: psycopg.Connection, q: Queue, limit: int, part: int = 0,
          parts: int = 1) -> list[tuple[str, str | None]]:
    """Up to `limit` queued (ctid, key), oldest first, locked in the caller's transaction (where their ctids
    hold); those another worker holds are skipped. With `parts` > 1, only the keys whose hash falls in `part`
    (the NULL key, a TRUNCATE, in part 0): lanes that split the keys so never wait for one another's."""
    mine = sql.SQL("")
    if parts > 1:
        mine = sql.SQL("WHERE CASE WHEN key IS NULL THEN 0 ELSE mod(hashtext(key) & 2147483647, {n}) END = {i} ").format(
            n=sql.Literal(parts), i=sql.Literal(part))
    try:
        return conn.execute(sql.SQL("SELECT ctid::text, key FROM {} {}ORDER BY queued LIMIT %s FOR UPDATE SKIP LOCKED")
                            .format(q.table, mine), [limit]).fetchall()
    except psycopg.errors.UndefinedTable:
        raise InputError(f"sync's queue for {q.source} is gone ({q.table_name}); rerun sync to install it again "
                         "(its backfill then catches up)") from None


def forget(conn: psycopg.Connection, q: Queue, ctids: list[str]) -> None:
    """The claimed entries, done: deleted in the transaction that claimed them."""
    conn.execute(sql.SQL("DELETE FROM {} WHERE ctid = ANY(%s::tid[])").format(q.table), [ctids])


def database_identity(conn: psycopg.Connection) -> str:
    """The database `conn` is in, however reached: its server's system identifier and its name."""
    return conn.execute("SELECT system_identifier::text || '/' || current_database() FROM pg_control_system()"
                        ).fetchone()[0]


def server_started(conn: psycopg.Connection) -> str:
    """When the source's server started: a new value means the queue (unlogged) may have been emptied. As
    seconds since the epoch: the same whatever the session's time zone or date style."""
    return conn.execute("SELECT extract(epoch FROM pg_postmaster_start_time())::text").fetchone()[0]


def requeue_all(conn: psycopg.Connection, q: Queue) -> int:
    """Every key of the source queued once, and a NULL key (rows gone since): after the server restarted, what
    its queue held is no longer known. A key whose text is unchanged then costs a comparison. Returns keys queued."""
    with conn.transaction():
        n = conn.execute(sql.SQL("INSERT INTO {} (key) SELECT {}::text FROM {}").format(
            q.table, sql.Identifier(q.key), sql.SQL(q.source))).rowcount
        conn.execute(sql.SQL("INSERT INTO {} (key) VALUES (NULL)").format(q.table))
    return n
