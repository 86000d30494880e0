"""What embedfleet keeps on disk to start faster: torch.compile's graphs, Triton's kernels, bytecode.

It lives in `$EMBEDFLEET_HOME/cache` (default `~/.embedfleet/cache`):

    inductor/        TORCHINDUCTOR_CACHE_DIR: Inductor's FX graph, AOTAutograd and autotuning caches
    triton/          TRITON_CACHE_DIR: compiled Triton kernels (ours and Inductor's)
    compiled.json    which model shapes this machine has compiled, and how long it took
    pycache/         PYTHONPYCACHEPREFIX where the environment keeps no bytecode (embedfleet.platform.bytecode)

so the second process on a machine loads compiled graphs instead of compiling them. Either variable
set by the user wins (and `embedfleet cache clear` leaves that directory alone). Everything here can
be rebuilt; `embedfleet cache clear` removes it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

__all__ = ["cache_dir", "clear", "compiled_before", "record_compiled", "use_compile_cache"]

_LOCK = threading.Lock()


def cache_dir(home: Path) -> Path:
    """The cache under an embedfleet home (Settings.home_path)."""
    return home / "cache"


def use_compile_cache(root: Path) -> None:
    """Point torch.compile's and Triton's caches here, unless the user pointed them elsewhere. Inductor
    writes its default into TORCHINDUCTOR_CACHE_DIR the first time anything asks (loading a model with
    transformers does): that value is taken as unset. `root`: the cache (`cache_dir`)."""
    ours = str(root / "inductor")
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or (os.path.abspath(current) != os.path.abspath(ours) and _inductor_default(current)):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = ours
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))


def _inductor_default(path: str) -> bool:
    """Whether `path` is the default inductor writes (<temp dir>/torchinductor_<user>). Asked of
    inductor only where it is imported already: importing it imports torch._dynamo, which a first encode on a
    GPU host would wait seconds for (docs/decisions/no-dynamo-first-call.md)."""
    path = os.path.abspath(path)
    if "torch._inductor" in sys.modules:
        try:
            from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        except ImportError:  # another torch: judged by the name below
            pass
        else:
            return path == os.path.abspath(default_cache_dir())
    head, name = os.path.split(path)
    return head == os.path.abspath(tempfile.gettempdir()) and name.startswith("torchinductor_")


def compiled_before(root: Path, key: str) -> float | None:
    """Seconds the last compile of `key` (a model shape on a device, with this torch) took on this
    machine, if its graphs are in the cache."""
    try:
        entry = json.loads((root / "compiled.json").read_text()).get(key)
    except (OSError, ValueError):
        return None
    return float(entry["seconds"]) if isinstance(entry, dict) and "seconds" in entry else None


def record_compiled(root: Path, key: str, seconds: float) -> None:
    with _LOCK:
        path = root / "compiled.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        data[key] = {"seconds": round(seconds, 3)}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1))
            tmp.replace(path)
        except OSError:
            pass  # a read-only home: the next process compiles as this one did


def clear(root: Path) -> dict:
    """Remove the cache directory `root`; returns what was removed ({"path", "files", "bytes"})."""
    files = size = 0
    if root.exists():
        for p in root.rglob("*"):
            if p.is_file() and not p.is_symlink():
                files += 1
                try:
                    size += p.stat().st_size
                except OSError:
                    pass
        shutil.rmtree(root, ignore_errors=True)
    return {"path": str(root), "files": files, "bytes": size}
