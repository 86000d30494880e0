#!/usr/bin/env bash
# One device call of several one-GPU parts, in order, each under its own timeout, results in $OUT:
#   bash bench/device_call.sh startup passages startup gputrain take loader first
# startup: bench/encoder_startup.py --first 20000 (run it twice: the machine's first and second run);
# passages: bench/passages.py --skip-whole (issue 20; SKIP_WHOLE= also embeds the whole documents); gputrain: the trainer's GPU tests; take: bench/take_pcie.py;
# loader: bench/train_loader.py on 10M rows (issue 16; LOADER_SKIP, default sql,stream,file,eager); first: `embedfleet bench` (issue 17's first call);
# ingest500k: bench/ingest.py --n 500000 --gpus 1, twice (issue 17's wall rate; the second run's compile from the cache).
# readcold: bench/read_cold.py (issue 16: the one-connection read, the server's buffers empty, per io_method).
# cold: bench/cold_search.py on a fresh home (its first ingest, then cold `search` against cold sentence-transformers).
# ingestmodes: the same once per word of INGEST_MODES, each word an environment (`-` none, `A=1,B=2` several),
#   e.g. INGEST_MODES="- EMBEDFLEET_COMPILE=0 EMBEDFLEET_COMPILE_WAIT=1 -"; INGEST_N, INGEST_SHAPE (e.g. qwen3-0.6b).
# Carry .whl and .models (bench/device_prelude.sh says how to make them).
set -o pipefail
. bench/device_prelude.sh
export EMBEDFLEET_HOME=/tmp/efhome
nvidia-smi -L; nproc
k=0
for part in "$@"; do
  k=$((k + 1)); t0=$(date +%s.%N); echo "== $k $part"
  case "$part" in
  startup) timeout 120 python3 bench/encoder_startup.py "$M" --first 20000 >"$OUT/startup$k.txt" 2>&1; head -40 "$OUT/startup$k.txt" ;;
  passages) EMBEDFLEET_PREP_WORKERS=${PREP:-14} timeout 150 python3 bench/passages.py --n "${PASSAGE_N:-40000}" \
      --passages 254:32 --model "$M" --devices cuda --work /tmp/efp ${SKIP_WHOLE---skip-whole} >"$OUT/passages.json" 2>"$OUT/passages.err"
    tail -n 6 "$OUT/passages.err"; cat "$OUT/passages.json" ;;
  gputrain) timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_train_gpu.py \
      -k "${TRAIN_TESTS:-order or take or ram_tier or graphs}" 2>&1 | tail -n 8 ;;
  take) timeout 150 python3 bench/take_pcie.py --out "$OUT/take_pcie.json" 2>"$OUT/take_pcie.err" \
      | python3 -c "import json,sys; d=json.load(sys.stdin); print(d['copy_engine_gb_s'], d['compute_us']); [print(r) for r in d['results']]" ;;
  loader) timeout "${LOADER_TIMEOUT:-280}" python3 bench/train_loader.py --rows "${TRAIN_ROWS:-10000000}" \
      --skip "${LOADER_SKIP-sql,stream,file,eager}" --readers "${READERS:-1,8}" --epochs 3 ${TAKE_SHAPES:+--take-shapes "$TAKE_SHAPES"} \
      ${LOADER_ARGS:-} \
      --out "$OUT/train_loader.json" \
      2>"$OUT/train_loader.err" >/dev/null; grep -v "^ *$" "$OUT/train_loader.err" | tail -n 14 ;;
  ingest500k) for r in 1 2; do  # issue 17's wall rate, the machine's first run and its second (compile cache)
      timeout "${INGEST_TIMEOUT:-150}" python3 bench/ingest.py --n 500000 --shards 8 --gpus 1 --model "$M" --no-index \
        --work /tmp/efbench --out "$OUT/ingest500k_$r.json" 2>"$OUT/ingest500k_$r.err" >/dev/null
      python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['results'][0]; w=r['workers'][0]; \
print(r['rows_per_s_steady'], r['rows_per_s_wall'], r['wall_s'], r['timeline_s'], w['first_wait_s'], w['startup'])" "$OUT/ingest500k_$r.json"
    done ;;
  ingestmodes) r=0; D=${INGEST_KEEP:+$OUT}; D=${D:-/tmp/efmodes$k}; mkdir -p "$D"  # INGEST_KEEP=1: the JSON in $OUT
    for mode in ${INGEST_MODES:--}; do r=$((r + 1))
      env $( [ "$mode" = - ] || echo "${mode//,/ }" ) timeout "${INGEST_TIMEOUT:-150}" python3 bench/ingest.py \
        --n "${INGEST_N:-500000}" --shards 8 --gpus 1 ${INGEST_SHAPE:+--shape "$INGEST_SHAPE"} --model "$M" --no-index \
        --work /tmp/efbench --out "$D/ingest_$r.json" 2>"$D/ingest_$r.err" >/dev/null
      python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['results'][0]; w=r['workers'][0]; c=w['startup'].get('compile') or {}; \
print(sys.argv[2], r['rows_per_s_steady'], r['rows_per_s_wall'], r['wall_s'], r['timeline_s'], 'tenths', w.get('rows_by_tenth'), \
'loop', w['wall_s'], 'compile', c.get('seconds'), c.get('state'), 'finalize', r.get('finalize'), 'again', r.get('analyze_again_s'), 'startup', w['startup'])" \
        "$D/ingest_$r.json" "$mode" || tail -n 5 "$D/ingest_$r.err"
    done ;;
  readcold) timeout "${READCOLD_TIMEOUT:-400}" python3 bench/read_cold.py --rows "${TRAIN_ROWS:-10000000}" ${READCOLD_ARGS:-} \
      --out "$OUT/read_cold.json" 2>"$OUT/read_cold.err" >/dev/null; grep -E '^\[read_cold\]|Error' "$OUT/read_cold.err" ;;
  first) timeout "${FIRST_TIMEOUT:-300}" python3 -m embedfleet.cli bench --model "$M" --texts "${TEXTS:-reviews}" --n 20000 --json \
      >"$OUT/bench_first.json" 2>"$OUT/bench_first.err"; tail -n 20 "$OUT/bench_first.err" ;;
  cold) export EMBEDFLEET_HOME=/tmp/efcold; python3 -m embedfleet.cli db stop >/dev/null 2>&1; rm -rf "$EMBEDFLEET_HOME"
    timeout "${COLD_TIMEOUT:-300}" python3 bench/cold_search.py --runs "${COLD_RUNS:-2}" --model "$M" --json \
      >"$OUT/cold_search.json" 2>"$OUT/cold_search.err"; cat "$OUT/cold_search.err"
    python3 -m embedfleet.cli db stop >/dev/null 2>&1; export EMBEDFLEET_HOME=/tmp/efhome ;;
  *) echo "unknown part $part"; exit 2 ;;
  esac
  echo "== $part took $(python3 -c "import time; print(round(time.time() - $t0, 1))") s"
done
