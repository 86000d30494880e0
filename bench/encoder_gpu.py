"""One GPU session's worth of encoder evidence: bf16 correctness against sentence-transformers,
then run_bench for the real MiniLM and the three random-weight shapes, then a profile.

    python bench/encoder_gpu.py OUT_DIR [--minilm .models/all-MiniLM-L6-v2-fp16] [--n 20000]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch


def cosine_vs_st(path: Path, texts: list[str], prompt: str | None = None) -> dict:
    """Our bf16 vectors against sentence-transformers in float32 (the reference) on the same texts."""
    from sentence_transformers import SentenceTransformer

    from embedfleet.encode.encoder import Encoder

    enc = Encoder(str(path))
    ours = enc.encode(texts, prompt=prompt)
    desc = enc.describe()
    enc.close()
    st = SentenceTransformer(str(path), device="cuda")
    st.to(torch.float32)  # transformers 5 loads in the checkpoint's dtype ("auto"); the reference is fp32
    ref = st.encode(texts, batch_size=64, normalize_embeddings=True, prompt_name=prompt)
    ref /= np.linalg.norm(ref, axis=1, keepdims=True)
    st.to(torch.bfloat16)  # how far sentence-transformers' own bf16 run is from float32, for scale
    st16 = st.encode(texts, batch_size=64, normalize_embeddings=True, prompt_name=prompt).astype(np.float32)
    st16 /= np.linalg.norm(st16, axis=1, keepdims=True)
    del st
    torch.cuda.empty_cache()
    cos, cos16, st_self = (ours * ref).sum(1), (ours * st16).sum(1), (st16 * ref).sum(1)
    return {"model": str(path), "path": desc["path"], "dtype": desc["dtype"], "prompt": prompt,
            "cos_min_vs_st_fp32": float(cos.min()), "cos_mean_vs_st_fp32": float(cos.mean()),
            "cos_min_vs_st_bf16": float(cos16.min()), "st_bf16_vs_st_fp32_min": float(st_self.min())}


def profile(path: Path, texts: list[str], out: Path) -> None:
    from torch.profiler import ProfilerActivity, profile as prof

    from embedfleet.encode.encoder import Encoder

    enc = Encoder(str(path))
    tok = enc.tokenize(texts)
    enc.embed(tok)
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        enc.embed(tok)
    enc.close()
    out.write_text(p.key_averages().table(sort_by="cuda_time_total", row_limit=25))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--minilm", default=".models/all-MiniLM-L6-v2-fp16")
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--skip", nargs="*", default=[])
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from embedfleet.encode.bench import format_bench, run_bench
    from embedfleet.encode.shapes import build_random_model
    from embedfleet.synth import review_texts

    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    texts = review_texts(2000, seed=1) + ["word " * 3000]
    tmp = Path(tempfile.mkdtemp())
    steps = {
        "cos_minilm": lambda: cosine_vs_st(Path(args.minilm), texts),
        "cos_qwen3": lambda: [cosine_vs_st(q, texts, p) for q in [build_random_model("qwen3-0.6b", tmp / "q")]
                              for p in (None, "query")],
        "bench_minilm_real": lambda: run_bench(model=args.minilm, n=args.n),
        "bench_shapes": lambda: run_bench(["minilm-l6", "bert-base", "qwen3-0.6b"], n=args.n),
        "bench_qwen3_n50k": lambda: run_bench(["qwen3-0.6b"], n=50000),
        "profile_qwen3": lambda: profile(tmp / "q", review_texts(4000), out / "profile_qwen3.txt"),
    }
    for name, fn in steps.items():
        if name in args.skip:
            continue
        t0 = time.perf_counter()
        try:
            report[name] = fn()
            if name.startswith("bench"):
                print(format_bench(report[name]), flush=True)
        except Exception:
            report[name] = {"error": traceback.format_exc()}
        print(name, f"{time.perf_counter() - t0:.1f}s", json.dumps(report[name], default=str)[:1500], flush=True)
        (out / "report.json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
