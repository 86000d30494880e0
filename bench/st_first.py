"""sentence-transformers' first call alone (constructor included, a fresh process), at the batch sizes
given in turn until one fits: for text sets where its usual batch of 256 runs out of GPU memory.

    python bench/st_first.py --shape qwen3-0.6b --texts world --n 20000 --batches 32,16
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(model: str, texts_file: str, batch: int) -> None:
    import torch
    import sentence_transformers  # noqa: F401 - imported before the clock, as `embedfleet bench` does

    from sentence_transformers import SentenceTransformer

    texts = json.loads(Path(texts_file).read_text())
    t0 = time.perf_counter()
    model = SentenceTransformer(model, device="cuda")
    model.to(torch.bfloat16)
    model.encode(texts, batch_size=batch, normalize_embeddings=True, convert_to_numpy=True)
    torch.cuda.synchronize()
    print(json.dumps({"batch": batch, "first_s": time.perf_counter() - t0}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--texts", default="world")
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--batches", default="32,16")
    a = ap.parse_args()
    from embedfleet.encode.bench import _texts
    from embedfleet.encode.shapes import build_random_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_random_model(a.shape, Path(tmp) / a.shape)
        texts_file = Path(tmp) / "texts.json"
        texts_file.write_text(json.dumps(_texts(a.texts, a.n, 0)))
        for batch in (int(b) for b in a.batches.split(",")):
            p = subprocess.run([sys.executable, __file__, "child", str(model), str(texts_file), str(batch)],
                               capture_output=True, text=True)
            line = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
            print(line or json.dumps({"batch": batch, "failed": p.stderr.strip().splitlines()[-1][:300]}), flush=True)
            if line:
                return


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
