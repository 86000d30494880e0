#!/usr/bin/env bash
# Several-GPU runs on the GPU machine (device tool; issues 21 and 22), from the project root. Carry .whl and
# .models (bench/device_prelude.sh says how to make them).
#   bash bench/device_multi.sh gputests # the GPU tests of training and the encoder's first call (stops a chain on failure)
#   bash bench/device_multi.sh ingest   # bench/ingest.py 1,2,4… GPUs: the Qwen3-0.6B shape, then MiniLM
#   bash bench/device_multi.sh train    # bench/ddp_train.py (train, step sweep, file loaders), then train_loader.py on one GPU
#   bash bench/device_multi.sh wiki     # the Wikipedia scenario on every GPU (WIKI_PASSAGES=512:32: the passages pass)
#   bash bench/device_multi.sh stpool   # sentence-transformers' multi-process pool on 1, 2, 4… GPUs, the peer
#   bash bench/device_multi.sh one      # one GPU: every GPU test, passages (issue 20), 500k-row ingest's wall (issue 17)
#   bash bench/device_multi.sh parts    # MiniLM, 12M rows on every GPU: the table as one relation against PARTS hash partitions, alternated
#   bash bench/device_multi.sh firstload # MiniLM, 12M rows on every GPU: three fresh servers' first long loads on one machine, and a later one
#   bash bench/device_multi.sh untouched # the same, each server's first load on memory the VM never touched (UNTOUCHED_DTYPES)
#   bash bench/device_multi.sh disk      # PostgreSQL's data on the machine's disk (DISK_HOME): a long load per DISK_DTYPES (float,float)
# Sizes through the environment: GPU_COUNTS (1,2,4… up to the machine's), N_QWEN (240000), N_MINILM (4000000; 0: none), TRAIN_ROWS (10000000),
# WIKI_N (250000), WIKI_PASSAGES (off), ST_N (100000), PARTS (8), N_PARTS (12000000), PARTS_GPUS/PARTS_LIST/PARTS_HELPERS
# (parts' runs: GPU counts, partitions, helpers, each a list in run order), PARTS_PER_GPU (set: N_PARTS rows a GPU),
# PARTS_PREFILL (GiB of memory touched once before the server starts), WAL_GB (firstload: 40; 0: none), H3_FLAGS
# (firstload's third load: more ingest.py flags, e.g. --pg-set wal_init_zero=on), ONE_N (firstload: rows of a one-GPU
# load on the second server; 0: none), SWEEP_HEADS (linear,mlp,mlp:4096), SWEEP_BATCHES
# (1024,…,65536), DDP_SKIP (none; e.g. loader), RAM_VARIANTS (none), GPU_TESTS (gputests' list). Results: $OUT/<part>*.json and .err logs.
set -o pipefail
. bench/device_prelude.sh
export EMBEDFLEET_HOME=/tmp/efhome
# NVLink multicast stays off (the machine's own setting; kept for processes started with their own environment).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GPUS=$(nvidia-smi -L | wc -l)
COUNTS=${GPU_COUNTS:-$(python3 -c "print(','.join(str(k) for k in (1, 2, 4, 8) if k <= $GPUS))")}
nvidia-smi -L; lscpu | grep -E '^(CPU\(s\)|Model name)'; free -g | head -2
long_load() {  # NAME HOME SECONDS GPU-LIST [ingest.py flags…]: N_PARTS MiniLM rows a run, the server's directory HOME;
  local name=$1 home=$2 limit=$3 gpus=$4; shift 4  # results $OUT/NAME.json, its [ingest] lines and the host's Shmem
  timeout "$limit" python3 bench/ingest.py --n "${N_PARTS:-12000000}" --shards 32 --model "$M" --no-index --work /dev/shm/efT \
    --partitions "${PARTS:-8}" --gpus "$gpus" --home "$home" "$@" --out "$OUT/$name.json" \
    2>"/tmp/$name.err" >/dev/null || tail -n 20 "/tmp/$name.err"
  grep '^\[ingest\]' "/tmp/$name.err" | cut -c1-200; grep -E '^Shmem:' /proc/meminfo
}
case "$1" in
gputests)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -x ${GPU_TESTS:-tests/gpu/test_train_gpu.py \
    tests/gpu/test_encode_gpu.py::test_a_first_call_on_cuda_runs_flash_attention_without_importing_dynamo} \
    2>&1 | tee "$OUT/gputests.txt" | tail -n 25
  ;;
