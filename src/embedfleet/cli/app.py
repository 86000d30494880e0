"""The command line's shared parts: the app and its groups, the settings a command resolves once, one JSON
document on stdout, and the one boundary where errors become a line and an exit code (`main`)."""

from __future__ import annotations

import signal
import sys

import click
import orjson
import typer

from embedfleet.errors import EmbedfleetError
from embedfleet.settings import Settings

__all__ = ["DbOpt", "TrustOpt", "app", "cache_app", "db_app", "emit", "jobs_app", "knobs", "main", "state",
           "with_flags"]

# Help text is rich markup: a literal bracket is escaped with a backslash, or rich takes "[ray]" for a style.
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Embed large text corpora on every GPU you can reach, into PostgreSQL/pgvector, exactly once.")
db_app = typer.Typer(no_args_is_help=True, help="The embedded PostgreSQL server (used when no --db is given).")
jobs_app = typer.Typer(no_args_is_help=True, help="The jobs in the ledger (`embedfleet status` lists them).")
cache_app = typer.Typer(no_args_is_help=True, help="Compiled graphs, kernels and bytecode kept under $EMBEDFLEET_HOME/cache.")

# resumes: an interrupted run resumes when rerun; following: a stop is how the command ends (sync --follow), exit 0
state: dict = {"debug": False, "settings": None, "resumes": False, "following": False}
DbOpt = typer.Option(None, "--db", help="postgresql://… DSN (default: $EMBEDFLEET_DB, else the embedded server)")
# Every command that loads a model takes it.
TrustOpt = typer.Option(False, "--trust-remote-code", help="run the model's own Python code (its config.json's "
                        "auto_map: jina, gte-multilingual…), as transformers does with trust_remote_code=True")


def knobs() -> Settings:
    """This command's settings, resolved once when it started (`_root`)."""
    if state["settings"] is None:
        state["settings"] = Settings.from_env()
    return state["settings"]


def with_flags(settings: Settings, **flags) -> Settings:
    """`settings` with the flags a command was given (None: not given) in place of their variables."""
    from dataclasses import replace

    given = {k: v for k, v in flags.items() if v is not None}
    return replace(settings, **given) if given else settings


def check_where(where: str | None) -> str | None:
    """--where's callback: an empty filter is refused, as a blank one is, rather than read as no filter."""
    if where is not None and not where.strip():
        from embedfleet.errors import OptionError

        raise OptionError("where", "it is empty; give one condition, as after WHERE, or leave --where out", where)
    return where


def emit(doc) -> None:
    sys.stdout.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2, default=str).decode() + "\n")


def _version(shown: bool) -> None:
    if shown:
        from importlib.metadata import version

        typer.echo(f"embedfleet {version('embedfleet')}")
        raise typer.Exit()


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
          _: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit.")) -> None:
    from embedfleet.logs import setup_logging
    from embedfleet.platform.bytecode import keep_bytecode

    settings = knobs()
    state["debug"] = debug or settings.debug
    keep_bytecode(settings)  # before torch & co. are imported, here and in every process this one starts
    setup_logging(state["debug"])


_SIGNAL: dict = {"received": None}


def _interrupt(signum, frame) -> None:
    """Ctrl-C, and SIGTERM the same way: workers stopped, their chunks freed, the job "interrupted"."""
    _SIGNAL["received"] = signum
    raise KeyboardInterrupt


def stopped_on_purpose() -> None:
    """A command that runs until interrupted (serve, status --watch) ends as the user asked: no message."""
    _SIGNAL["received"] = None


def _interrupted() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one does not cut the message short
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    typer.echo("interrupted: rerun the same command to resume" if state["resumes"] else "interrupted", err=True)
    sys.exit(0 if state["following"] else 128 + (_SIGNAL["received"] or signal.SIGINT))


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        state["settings"] = Settings.from_env()  # read once, before any command: a bad value is one line
        rc = app(standalone_mode=False)  # returns typer.Exit's code instead of raising it
        if _SIGNAL["received"] is not None:  # typer turns an interrupt into a silent 130
            _interrupted()
        sys.exit(rc if isinstance(rc, int) else 0)
    except EmbedfleetError as e:
        if state["debug"]:
            raise
        typer.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (KeyboardInterrupt, click.exceptions.Abort):  # older typer: click turns a KeyboardInterrupt into Abort
        _interrupted()
    except Exception as e:
        if hasattr(e, "show") and hasattr(e, "exit_code"):  # click's usage errors: bad flag, missing argument
            e.show()
            sys.exit(e.exit_code)
        if state["debug"]:
            raise
        from embedfleet.errors import user_line

        line = user_line(e) or f"{type(e).__name__}: {e} (rerun as `embedfleet --debug …` for the traceback)"
        typer.echo(f"error: {line}", err=True)
        sys.exit(1)
