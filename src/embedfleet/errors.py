"""Errors a user can act on. The CLI prints `str(err)` as one line and exits non-zero; no traceback."""


class EmbedfleetError(Exception):
    """Base: the message says what went wrong and what to do."""

    exit_code = 2


class InputError(EmbedfleetError):
    """A missing or unreadable input file, or a bad flag value."""


class ModelError(EmbedfleetError):
    """A model that cannot be found or loaded."""


class DatabaseError(EmbedfleetError):
    """The database is unreachable, lacks pgvector, or holds something we cannot use."""


class JobError(EmbedfleetError):
    """The job finished with failed chunks, or conflicts with an existing job."""

    exit_code = 1
