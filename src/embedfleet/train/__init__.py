"""Training on stored embeddings: one bulk read into GPU memory (or pinned RAM, or streamed
windows), device-side batches, and small heads trained on one device or several (`embedfleet train`)."""

from embedfleet.train.dataset import EmbeddingDataset
from embedfleet.train.read import Split

__all__ = ["EmbeddingDataset", "Split"]
