"""embedfleet: move data between PostgreSQL and GPUs, fast and exactly once.

Public names, imported lazily (`import embedfleet` pulls no torch in: `status` and `db` never need it):

    Encoder            texts to L2-normalised vectors, on the packed forward pass (embedfleet.encode)
    TableDataset       a table's columns read once, iterated as device-side batches; a torch Dataset (embedfleet.train)
    EmbeddingDataset   TableDataset over the table's vector column
    Searcher           a table's nearest rows to a query vector: filters, hybrid, binary index (embedfleet.query.search)
    Settings           every EMBEDFLEET_* knob, declared once (embedfleet.settings)
    EmbedfleetError…   the errors a user can act on (embedfleet.errors)
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["DatabaseError", "EmbedfleetError", "EmbeddingDataset", "Encoder", "InputError", "JobError", "ModelError",
           "Searcher", "Settings", "TableDataset", "__version__"]

_WHERE = {"Encoder": "embedfleet.encode.encoder", "EmbeddingDataset": "embedfleet.train.dataset",
          "TableDataset": "embedfleet.train.dataset", "Searcher": "embedfleet.query.search",
          "Settings": "embedfleet.settings", "EmbedfleetError": "embedfleet.errors", "InputError": "embedfleet.errors",
          "ModelError": "embedfleet.errors", "DatabaseError": "embedfleet.errors", "JobError": "embedfleet.errors"}


def __getattr__(name: str):
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(name)
