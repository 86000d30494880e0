"""embedfleet: embed large text corpora on every GPU you can reach, into PostgreSQL/pgvector, exactly once."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["Encoder", "__version__"]


def __getattr__(name: str):
    # Lazy: `import embedfleet` must not pull torch in (the CLI's `status`/`db` commands never need it).
    if name == "Encoder":
        from embedfleet.encode.encoder import Encoder

        return Encoder
    raise AttributeError(name)
