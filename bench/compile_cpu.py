"""The background compile, on a machine without a GPU: Inductor's C++ backend, a tiny random BERT.

    EMBEDFLEET_HOME=/tmp/efhome python bench/compile_cpu.py      # run twice: cold, then from the cache

An Encoder on the CPU never compiles; here its fused function is wrapped as on CUDA and a
BackgroundCompile starts at once. The caller's thread keeps encoding (checked against eager) while the
compile thread works; then prints how long the compile took, how many batches ran meanwhile, whether
any graph was compiled on the caller's thread after the switch (dynamo's unique_graphs over three more
token counts), the largest difference from eager, and Inductor's FX-graph cache hits and misses.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    from torch._dynamo.utils import counters

    from embedfleet.encode.compile import BackgroundCompile, Fused
    from embedfleet.encode.encoder import Encoder
    from embedfleet.encode.shapes import build_random_model
    from embedfleet.synth import review_texts

    path = build_random_model("minilm-l6", Path(tempfile.gettempdir()) / "embedfleet-tiny-bert", tiny=True)
    enc = Encoder(str(path), device="cpu")
    texts = review_texts(3000, seed=2)
    ref = enc.encode(texts)
    part = Fused(enc.model._post)
    enc.model._post, enc.model.fused = part, [part]
    enc._compile = job = BackgroundCompile(enc.model, torch.device("cpu"), 1000, 128, "bench-compile-cpu",
                                           start_after=0)
    job.start()
    meanwhile = 0
    while job.state == "compiling":
        out = enc.encode(texts[: 100 + meanwhile % 500])
        assert np.allclose(out, ref[: len(out)], atol=1e-5)
        meanwhile += 1
    job.wait()
    graphs = counters["stats"]["unique_graphs"]
    for k in (7, 300, 1234):
        enc.encode(texts[:k])
    diff = float(np.abs(enc.encode(texts) - ref).max())
    print(f"state {job.state}, compile {job.seconds:.2f} s (cached before: {job.cached_seconds}), "
          f"{meanwhile} batches on the caller's thread meanwhile, graphs {graphs} -> "
          f"{counters['stats']['unique_graphs']} after three more token counts, max |diff| {diff:.1e}, "
          f"inductor {dict(counters['inductor'])}")
    print(f"report {job.report()}")  # what a worker's startup.compile carries


if __name__ == "__main__":
    main()
