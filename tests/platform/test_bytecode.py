"""Bytecode kept under $EMBEDFLEET_HOME where the environment keeps none (embedfleet.platform.bytecode).

Each case runs in a fresh interpreter: where Python keeps bytecode is process-wide state.
"""

from __future__ import annotations

import compileall
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# What a child process reports: where Python keeps bytecode, and whether it writes any.
_REPORT = "import sys, json; print(json.dumps([sys.pycache_prefix, sys.dont_write_bytecode]))"


def _probe(tmp_path: Path) -> Path:
    """A library with no bytecode: the probe keep_bytecode asks about."""
    pkg = tmp_path / "lib" / "probe_lib"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 41 + 1\n")
    (pkg / "part.py").write_text("PART = 'imported after'\n")
    return pkg


def _run(tmp_path: Path, code: str, **env_over) -> list:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONDONTWRITE", "PYTHONPYCACHE", "EMBEDFLEET_PYCACHE"))}
    env.update(EMBEDFLEET_HOME=str(tmp_path / "home"), PYTHONPATH=os.pathsep.join([str(tmp_path / "lib"), *sys.path]))
    env.update({k: v for k, v in env_over.items() if v is not None})
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return [json.loads(line) for line in p.stdout.splitlines()]


_KEEP = ("from embedfleet.platform.bytecode import keep_bytecode; from embedfleet.settings import Settings\n"
         "print(__import__('json').dumps(keep_bytecode(Settings.from_env(), 'probe_lib')))\n"
         "import probe_lib.part\n" + _REPORT + "\n"
         "import subprocess, sys; subprocess.run([sys.executable, '-c', " + repr(_REPORT) + "], check=True)")


def test_a_library_without_bytecode_gets_it_under_the_cache_here_and_in_children(tmp_path):
    pkg = _probe(tmp_path)
    kept, here, child = _run(tmp_path, _KEEP, PYTHONDONTWRITEBYTECODE="1")
    cache = tmp_path / "home" / "cache" / "pycache"
    assert kept == str(cache)
    assert here == [str(cache), False] and child == [str(cache), False]  # the child inherits it
    written = {p.name.split(".")[0] for p in cache.rglob("*.pyc")}
    assert {"__init__", "part"} <= written  # the probe's modules imported after the call
    assert not (pkg / "__pycache__").exists()  # nothing written next to the sources
    assert (cache / str(pkg).lstrip(os.sep) / "part.cpython-{}{}.pyc".format(*sys.version_info[:2])).exists()


def test_where_bytecode_exists_or_python_writes_it_nothing_changes(tmp_path):
    pkg = _probe(tmp_path)
    # Python writes bytecode next to writable sources: nothing to do
    kept, here, _child = _run(tmp_path, _KEEP)
    assert kept is None and here == [None, False]
    # the library has bytecode already (an image built with compileall)
    for p in pkg.glob("__pycache__"):
        for f in p.iterdir():
            f.unlink()
    assert compileall.compile_dir(str(pkg), quiet=1)
    kept, here, _child = _run(tmp_path, _KEEP, PYTHONDONTWRITEBYTECODE="1")
    assert kept is None and here == [None, True]
    assert not (tmp_path / "home" / "cache" / "pycache").exists()


@pytest.mark.parametrize("mode, user_prefix, kept", [("0", None, False), ("1", None, True), ("auto", "USER", False)])
def test_the_knob_and_a_users_prefix(tmp_path, mode, user_prefix, kept):
    _probe(tmp_path)
    prefix = str(tmp_path / "user-prefix") if user_prefix else None
    got, here, _child = _run(tmp_path, _KEEP, PYTHONDONTWRITEBYTECODE="1", EMBEDFLEET_PYCACHE=mode,
                             PYTHONPYCACHEPREFIX=prefix)
    assert (got is not None) == kept
    if prefix:
        assert here == [prefix, True]  # the user's setting, untouched


def test_the_cli_keeps_bytecode_for_its_process_and_children(tmp_path):
    code = ("import sys\nfrom embedfleet.cli import main\nsys.argv = ['embedfleet', 'cache', 'path']\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n" + _REPORT + "\nimport os; print(__import__('json').dumps("
            "[os.environ.get('PYTHONPYCACHEPREFIX'), 'PYTHONDONTWRITEBYTECODE' in os.environ]))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONDONTWRITE", "PYTHONPYCACHE", "EMBEDFLEET_PYCACHE"))}
    env.update(EMBEDFLEET_HOME=str(tmp_path / "home"), PYTHONDONTWRITEBYTECODE="1", EMBEDFLEET_PYCACHE="1")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    cache = str(tmp_path / "home" / "cache" / "pycache")
    lines = p.stdout.splitlines()
    assert lines[0] == str(tmp_path / "home" / "cache")  # the command ran
    assert json.loads(lines[1]) == [cache, False] and json.loads(lines[2]) == [cache, False]
    # and `cache clear` removes it with the rest
    p = subprocess.run([sys.executable, "-m", "embedfleet.cli", "cache", "clear", "--json"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert not Path(cache).exists()


def test_mode_1_keeps_it_even_where_the_library_has_bytecode_and_a_bad_value_is_one_line(tmp_path):
    pkg = _probe(tmp_path)
    assert compileall.compile_dir(str(pkg), quiet=1)
    kept, here, _child = _run(tmp_path, _KEEP, PYTHONDONTWRITEBYTECODE="1", EMBEDFLEET_PYCACHE="1")
    assert kept == str(tmp_path / "home" / "cache" / "pycache") and here == [kept, False]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONDONTWRITE", "PYTHONPYCACHE"))}
    env.update(EMBEDFLEET_HOME=str(tmp_path / "home"), EMBEDFLEET_PYCACHE="yes")
    p = subprocess.run([sys.executable, "-m", "embedfleet.cli", "cache", "path"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode != 0 and p.stderr.strip() == "error: EMBEDFLEET_PYCACHE='yes': use auto, 1 or 0"
