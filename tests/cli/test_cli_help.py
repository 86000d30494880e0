"""`embedfleet --help` as a newcomer reads it: each command on one line with its whole summary."""

import inspect
import os
import subprocess
import sys

import pytest

from embedfleet import cli

GROUPS = [([], cli.app), (["db"], cli.db_app), (["cache"], cli.cache_app), (["jobs"], cli.jobs_app)]


@pytest.mark.parametrize("words,app", GROUPS, ids=["embedfleet", "db", "cache", "jobs"])
def test_every_command_is_listed_on_one_line_with_its_whole_summary(words, app):
    # Wide enough for any summary: a row that still breaks came from a line break inside the summary.
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}  # plain text, no ANSI
    env.update(COLUMNS="250", TERMINAL_WIDTH="250")
    out = subprocess.run([sys.executable, "-m", "embedfleet.cli", *words, "--help"], env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    for command in app.registered_commands:
        name = command.name or command.callback.__name__.replace("_", "-")
        summary = inspect.getdoc(command.callback).split("\n\n")[0]
        assert "\n" not in summary, f"{name}: its docstring's first paragraph must be one line (PEP 257)"
        rows = [line for line in out.splitlines() if line.lstrip("│ ").startswith(name + " ")]
        assert len(rows) == 1 and summary in rows[0], (name, rows)


def test_help_shows_brackets_as_written():
    """Help text is plain: `embedfleet[ray]` and TOKENS[:OVERLAP] are not taken for markup and dropped."""
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    env.update(COLUMNS="250", TERMINAL_WIDTH="250")
    out = subprocess.run([sys.executable, "-m", "embedfleet.cli", "ingest", "--help"], env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "pip install embedfleet[ray]" in out and "TOKENS[:OVERLAP]" in out


def test_train_takes_its_clear_flag_names_and_still_the_old_hidden_ones():
    from typer.testing import CliRunner

    from embedfleet.cli import app

    shown = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "200"}).output
    assert "--ranks" in shown and "--tier" in shown
    assert "--workers" not in shown and "--cache" not in shown
    # the old names still parse: a disagreement between the two spellings is refused before any work
    r = CliRunner().invoke(app, ["train", "--table", "t", "--label", "l", "--task", "classify",
                                 "--ranks", "2", "--workers", "3"])
    assert r.exit_code == 2 and "--ranks and its old name --workers disagree" in r.output


def test_version_is_the_installed_packages():
    from importlib.metadata import version

    out = subprocess.run([sys.executable, "-m", "embedfleet.cli", "--version"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out == f"embedfleet {version('embedfleet')}\n"
