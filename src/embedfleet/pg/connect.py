"""Connections to PostgreSQL: one that says in one line why it cannot be made, and one that comes back when the
server went away and returned (with backoff, for a bounded patience)."""

from __future__ import annotations

import logging
import time
from typing import Callable

import psycopg

from embedfleet.errors import DatabaseError, first_line

__all__ = ["Reconnect", "connect", "lost"]

log = logging.getLogger("embedfleet.pg")


def connect(dsn: str, what: str = "--db / EMBEDFLEET_DB", **kw) -> psycopg.Connection:
    """An autocommit connection, or one line naming the flag (`what`) whose database cannot be reached."""
    try:
        return psycopg.connect(dsn, autocommit=True, **kw)
    except psycopg.ProgrammingError as e:  # not a connection string at all (it may hold a password: not echoed)
        raise DatabaseError(f"{what} is not a PostgreSQL connection string ({first_line(e)}); "
                            "give postgresql://USER@HOST:PORT/DATABASE") from None
    except psycopg.OperationalError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        db = "the database" if what.startswith("--db") else f"the {what.split(' /')[0]} database"
        raise DatabaseError(f"cannot connect to {db} ({first}); check {what}") from None


def lost(conn: psycopg.Connection, err: BaseException) -> bool:
    """Whether `err` means the connection is gone (the server stopped, restarted, or cannot be reached),
    as opposed to a statement that failed on a working connection."""
    return isinstance(err, (psycopg.OperationalError, psycopg.InterfaceError)) and (conn.closed or conn.broken)


class Reconnect:
    """Connects again to a database that went away, with backoff, for at most `patience` seconds per
    outage; `setup(conn)` runs on each new connection. Past that, a DatabaseError ends the caller."""

    def __init__(self, dsn: str, patience: float, setup: Callable[[psycopg.Connection], None] | None = None):
        self.dsn, self.patience, self.setup = dsn, patience, setup

    def first(self) -> psycopg.Connection:
        conn = connect(self.dsn)
        if self.setup:
            self.setup(conn)
        return conn

    def __call__(self, err: BaseException) -> psycopg.Connection:
        if self.patience <= 0:
            raise DatabaseError(f"lost the database ({str(err).strip().splitlines()[0] if str(err).strip() else err!r}); "
                                "rerun the same command to resume once it is back") from None
        deadline, pause = time.monotonic() + self.patience, 0.25
        log.warning("lost the database (%s); reconnecting for up to %.0f s", str(err).strip().splitlines()[0]
                    if str(err).strip() else type(err).__name__, self.patience)
        while True:
            time.sleep(pause)
            try:
                return self.first()
            except DatabaseError:
                if time.monotonic() + pause > deadline:
                    raise DatabaseError(f"the database has been unreachable for {self.patience:.0f} s; "
                                        "rerun the same command to resume once it is back") from None
                pause = min(5.0, pause * 2)
