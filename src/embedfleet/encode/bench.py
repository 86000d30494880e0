"""This Encoder against sentence-transformers as users meet both: each measurement in a fresh process.

For every model (a random-weight shape or a real directory) and every text set, five processes:

    ours         (a) Encoder(...) then one encode of the N texts, the constructor included (the
                 first call); then (b) the steady state: warmup() (compile, helpers), the same encode
                 again; MFU counts real tokens' matmul and attention FLOPs against the bf16 matmul
                 peak measured there
    ours-script  (a) again from a script that imports torch and sentence_transformers at its top
    ours-query   (c) Encoder(...) and one query (cold), then the median of 20 more (warm)
    st           (a) and (b) for SentenceTransformer(...) at its best on the device (`best_settings`),
                 constructor included
    st-query     (c) for sentence-transformers

Imports are not timed on either side (`torch`, `sentence_transformers`): from the constructor on.
Both sides go from a list of strings to normalised vectors on the host (tokenisation included).
Text sets: "reviews" (`synth.review_texts`, ASCII English) and "world" (`synth.world_texts`: accents,
CJK, emoji, curly quotes; 1% of texts past 1,000 words).

    python -m embedfleet.encode.bench child KIND SPEC.json     (what each process runs)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

__all__ = ["TEXT_SETS", "format_bench", "matmul_peak_tflops", "run_bench"]

TEXT_SETS = ("reviews", "world")
_QUERIES = 21  # one cold, 20 warm


def matmul_peak_tflops(device, size: int = 8192, iters: int = 10) -> float | None:
    """bf16 dense matmul rate of this GPU, TFLOP/s (CUDA events, after warm-up)."""
    import torch

    if device.type != "cuda":
        return None
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    end.synchronize()
    return 2 * size**3 * iters / (start.elapsed_time(end) / 1e3) / 1e12


def _texts(name: str, n: int, seed: int) -> list[str]:
    from embedfleet.synth import review_texts, world_texts

    if name == "reviews":
        return review_texts(n, seed)
    if name == "world":
        return world_texts(n, seed)
    raise ValueError(f"unknown text set {name!r}: choose from {', '.join(TEXT_SETS)}")


# --- the parent: one process per measurement --------------------------------------------------------

_SCRIPT = """import torch, sentence_transformers  # noqa: F401 - what a user's script has at its top
from embedfleet.encode.bench import _child_main

if __name__ == "__main__":
    _child_main()
