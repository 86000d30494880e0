"""Python bytecode for what embedfleet's processes import, kept where the environment keeps none.

Container images often set PYTHONDONTWRITEBYTECODE=1 and ship site-packages without `__pycache__`:
then every process compiles torch, sympy, psycopg … from source as it imports them, each time
(docs/decisions/bytecode-cache.md).
Where Python writes no bytecode and the libraries have none, embedfleet's own processes — the CLI and
every process it starts (workers, their helpers, the trainer's ranks) — keep it under
`$EMBEDFLEET_HOME/cache/pycache` (PYTHONPYCACHEPREFIX): nothing is written next to the sources, and
`embedfleet cache clear` removes it.

EMBEDFLEET_PYCACHE: `auto` (default, as above), `1` (wherever Python keeps no bytecode itself, whether
or not the libraries have theirs), `0` (never). A PYTHONPYCACHEPREFIX the user set is left alone.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from embedfleet.errors import InputError

__all__ = ["keep_bytecode", "wants_cache"]

# A library every embedfleet process imports whose bytecode tells whether the site-packages have any.
PROBE = "torch"
MODES = ("auto", "1", "0")


def wants_cache(mode: str, probe: str = PROBE) -> bool:
    """Whether this process should keep bytecode in embedfleet's cache (see the module's docstring)."""
    if mode not in MODES:
        raise InputError(f"EMBEDFLEET_PYCACHE={mode!r}: use auto, 1 or 0")
    if mode == "0" or sys.pycache_prefix is not None:
        return False
    try:
        spec = importlib.util.find_spec(probe)  # finds the package without importing it
    except (ImportError, ValueError):
        spec = None
    origin = spec.origin if spec is not None and spec.has_location and spec.origin else None
    if origin is None or not origin.endswith(".py"):
        return mode == "1" and sys.dont_write_bytecode
    if mode == "auto" and os.path.exists(importlib.util.cache_from_source(origin)):
        return False  # the library has bytecode where Python looks: nothing to gain
    # Python will not (or cannot) write it next to the sources
    return sys.dont_write_bytecode or not os.access(os.path.dirname(origin), os.W_OK)


def keep_bytecode(settings, probe: str = PROBE) -> str | None:
    """Where wanted (`settings.pycache`): keep bytecode under the cache, in this process (the imports after this
    call) and in every process it starts (through the environment). Returns the directory, or None."""
    if not wants_cache(settings.pycache, probe):
        return None
    from embedfleet.platform.cache import cache_dir

    path = cache_dir(settings.home_path) / "pycache"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # a read-only home: as before
    sys.pycache_prefix, sys.dont_write_bytecode = str(path), False
    os.environ["PYTHONPYCACHEPREFIX"] = str(path)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    return str(path)