ingest)
  # The MiniLM corpus is written (all cores, seconds) while the Qwen3 shape's first run loads its model.
  [ "${N_MINILM:-4000000}" != 0 ] && python3 -c "from embedfleet.synth import cached_review_shards as c; c('/tmp/efbench', ${N_MINILM:-4000000}, 32)" &
  timeout "${QWEN_TIMEOUT:-300}" python3 bench/ingest.py --n "${N_QWEN:-240000}" --shards 16 --gpus "$COUNTS" --shape qwen3-0.6b --no-index \
    --work /tmp/efq --out "$OUT/ingest_qwen3.json" 2>"$OUT/ingest_qwen3.err" | tail -n "$(echo $COUNTS | tr , '\n' | wc -l)"
  wait
  [ "${N_MINILM:-4000000}" = 0 ] && exit 0
  timeout "${MINILM_TIMEOUT:-200}" python3 bench/ingest.py --n "${N_MINILM:-4000000}" --shards 32 --gpus "$COUNTS" --model "$M" --no-index \
    --work /tmp/efbench --out "$OUT/ingest_minilm.json" 2>"$OUT/ingest_minilm.err" | tail -n "$(echo $COUNTS | tr , '\n' | wc -l)"
  ;;
train)
  timeout "${DDP_TIMEOUT:-400}" python3 bench/ddp_train.py --rows "${TRAIN_ROWS:-10000000}" --gpus "$COUNTS" \
    ${SWEEP_HEADS:+--heads "$SWEEP_HEADS"} ${SWEEP_BATCHES:+--batches "$SWEEP_BATCHES"} ${DDP_SKIP:+--skip "$DDP_SKIP"} \
    --out "$OUT/ddp_train.json" 2>"$OUT/ddp_train.err" >/dev/null
  # issue 16 on one GPU of the same machine: the tiers against pure compute and the DataLoaders (table reused)
  timeout "${LOADER_TIMEOUT:-150}" python3 bench/train_loader.py --rows "${TRAIN_ROWS:-10000000}" --skip sql,stream,read \
    --epochs 3 ${RAM_VARIANTS:+--ram-variants "$RAM_VARIANTS"} --out "$OUT/train_loader.json" \
    2>"$OUT/train_loader.err" >/dev/null
  python3 - "$OUT/ddp_train.json" "$OUT/train_loader.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
    for n, r in d.get("train", {}).items():
        print("train", n, {k: r.get(k) for k in ("best_epoch_s", "best_samples_per_s", "scaling", "error")})
    for r in d.get("scaling", []):
        print("sweep", r)
    for n, r in d.get("loader", {}).items():
        print("loader", n, r)
    t = json.load(open(sys.argv[2]))
    print("train_loader", t.get("epoch_s"), t.get("ratios"), t.get("targets"), t.get("copies"))
except Exception as e:
    print("summary:", repr(e))
PY
  ;;
wiki)
  # ~300M tokens (250k articles of ~1,200 stand-in tokens) a pass, ~4 min on 4 H100s: each pass gets a call
  # of its own (WIKI_PASSAGES unset: whole documents; WIKI_PASSAGES=512:32: only the run with passages).
  timeout 570 python3 bench/wikipedia_scenario.py --n "${WIKI_N:-250000}" --shape qwen3-0.6b \
    $([ "${WIKI_PASSAGES:-off}" != off ] && echo --passages "$WIKI_PASSAGES" --passages-only) --work /tmp --out "$OUT/wiki.json" \
    2>"$OUT/wiki.err" >/dev/null; grep '^\[wiki\]' "$OUT/wiki.err"
  ;;
stpool)
  timeout "${ST_TIMEOUT:-570}" python3 bench/st_pool.py --model "$M" --gpus "$COUNTS" --n "${ST_N:-100000}" > "$OUT/st_pool.json" \
    2>"$OUT/st_pool.err"; grep '^\[st_pool\]' "$OUT/st_pool.err"; cat "$OUT/st_pool.json"
  ;;
one)
  python3 -c "import torch, transformers, sentence_transformers" # the image ships no bytecode: compile it once, untimed
  timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/gpu} 2>&1 \
    | tee "$OUT/gputests.txt" | tail -n 15
  timeout 150 python3 bench/passages.py --n "${PASSAGE_N:-20000}" --passages 254:32 --model "$M" --devices cuda \
    --work /tmp/efp >"$OUT/passages.json" 2>"$OUT/passages.err"; tail -n 4 "$OUT/passages.err"; cat "$OUT/passages.json"
  timeout 150 python3 bench/ingest.py --n 500000 --shards 8 --gpus 1 --model "$M" --work /tmp/efbench \
    --out "$OUT/ingest_minilm.json" 2>"$OUT/ingest_minilm.err" | tail -n 3
  ;;
