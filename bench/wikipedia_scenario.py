"""The field report's scenario as one command pair: Wikipedia-length articles plus questions embedded with
the query prompt, on every GPU of the machine, then `verify` of both tables; optionally again with passages.

    python bench/wikipedia_scenario.py [--n 250000] [--questions 10] [--shape qwen3-0.6b | --model DIR]
                                       [--devices auto] [--passages 254:32 [--passages-only]] [--work DIR]
                                       [--out FILE]

Writes the articles (`synth.write_articles`, the wikimedia/wikipedia Parquet layout, median ~700 words) in
shards, then times each command from its start to its exit (start-up included: what the user waits for).
One JSON document: wall seconds and items/s of each ingest, and verify's verdict; each step is also said on
stderr as it ends, and --out is rewritten after each, so a run stopped part way keeps what it measured.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import orjson

import harness
from _cli import run_json
from embedfleet.settings import Settings
from embedfleet.pg.embedded import resolve_dsn
from embedfleet.synth import write_articles

QUESTIONS = ["Who founded the city and when?", "What is the river's longest tributary?",
             "Which treaty ended the war?", "How tall is the cathedral's spire?",
             "What language is spoken in the valley?", "When did the railway reach the town?",
             "Which composer was born there?", "What crops grow on the plateau?",
             "How many people live in the province?", "Why was the capital moved?"]


def cli(*args: str) -> tuple[float, dict]:
    _, wall, doc = run_json(list(args))
    return wall, doc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=250_000)
    ap.add_argument("--questions", type=int, default=10)
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--model", default=None, help="a real model directory instead of a random-weight shape")
    ap.add_argument("--devices", default="auto")
    ap.add_argument("--passages", default=None, help="also run with --passages TOKENS[:OVERLAP]")
    ap.add_argument("--passages-only", action="store_true", help="only the run with --passages (a call of its own)")
    ap.add_argument("--shards", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--work", default=None)
    ap.add_argument("--out", default=None, help="also write the JSON document here, after every step")
    a = ap.parse_args()
    if a.passages_only and not a.passages:
        ap.error("--passages-only needs --passages TOKENS[:OVERLAP]")
    dsn = resolve_dsn(None, Settings.from_env())
    with tempfile.TemporaryDirectory(dir=a.work) as tmp:
        work = Path(tmp)
        model = a.model
        if model is None:
            from embedfleet.encode.shapes import build_random_model

            model = str(build_random_model(a.shape, work / a.shape))
        t0 = time.time()
        per = -(-a.n // a.shards)
        with ProcessPoolExecutor(a.shards) as pool:  # the corpus, written in parallel shards
            starts = list(range(0, a.n, per))
            files = list(pool.map(write_articles, [work / f"wiki-{i:03d}.parquet" for i in range(len(starts))],
                                  [min(per, a.n - s) for s in starts], starts, [700] * len(starts),
                                  [2000] * len(starts), [s + 1 for s in starts]))
        written = time.time() - t0
        questions = work / "questions.jsonl"
        questions.write_text("".join(orjson.dumps({"qid": f"q{i}", "question": QUESTIONS[i % len(QUESTIONS)]}).decode()
                                     + "\n" for i in range(a.questions)))
        stamp = int(time.time())
        out = harness.stamp({"articles": a.n, "questions": a.questions, "model": a.model or a.shape,
                             "corpus_written_s": round(written, 1)}, dsn)
        step(out, a.out, f"corpus of {a.n:,} articles written in {written:.1f} s")
        runs = ([] if a.passages_only else [("whole", [])]) + ([("passages", ["--passages", a.passages])] if a.passages else [])
        for name, extra in runs:
            table = f"wiki_{name}_{stamp}"
            wall, doc = cli("ingest", *map(str, files), "--preset", "wikipedia", "--table", table, "--model", model,
                            "--devices", a.devices, "--db", dsn, "--no-index", "--quiet", "--json", *extra)
            tokens = sum(w["tokens"] for w in doc["workers"])
            out[name] = {"ingest_wall_s": round(wall, 1), "rows": doc["rows_written"],
                         "articles_per_s": round(a.n / wall, 1), "rows_per_s": round(doc["rows_written"] / wall, 1),
                         "tokens": tokens, "tokens_per_s": round(tokens / wall, 1), "workers": len(doc["workers"])}
            step(out, a.out, f"{name}: {out[name]}")
            qwall, qdoc = cli("ingest", str(questions), "--text-field", "question", "--id-field", "qid", "--prompt",
                              "query", "--table", f"{table}_q", "--model", model, "--devices", a.devices, "--db", dsn,
                              "--no-index", "--quiet", "--json")
            out[name]["questions_wall_s"] = round(qwall, 1)
            # where a small job's time goes: its workers' start-up, step by step
            out[name]["questions_workers"] = [w.get("startup") for w in qdoc.get("workers", [])]
            step(out, a.out, f"{name}: questions in {qwall:.1f} s")
            vwall, report = cli("verify", "--table", table, "--table", f"{table}_q", "--db", dsn, "--json")
            out[name].update(verify_ok=report["ok"], same_model=report["same_model"], verify_wall_s=round(vwall, 1))
            step(out, a.out, f"{name}: verify ok={report['ok']} in {vwall:.1f} s")
    print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())


def step(doc: dict, path: str | None, line: str) -> None:
    """Say a step's result on stderr and rewrite --out: a run cut short keeps what it measured."""
    print(f"[wiki] {line}", file=sys.stderr, flush=True)
    if path:
        Path(path).write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
