"""A stand-in encoder: no model, no torch. Each text's vector is a unit vector derived from a hash of its
token ids, so equal texts get equal vectors and a test can check every row. It lets tests drive the
real worker loop in-process — helpers, ledger, writers, fencing — the way httpx's MockTransport lets
tests drive the real client.

    Worker(job, dsn, "w0", settings=s, encoder=lambda cfg, device: HashEncoder()).run()
"""

from __future__ import annotations

import hashlib

import numpy as np

from embedfleet.encode.batching import cumulative

__all__ = ["HashEncoder", "hash_vectors"]


def hash_vectors(ids: np.ndarray, lengths: np.ndarray, dim: int) -> np.ndarray:
    """One float32 unit vector per packed sequence, a function of that sequence's ids alone."""
    out = np.empty((len(lengths), dim), np.float32)
    ends = cumulative(lengths)
    for i in range(len(lengths)):
        seed = int.from_bytes(hashlib.blake2b(ids[ends[i]:ends[i + 1]].tobytes(), digest_size=8).digest(), "little")
        v = np.random.default_rng(seed).standard_normal(dim)
        out[i] = v / np.linalg.norm(v)
    return out


class _Done:
    def __init__(self, vectors: np.ndarray):
        self._vectors = vectors

    def result(self) -> np.ndarray:
        return self._vectors


class HashEncoder:
    """What the worker needs of an encoder: `dim`, `name`, `device`, `digest()`, `embed_async(tok).result()`,
    `warmup()`, `compile_report()`, `close()`."""

    def __init__(self, dim: int = 384, name: str = "hash-encoder"):
        self.dim, self.name, self.device = dim, name, "cpu"
        self.small = True  # no forward pass at all
        self.texts = 0  # how many texts it embedded (tests read it)

    def digest(self) -> str:
        """What it computes: hashes of this width."""
        return f"{self.name}-{self.dim}"

    def embed_async(self, tok) -> _Done:
        """Vectors of a `Tokenized` batch (longest first) back in input order."""
        self.texts += len(tok)
        return _Done(hash_vectors(tok.ids, tok.lengths, self.dim)[tok.inverse])

    def warmup(self, wait: bool = True, compile: bool = True) -> None:
        pass

    def compile_report(self) -> None:  # nothing compiles
        return None

    def wait_compiled(self, timeout: float | None = None) -> bool:
        return True

    def close(self) -> None:
        pass