"""


def _run_child(kind: str, spec: dict, tmp: Path, script: bool = False) -> dict:
    """Run one measurement in a fresh process; its result, or {"error": ...}."""
    spec_file = tmp / f"spec-{kind}-{time.monotonic_ns()}.json"
    spec_file.write_text(json.dumps(spec))
    root = str(Path(__file__).resolve().parents[2])  # this package's parent, for the child to import it
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    if script:
        path = tmp / "user_script.py"
        path.write_text(_SCRIPT)
        cmd = [sys.executable, str(path), "child", kind, str(spec_file)]
    else:
        cmd = [sys.executable, "-m", "embedfleet.encode.bench", "child", kind, str(spec_file)]
    print(f"[bench] {spec['label']} / {spec['set']}: {kind}{' (script importing torch + ST)' if script else ''}",
          file=sys.stderr, flush=True)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, env=env, timeout=3600)
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        return {"error": f"{kind} exited {p.returncode}"}
    return json.loads(lines[-1])


def _cosines(a_file: str, b_file: str) -> tuple[float, float] | None:
    try:
        a, b = np.load(a_file), np.load(b_file)
    except OSError:
        return None
    b = b[:, : a.shape[1]].astype(np.float32)
    b /= np.linalg.norm(b, axis=1, keepdims=True)
    cos = (a * b).sum(1)
    return float(cos.min()), float(cos.mean())


def _measure(label: str, path: Path, set_name: str, texts_file: Path, n: int, device: str, st: bool,
             st_batch: int, batch_tokens, tmp: Path, user_view: bool, best: dict | None = None,
             trust_remote_code: bool = False) -> dict:
    best = best or best_settings(device)
    spec = {"label": label, "set": set_name, "model": str(path), "texts": str(texts_file), "device": device,
            "batch_tokens": batch_tokens, "st_batch": st_batch, "vectors": str(tmp / f"ours-{label}-{set_name}.npy"),
            "dtype": best["dtype"], "st_dtype": best["st_dtype"], "trust_remote_code": trust_remote_code}
    row: dict = {"label": label, "text_set": set_name, "n": n, "st_dtype": best["st_dtype"], "st_batch": st_batch}
    ours = _run_child("ours", spec, tmp)
    row.update(ours)
    if user_view:
        script = _run_child("ours", {**spec, "vectors": None}, tmp, script=True)
        row["script_first_s"] = script.get("first_s")
        query = _run_child("query", spec, tmp)
        row.update(query_cold_s=query.get("cold_s"), query_p50_ms=query.get("p50_ms"))
    if st:
        st_spec = {**spec, "vectors": str(tmp / f"st-{label}-{set_name}.npy")}
        ref = _run_child("st", st_spec, tmp)
        row.update(st_first_s=ref.get("first_s"), st_seconds=ref.get("seconds"))
        if user_view:
            st_q = _run_child("st_query", st_spec, tmp)
            row.update(st_query_cold_s=st_q.get("cold_s"), st_query_p50_ms=st_q.get("p50_ms"))
        cos = _cosines(spec["vectors"], st_spec["vectors"])
        if cos:
            row.update(cosine_min=cos[0], cosine_mean=cos[1])
    _derive(row)
    return row


def _derive(row: dict) -> None:
    """Rates and ratios from the measured seconds."""
    n = row["n"]

    def rate(key):
        return n / row[key] if row.get(key) else None

    row.update(texts_s=rate("seconds"), first_texts_s=rate("first_s"), st_texts_s=rate("st_seconds"),
               st_first_texts_s=rate("st_first_s"))
    if row.get("seconds"):
        row["tokens_s"] = row["tokens"] / row["seconds"]
        row["tflops"] = row["flops"] / row["seconds"] / 1e12
        row["mfu"] = row["tflops"] / row["peak_bf16_tflops"] if row.get("peak_bf16_tflops") else None
    for key, ours, theirs in (("speedup", "seconds", "st_seconds"), ("first_speedup", "first_s", "st_first_s"),
                              ("script_ratio", "first_s", "script_first_s"),
                              ("query_speedup", "query_cold_s", "st_query_cold_s")):
        if row.get(ours) and row.get(theirs):
            row[key] = row[theirs] / row[ours] if key != "script_ratio" else row[ours] / row[theirs]


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX): there bf16 is the faster setting, elsewhere
    far slower than float32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def best_settings(device: str) -> dict:
    """Each tool at its best on the device: on a GPU bf16 (sentence-transformers at batch 256, ours at its
    own dtype); on a CPU the dtype this CPU is fastest in, for both, and sentence-transformers at its own
    default batch of 32 (larger batches pad long-tailed texts to their longest)."""
    if device.startswith("cuda"):
        return {"dtype": None, "st_dtype": "bfloat16", "st_batch": 256}
    dtype = "bfloat16" if cpu_has_bf16() else "float32"
    return {"dtype": dtype, "st_dtype": dtype, "st_batch": 32}


def _bench_device(device: str) -> str:
    """"auto" as the children will take it, without touching the GPU here: NVML counts the GPUs."""
    if device != "auto":
        return device
    from embedfleet.platform.gpu import visible_gpu_count

    return "cuda" if visible_gpu_count() else "cpu"


def run_bench(shapes: list[str] | None = None, model: str | None = None, n: int | None = None, device="auto",
              st: bool = True, st_batch: int | None = None, batch_tokens="auto", seed: int = 0,
              texts: list[str] | None = None, text_sets: list[str] | None = None, user_view: bool = True,
              trust_remote_code: bool = False) -> dict:
    """`texts` replaces the generated text sets (e.g. an ingest corpus's own contents); `user_view`
    False skips the script and query processes; `trust_remote_code` lets both tools run a model's own code. This process never touches the GPU: every
    measurement runs in a fresh one. On a CPU, without --shape, only the MiniLM shape, on fewer texts."""
    import torch

    from embedfleet.encode.shapes import SHAPES, build_random_model

    if model:  # a model it cannot load is one line here, not empty rows from the processes that measure
        from embedfleet.encode.models import check_model

        check_model(model, trust_remote_code)
    device = _bench_device(str(device))
    best = best_settings(device)
    st_batch = st_batch or best["st_batch"]
    on_cpu = not device.startswith("cuda")
    n = n or (1000 if on_cpu else 20000)
    if on_cpu and not shapes and not model:
        shapes = ["minilm-l6"]
    sets = {"custom": list(texts)} if texts is not None else {s: _texts(s, n, seed) for s in text_sets or TEXT_SETS}
    rows = []
    with tempfile.TemporaryDirectory(prefix="embedfleet-bench-") as tmp_name:
        tmp = Path(tmp_name)
        targets = [(Path(model).name, Path(model))] if model else []
        for shape in shapes or ([] if model else list(SHAPES)):
            targets.append((shape, build_random_model(shape, tmp / shape, seed=seed)))
        files = {}
        for name, items in sets.items():
            files[name] = tmp / f"texts-{name}.json"
            files[name].write_text(json.dumps(items))
        for label, path in targets:
            for name in sets:
                rows.append(_measure(label, path, name, files[name], len(sets[name]), str(device), st, st_batch,
                                     batch_tokens, tmp, user_view, best, trust_remote_code))
                # each row as soon as it is measured: a run stopped part way keeps what it measured
                print("[bench] row " + json.dumps(rows[-1], default=str), file=sys.stderr, flush=True)
    first = next((r for r in rows if r.get("gpu")), {})
    return {"device": first.get("device", str(device)), "gpu": first.get("gpu", "cpu"), "torch": torch.__version__,
            "peak_bf16_tflops": first.get("peak_bf16_tflops"), "n": n, "seed": seed, "st_batch": st_batch,
            "st_dtype": best["st_dtype"], "results": rows}


def format_bench(result: dict) -> str:
    steady = [("model", "label", "{}"), ("texts", "text_set", "{}"), ("path", "path", "{}"),
              ("texts/s", "texts_s", "{:,.0f}"), ("tokens/s", "tokens_s", "{:,.0f}"), ("TFLOP/s", "tflops", "{:.1f}"),
              ("MFU", "mfu", "{:.1%}"), ("ST texts/s", "st_texts_s", "{:,.0f}"), ("speedup", "speedup", "{:.2f}x"),
              ("cos min", "cosine_min", "{:.5f}"), ("tok texts/s", "tokenize_texts_s", "{:,.0f}")]
    first = [("model", "label", "{}"), ("texts", "text_set", "{}"), ("first s", "first_s", "{:.2f}"),
             ("first texts/s", "first_texts_s", "{:,.0f}"), ("ST first s", "st_first_s", "{:.2f}"),
             ("first x", "first_speedup", "{:.2f}x"), ("script s", "script_first_s", "{:.2f}"),
             ("script/first", "script_ratio", "{:.2f}"), ("compile", "compile_after_first", "{}"),
             ("query cold s", "query_cold_s", "{:.2f}"), ("ST query cold s", "st_query_cold_s", "{:.2f}"),
             ("query p50 ms", "query_p50_ms", "{:.1f}"), ("ST p50 ms", "st_query_p50_ms", "{:.1f}")]
    head = (f"{result['gpu']} ({result['device']}), torch {result['torch']}, n={result['n']}, "
            + (f"bf16 matmul peak {result['peak_bf16_tflops']:.0f} TFLOP/s; " if result.get("peak_bf16_tflops") else
               "no bf16 matmul peak (not a GPU); ") + "sentence-transformers in "
            f"{result.get('st_dtype') or 'bfloat16'} at batch {result['st_batch']}; every figure from a fresh process")
    return "\n".join([head, "steady state (after warmup):", _table(steady, result["results"]),
                      "what users meet (constructor included; script: torch + sentence_transformers imported at its top):",
                      _table(first, result["results"])])


def _table(cols, results) -> str:
    rows = [[(fmt.format(r[key]) if r.get(key) is not None else "-") for _, key, fmt in cols] for r in results]
    widths = [max(len(c[0]), *(len(r[i]) for r in rows)) if rows else len(c[0]) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line([c[0] for c in cols]), *map(line, rows)])


# --- the children: one measurement each -------------------------------------------------------------


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _query_texts() -> list[str]:
    from embedfleet.synth import review_texts

    return [" ".join(t.split()[:8]) for t in review_texts(_QUERIES, seed=99)]


def _ours(spec: dict) -> dict:
    import torch

    from embedfleet.encode.encoder import Encoder

    texts = json.loads(Path(spec["texts"]).read_text())
    t0 = time.perf_counter()  # CUDA's start-up is the constructor's, on both sides
    enc = Encoder(spec["model"], device=spec["device"], batch_tokens=spec["batch_tokens"],
                  dtype=getattr(torch, spec["dtype"]) if spec.get("dtype") else None,
                  trust_remote_code=spec.get("trust_remote_code", False))
    first = enc.encode(texts)  # vectors on the host: the device is done
    first_s = time.perf_counter() - t0
    dev = enc._dev
    out = {"first_s": first_s, "compile_after_first": enc.describe()["compile"]}
    if spec.get("vectors") is None:  # the script variant measures the first call only
        return out
    enc.warmup()  # the steady state: helpers up, the forward pass compiled
    enc.encode(texts[: min(len(texts), 4096)])
    tok = enc.tokenize(texts)
    t0 = time.perf_counter()
    enc.tokenize(texts)
    t_tok = time.perf_counter() - t0
    _sync(dev)
    t0 = time.perf_counter()
    ours = enc.encode(texts)
    _sync(dev)
    seconds = time.perf_counter() - t0
    np.save(spec["vectors"], ours)
    lengths = tok.lengths.astype(np.float64)
    eff_len = float((lengths**2).sum() / lengths.sum())  # attention cost per token grows with length
    flops = enc.model.flops_per_token(eff_len) * tok.num_tokens
    cos_first = float((first * ours).sum(1).min())
    desc = enc.describe()
    enc.close()
    return {**out, **desc, "seconds": seconds, "tokens": tok.num_tokens, "mean_tokens": float(lengths.mean()),
            "flops": flops, "tokenize_texts_s": len(texts) / t_tok, "first_vs_steady_cos_min": cos_first,
            "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "peak_bf16_tflops": matmul_peak_tflops(dev)}


def _st_model(spec: dict):
    import torch
    from sentence_transformers import SentenceTransformer

    from embedfleet.encode.encoder import _device

    dev = _device(spec["device"])
    model = SentenceTransformer(spec["model"], device=str(dev), trust_remote_code=spec.get("trust_remote_code", False))
    model.to(getattr(torch, spec.get("st_dtype") or "bfloat16"))  # best_settings: each tool at its best
    return model, dev


def _st(spec: dict) -> dict:
    texts = json.loads(Path(spec["texts"]).read_text())
    import sentence_transformers  # noqa: F401 - imported before the clock, as torch is for ours

    t0 = time.perf_counter()
    model, dev = _st_model(spec)
    model.encode(texts, batch_size=spec["st_batch"], normalize_embeddings=True, convert_to_numpy=True)
    _sync(dev)
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = model.encode(texts, batch_size=spec["st_batch"], normalize_embeddings=True, convert_to_numpy=True)
    _sync(dev)
    seconds = time.perf_counter() - t0
    np.save(spec["vectors"], ref.astype(np.float32))
    return {"first_s": first_s, "seconds": seconds}


def _query(spec: dict, st: bool) -> dict:
    queries = _query_texts()
    if st:
        import sentence_transformers  # noqa: F401

        t0 = time.perf_counter()
        model, dev = _st_model(spec)
        kw = {"prompt_name": "query"} if "query" in (model.prompts or {}) else {}  # as ours: the query prompt
        encode = lambda q: model.encode([q], normalize_embeddings=True, convert_to_numpy=True, **kw)  # noqa: E731
    else:
        import torch

        from embedfleet.encode.encoder import Encoder

        t0 = time.perf_counter()
        enc = Encoder(spec["model"], device=spec["device"], batch_tokens=spec["batch_tokens"],
                      dtype=getattr(torch, spec["dtype"]) if spec.get("dtype") else None,
                      trust_remote_code=spec.get("trust_remote_code", False))
        query = "query" if "query" in enc.spec.prompts else None  # as sentence-transformers' side: its prompt, if any
        encode = lambda q: enc.encode([q], prompt=query)  # noqa: E731 - ndarray on the host: synced
    encode(queries[0])
    cold = time.perf_counter() - t0
    times = []
    for q in queries[1:]:
        t0 = time.perf_counter()
        encode(q)
        times.append(time.perf_counter() - t0)
    return {"cold_s": cold, "p50_ms": statistics.median(times) * 1e3}


def _child_main() -> None:
    if len(sys.argv) != 4 or sys.argv[1] != "child":
        raise SystemExit("usage: python -m embedfleet.encode.bench child KIND SPEC.json  (run by `embedfleet bench`)")
    kind, spec = sys.argv[2], json.loads(Path(sys.argv[3]).read_text())
    run = {"ours": _ours, "st": _st, "query": lambda s: _query(s, False), "st_query": lambda s: _query(s, True)}[kind]
    result = run(spec)
    sys.stdout.write(json.dumps(result, default=str) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    _child_main()
