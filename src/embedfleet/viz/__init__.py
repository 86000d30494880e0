"""Pictures of what is stored: `map` (a 2-D UMAP of a table's vectors, as a page or an image)."""