parts)
  # Does the GPUs' wait on the table's extension lock (runs 146-148) go with the table as several relations?
  # PostgreSQL's data and the corpus in memory, as runs 141-148; the first run of a fresh server is the warm-up's.
  export EMBEDFLEET_HOME=/dev/shm/efhome
  if [ -n "${PARTS_PREFILL:-}" ]; then  # touch PARTS_PREFILL GiB of a fresh VM's memory once (8 writers), then free it
    t0=$(date +%s.%N)
    for i in 0 1 2 3 4 5 6 7; do dd if=/dev/zero of=/dev/shm/prefill$i bs=1M count=$((PARTS_PREFILL * 128)) 2>/dev/null & done; wait
    rm -f /dev/shm/prefill*; echo "[prefill] ${PARTS_PREFILL} GiB in $(python3 -c "import time; print(round(time.time() - $t0, 2))") s" | tee "$OUT/prefill.txt"
  fi
  timeout 570 python3 bench/ingest.py --n "${N_PARTS:-12000000}" --shards 32 --model "$M" --no-index --work /dev/shm/efT \
    --gpus "${PARTS_GPUS:-$GPUS,$GPUS,$GPUS,$GPUS}" --partitions "${PARTS_LIST:-0,${PARTS:-8},0,${PARTS:-8}}" \
    ${PARTS_HELPERS:+--helpers "$PARTS_HELPERS"} $([ -n "${PARTS_PER_GPU:-}" ] && echo --per-gpu) --warmup 2500000 \
    --out "$OUT/ingest_parts.json" 2>"$OUT/ingest_parts.err" >/dev/null; grep '^\[ingest\]' "$OUT/ingest_parts.err" | cut -c1-300
  ;;
firstload)
  # A fresh server's first long load at every GPU, on one machine: the machine's first server (a warm-up first); a
  # fresh server on the memory that one touched, then a later load on it; a fresh server whose WAL segment files
  # (WAL_GB, default 40: a 12M-row load writes ~32 GB) were made beforehand (runs 158-163).
  load() { long_load "$1" "/dev/shm/$1" "${@:2}"; }  # load HOME SECONDS GPU-LIST [flags…], HOME under /dev/shm
  drop() { EMBEDFLEET_HOME=/dev/shm/$1 python3 -m embedfleet.cli db stop >/dev/null; rm -rf "/dev/shm/$1"; grep -E '^Shmem:' /proc/meminfo; }
  load h1 300 "$GPUS" --warmup 2500000
  mkdir -p /dev/shm/h2 /dev/shm/h3; cp -a /dev/shm/h1/cache /dev/shm/h2/; cp -a /dev/shm/h1/cache /dev/shm/h3/; drop h1
  load h2 250 "$GPUS,$GPUS"
  [ "${ONE_N:-0}" != 0 ] && N_PARTS=$ONE_N long_load h2one /dev/shm/h2 150 1  # one GPU on the same server: the scaling's base
  drop h2
  [ "${WAL_GB:-40}" != 0 ] && EMBEDFLEET_HOME=/dev/shm/h3 timeout 120 python3 bench/wal_segments.py --gb "${WAL_GB:-40}" | tee "$OUT/h3_wal.txt"
  load h3 150 "$GPUS" ${H3_FLAGS:-}; drop h3
  ;;
untouched)
  # First long loads into memory the VM has never touched, one server each, with UNTOUCHED_DTYPES (float,half,float):
  # every server keeps running with its WAL files (freed pages would be reused, touched), so each load's WAL and shared
  # buffers land on new memory (its heap may reuse the pages of the table the run before dropped).
  load() { long_load "$1" "/dev/shm/$1" "$2" "$GPUS" "${@:3}"; }  # load HOME SECONDS [flags…]
  N_PARTS=2500000 load u0 200  # the compile cache (a smaller job runs eager); a small server, kept
  k=0
  for dtype in $(echo "${UNTOUCHED_DTYPES:-float,half,float}" | tr , ' '); do
    k=$((k + 1)); mkdir -p "/dev/shm/u$k"; cp -a /dev/shm/u0/cache "/dev/shm/u$k/"
    load "u$k" 150 --dtype "$dtype"
  done
  for h in /dev/shm/u*; do EMBEDFLEET_HOME=$h python3 -m embedfleet.cli db stop >/dev/null; done
  ;;
disk)
  # PostgreSQL's data on the machine's disk (the embedded default's place), not in memory: a fresh server's long loads
  # at every GPU, one per word of DISK_DTYPES, --partitions as parts'; the disk's own write rate for scale.
  D=${DISK_HOME:-/var/tmp/efdisk}; rm -rf "$D/home"; mkdir -p "$D"; findmnt -T "$D" -o SOURCE,FSTYPE,SIZE,AVAIL | tail -n 1
  dd if=/dev/zero of="$D/dd.test" bs=1M count=4096 conv=fdatasync 2>&1 | tail -n 1; rm -f "$D/dd.test"
  long_load disk "$D/home" 420 "$(echo "${DISK_DTYPES:-float,float}" | sed "s/[^,][^,]*/$GPUS/g")" \
    --dtype "${DISK_DTYPES:-float,float}" --warmup 2500000
  EMBEDFLEET_HOME=$D/home python3 -m embedfleet.cli db stop >/dev/null
  ;;
*) echo "usage: bash bench/device_multi.sh gputests|ingest|train|wiki|stpool|one|parts|firstload|untouched|disk"; exit 2 ;;
esac
