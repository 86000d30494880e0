"""Where an input's bytes come from: a local path, or a URL read through fsspec.

A source is a string. A local path is made absolute and read with the builtin open/seek (the hot
path pays nothing for URLs). A URL with a protocol ("file://", "s3://", "gs://", "hf://",
"memory://", …) is kept as a URL and read through its fsspec filesystem, so every host of a fleet
reads its own chunks of one big object with range requests:

- `read_range` fetches exactly [start, end) — no read-ahead past a chunk's end;
- `open_sequential` (compressed streams, CSV) reads ahead in large requests;
- `open_random` (Parquet) fetches exactly what pyarrow asks for.

A protocol whose library is not installed, an unknown protocol and a missing object are one-line
InputErrors (a missing URL reads like a missing path: "input not found: …").
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterator
from typing import IO

from embedfleet.errors import InputError

__all__ = ["absolute", "expand", "fingerprint", "is_url", "open_random", "open_sequential", "read_range", "same_file",
           "size"]

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
_LOCAL_READ = 1 << 20
# Each request to an object store is a round trip (tens of ms on S3): read in big pieces.
_URL_READ = 16 << 20
_EXTRAS = {"s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}


def is_url(source: str) -> bool:
    """True for "protocol://…" (fsspec), False for a local path."""
    return _URL.match(source) is not None


def absolute(source: str) -> str:
    """A local path made absolute; a URL as it is."""
    return source if is_url(source) else os.path.abspath(source)


def same_file(source: str) -> str:
    """What names the file itself: a file:// URL's local path (so that a file named both ways is one input)."""
    return _filesystem(source)[1] if source[:7].lower() == "file://" else source


def _filesystem(url: str):
    """(fsspec filesystem, path inside it); a missing library or unknown protocol is an InputError."""
    import fsspec.core

    protocol = url.split("://", 1)[0].lower()
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:
        package, extra = _EXTRAS.get(protocol, (None, None))
        if package:
            raise InputError(f"reading {protocol}:// needs {package}: pip install embedfleet[{extra}]") from None
        raise InputError(f"reading {protocol}:// needs a package that is not installed: {e}") from None
    except ValueError as e:
        if "Protocol not known" not in str(e):
            raise InputError(f"bad input URL {url}: {e}") from None
        raise InputError(f"unknown protocol {protocol}:// in {url} (fsspec knows file, memory, s3, gs, hf, http, …)") from None


def expand(item: str) -> list[str]:
    """The files an input names: itself, or a glob's matches (with ** recursion), sorted.
    URLs come back in the filesystem's canonical spelling ("memory://x" -> "memory:///x")."""
    if not is_url(item):
        if glob.has_magic(item):
            files = [os.path.abspath(p) for p in glob.glob(os.path.expanduser(item), recursive=True) if os.path.isfile(p)]
            if not files:
                raise InputError(f"input not found: {item} (the pattern matches no files)")
            return sorted(files)
        if os.path.isdir(item):
            raise InputError(f"input is a directory: {item} (pass its files, e.g. '{item.rstrip('/')}/*.jsonl')")
        if not os.path.isfile(item):
            raise InputError(f"input not found: {item}")
        return [os.path.abspath(item)]
    fs, path = _filesystem(item)
    try:
        if glob.has_magic(path):
            files = [p for p, info in fs.glob(path, detail=True).items() if info.get("type") == "file"]
            if not files:
                raise InputError(f"input not found: {item} (the pattern matches no files)")
            return sorted(fs.unstrip_protocol(p) for p in files)
        info = fs.info(path)
    except FileNotFoundError:
        raise InputError(f"input not found: {item}") from None
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001 - credentials, permissions, network: the library's words, one line
        raise InputError(f"cannot read input {item}: {type(e).__name__}: {e}") from None
    if info.get("type") == "directory":
        raise InputError(f"input is a directory: {item} (pass its files, e.g. '{item.rstrip('/')}/*.jsonl')")
    return [fs.unstrip_protocol(path)]


def size(source: str) -> int:
    """The source's size in bytes; FileNotFoundError when it is gone."""
    if not is_url(source):
        return os.path.getsize(source)
    fs, path = _filesystem(source)
    return fs.size(path)


def fingerprint(source: str) -> str:
    """A string that changes when the source's contents may have: path, size and mtime for a local
    file; the URL and the filesystem's key (ETag, or size and time) for a URL."""
    if not is_url(source):
        st = os.stat(source)
        return f"{os.path.abspath(source)}|{st.st_size}|{st.st_mtime_ns}"
    fs, path = _filesystem(source)
    return f"{source}|{fs.ukey(path)}"


def open_sequential(source: str) -> IO[bytes]:
    """The source's raw bytes, to read from the start in order (a URL reads ahead in big requests)."""
    if not is_url(source):
        return open(source, "rb")
    fs, path = _filesystem(source)
    return fs.open(path, "rb", block_size=_URL_READ, cache_type="readahead")


def open_random(source: str) -> IO[bytes]:
    """The source's raw bytes for seeks and reads; a URL fetches exactly what each read asks for."""
    if not is_url(source):
        return open(source, "rb")
    fs, path = _filesystem(source)
    return fs.open(path, "rb", cache_type="none")


def read_range(source: str, start: int, end: int | None = None, block: int | None = None) -> Iterator[bytes]:
    """The bytes [start, end) of the source (end None: to its end) in blocks of `block` (default
    1 MiB); a remote URL's in range requests of at least 16 MiB, none past `end`."""
    block = block or _LOCAL_READ
    if is_url(source):
        fs, path = _filesystem(source)
        f = fs.open(path, "rb", cache_type="none")
        if not _local(fs):
            block = max(block, _URL_READ)
    else:
        f = open(source, "rb")
    with f:
        f.seek(start)
        left = -1 if end is None else end - start
        while left:
            data = f.read(block if left < 0 else min(block, left))
            if not data:
                return
            if left > 0:
                left -= len(data)
            yield data


def _local(fs) -> bool:
    """file:// has no round trips to save, and blocks past the CPU caches scan slower
    (docs/decisions/input-block-sizes.md)."""
    return "file" in ((fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol)
