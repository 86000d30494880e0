"""The map's GPU path: cuML's UMAP, when it is installed, lays out a corpus with clusters kept apart."""

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_layout_uses_cuml_when_present():
    pytest.importorskip("cuml", reason="cuML not installed (pip install cuml-cu12)")
    from embedfleet.map import layout

    rng = np.random.default_rng(0)
    centres = rng.standard_normal((4, 384))
    label = rng.integers(0, 4, 5000)
    x = centres[label] * 1.5 + rng.standard_normal((5000, 384)) / np.sqrt(384)
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    coords, method = layout(x)
    assert method == "cuml" and coords.shape == (5000, 2) and np.isfinite(coords).all()
    mean = np.stack([coords[label == k].mean(0) for k in range(4)])
    spread = max(np.linalg.norm(coords[label == k] - mean[k], axis=1).mean() for k in range(4))
    gaps = [np.linalg.norm(mean[a] - mean[b]) for a in range(4) for b in range(a + 1, 4)]
    assert min(gaps) > 2 * spread  # each topic its own island
