"""Errors a user can act on, and the one place that says what a psycopg or server error means.

The CLI prints `str(err)` as one line and exits with the error's code; no traceback. A lost connection is never
reported as something else, and nothing else as a lost connection. (psycopg is imported only where an error is
mapped: `import embedfleet` stays light.)
"""

from __future__ import annotations

__all__ = ["DatabaseError", "EmbedfleetError", "InputError", "JobError", "ModelError", "OptionError",
           "connection_lost", "first_line", "user_line"]


class EmbedfleetError(Exception):
    """Base: the message says what went wrong and what to do."""

    exit_code = 2


class InputError(EmbedfleetError):
    """A missing or unreadable input file, or a bad flag value."""


class OptionError(InputError):
    """A bad value of one option. The option, its value and the words stay apart, so that each caller names the
    option its own way: the CLI as a flag (`--where 'x': ...`), the server as a parameter (`where='x': ...`)."""

    def __init__(self, option: str, detail: str, value: object = None):
        self.option, self.value, self.detail = option, value, detail
        super().__init__(self.named(f"--{option}"))

    def __reduce__(self):  # raised in a process pool's worker (export's shards): made again from its parts
        return type(self), (self.option, self.detail, self.value)

    def named(self, name: str) -> str:
        """The message with the option called `name`."""
        return f"{name}: {self.detail}" if self.value is None else f"{name} {self.value!r}: {self.detail}"


class ModelError(EmbedfleetError):
    """A model that cannot be found or loaded."""


class DatabaseError(EmbedfleetError):
    """The database is unreachable, lacks pgvector, or holds something we cannot use."""


class JobError(EmbedfleetError):
    """The job finished with failed chunks, embedded nothing, or conflicts with an existing job."""

    exit_code = 1


# SQLSTATEs that mean the connection or the server went away: connection exceptions (class 08), and the
# server shutting down or crashing under it (57P01-57P03).
_GONE_CLASSES = ("08",)
_GONE_CODES = ("57P01", "57P02", "57P03")


def first_line(e: BaseException) -> str:
    """The error's own first line (the server's primary message where it sent one)."""
    diag = getattr(e, "diag", None)
    primary = getattr(diag, "message_primary", None) if diag is not None else None
    text = primary or str(e).strip()
    return (text.splitlines() or [type(e).__name__])[0]


def connection_lost(e: BaseException) -> bool:
    """Whether `e` means the connection is gone (the server stopped, restarted, or cannot be reached), as
    opposed to a statement the server refused on a working connection (an index it cannot build, a limit,
    a privilege)."""
    import psycopg

    if isinstance(e, psycopg.InterfaceError):
        return True
    if not isinstance(e, psycopg.OperationalError):
        return False
    state = getattr(e, "sqlstate", None)
    return state is None or state.startswith(_GONE_CLASSES) or state in _GONE_CODES


def user_line(e: BaseException) -> str | None:
    """One line for a database error met mid-command, or None for anything that is not one."""
    import psycopg

    if not isinstance(e, psycopg.Error):
        return None
    first = first_line(e)
    if connection_lost(e):
        return f"the database connection was lost ({first}); once the server is back, rerun the same command to resume"
    if isinstance(e, psycopg.errors.InsufficientPrivilege):
        grant = _grant_for(first)
        return (f"the database refused: {first}; " + (f"{grant}, " if grant else "ask its admin for the privilege, ")
                + "or pass --db with a role that has it")
    return f"the database refused a statement: {first} (SQLSTATE {e.sqlstate}; rerun as `embedfleet --debug …` for the traceback)"


def _grant_for(message: str) -> str | None:
    """The GRANT a "permission denied for schema|table X" needs, said for the role the command ran as."""
    import re

    m = re.match(r"permission denied for (schema|table|sequence) (\S+)", message)
    if m is None:
        return None
    kind, name = m.groups()
    what = {"schema": "USAGE ON SCHEMA", "table": "SELECT ON TABLE", "sequence": "USAGE ON SEQUENCE"}[kind]
    writes = " (and INSERT, UPDATE where the command writes it)" if kind == "table" else ""
    return f"an admin can GRANT {what} {name}{writes} TO the role this command connects as"
