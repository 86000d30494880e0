"""Training on a table's columns: one bulk read into GPU memory (or pinned RAM, or streamed windows),
device-side batches, a torch Dataset, and small heads trained on one device or several (`embedfleet train`)."""

from embedfleet.train.dataset import EmbeddingDataset, TableDataset
from embedfleet.train.read import Split

__all__ = ["TableDataset", "EmbeddingDataset", "Split"]
