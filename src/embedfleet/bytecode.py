"""Python bytecode for what embedfleet's processes import, kept where the environment keeps none.

Container images often set PYTHONDONTWRITEBYTECODE=1 and ship site-packages without `__pycache__`:
then every process compiles torch, sympy, psycopg … from source as it imports them, each time. On an
H100 host so set up, that was 3.7 s of `import torch` (1.2–2.0 s with bytecode) and 7 of the 9.4 s a
cached torch.compile took (bench/NOTES.md, runs 80–81). Where Python writes no bytecode and the
libraries have none, embedfleet's own processes — the CLI and every process it starts (workers, their
helpers, the trainer's ranks) — keep it under `$EMBEDFLEET_HOME/cache/pycache` (PYTHONPYCACHEPREFIX):
nothing is written next to the sources, and `embedfleet cache clear` removes it.

EMBEDFLEET_PYCACHE: `auto` (default, as above), `1` (whenever Python writes no bytecode), `0` (never).
A PYTHONPYCACHEPREFIX the user set is left alone.
"""

from __future__ import annotations

import importlib.util
import os
import sys

__all__ = ["keep_bytecode", "wants_cache"]

# A library every embedfleet process imports whose bytecode tells whether the site-packages have any.
PROBE = "torch"


def wants_cache(mode: str, probe: str = PROBE) -> bool:
    """Whether this process should keep bytecode in embedfleet's cache (see the module's docstring)."""
    if mode == "0" or sys.pycache_prefix is not None:
        return False
    if mode == "1":
        return sys.dont_write_bytecode
    try:
        spec = importlib.util.find_spec(probe)  # finds the package without importing it
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.has_location or not spec.origin or not spec.origin.endswith(".py"):
        return False
    if os.path.exists(importlib.util.cache_from_source(spec.origin)):
        return False  # the library has bytecode where Python looks: nothing to gain
    # None there, and Python will not (or cannot) write it next to the sources
    return sys.dont_write_bytecode or not os.access(os.path.dirname(spec.origin), os.W_OK)


def keep_bytecode(probe: str = PROBE) -> str | None:
    """Where wanted: keep bytecode under the cache, in this process (the imports after this call) and
    in every process it starts (through the environment). Returns the directory, or None."""
    if not wants_cache(os.environ.get("EMBEDFLEET_PYCACHE", "auto"), probe):
        return None
    from embedfleet.cache import cache_dir

    path = cache_dir() / "pycache"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # a read-only home: as before
    sys.pycache_prefix, sys.dont_write_bytecode = str(path), False
    os.environ["PYTHONPYCACHEPREFIX"] = str(path)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    return str(path)
