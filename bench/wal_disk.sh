#!/usr/bin/env bash
# PostgreSQL's WAL write path on a machine's disk, by WAL segment size (initdb --wal-segsize), on the GPU
# machine (device tool) or any Linux host, from the project root. Carry .whl and .models (device_multi.sh's).
#   bash bench/wal_disk.sh
# First the disk: 4 GiB of zeros with fdatasync. Then, for each segment size in SINK_SEGS (MB, in run order), a
# fresh server with the embedded server's bulk settings and its data in DISK_HOME, loaded by bench/sink.py (the
# writers of SINK_PROCS GPU workers, no model; SINK_N rows), and its WAL I/O by process (pg_stat_io: write and
# fsync counts and times). Results under $OUT: sink_seg<MB>.<random>.json, walio.txt.
set -o pipefail
if [ -d .whl ] && ! python3 -c "import psycopg, pgserver" 2>/dev/null; then  # the GPU machine lacks them
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src
fi
M=${MODEL:-$PWD/.models/all-MiniLM-L6-v2-fp16}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROOT=${DISK_HOME:-/var/tmp/efwal}
BIN=$(python3 -c "import os, pgserver; print(os.path.dirname(pgserver.__file__))")/pginstall/bin
id pgserver >/dev/null 2>&1 || useradd -s /bin/bash pgserver
as_pg() { if [ "$(id -u)" = 0 ]; then su pgserver -s /bin/bash -c "$*"; else bash -c "$*"; fi; }
SB=$(python3 -c "from embedfleet.store.embedded import memory_bytes, shared_buffers_mb; print(shared_buffers_mb(memory_bytes()))")
SETTINGS="-c shared_buffers=${SB}MB -c wal_buffers=256MB -c max_wal_size=32GB -c checkpoint_timeout=30min \
-c max_connections=300 -c io_method=sync -c wal_init_zero=${WAL_INIT_ZERO:-off} -c track_wal_io_timing=on"
start() {  # SEG PORT: a fresh server with SEG MB WAL segments in $ROOT/seg$SEG
  local d=$ROOT/seg$1; rm -rf "$d"; mkdir -p "$ROOT"; chown pgserver "$ROOT" 2>/dev/null; chmod 755 "$ROOT"
  as_pg "$BIN/initdb -D $d --wal-segsize=$1 -A trust -U postgres -E utf8" >/dev/null || exit 1
  as_pg "$BIN/pg_ctl -D $d -l $d/log -w -o '-p $2 -k /tmp $SETTINGS' start" >/dev/null || { tail "$d/log"; exit 1; }
}
stop() { as_pg "$BIN/pg_ctl -D $ROOT/seg$1 -w -m fast stop" >/dev/null; rm -rf "${ROOT:?}/seg$1"; }
q() { "$BIN/psql" -h /tmp -p "$1" -U postgres -At -c "$2"; }

df -h "$(dirname "$ROOT")" /dev/shm; lsblk -d -o NAME,SIZE,ROTA,MODEL 2>/dev/null; nproc; free -g | head -2
mkdir -p "$ROOT"; sync
dd if=/dev/zero of="$ROOT/dd" bs=1M count=4096 conv=fdatasync 2>&1 | tail -n 1; rm -f "$ROOT/dd"

for SEG in ${SINK_SEGS//,/ }; do
  PORT=$((5600 + SEG % 997)); start "$SEG" "$PORT"
  timeout "${SINK_LIMIT:-300}" python3 bench/sink.py --n "${SINK_N:-2000000}" --shards 32 --procs "${SINK_PROCS:-4,4}" \
    --work /dev/shm/efsink --model "$M" --db "postgresql://postgres@/postgres?host=/tmp&port=$PORT" \
    --out "$OUT/sink_seg$SEG.$RANDOM.json" 2>/tmp/sink.err | tail -n 4 || tail -n 20 /tmp/sink.err
  q $PORT "SELECT 'walio segsize=${SEG}MB ' || string_agg(format('%s/%s: %s writes %s MB %s ms, %s fsyncs %s ms', backend_type, context, writes,
    round(write_bytes / 1e6), round(write_time), fsyncs, round(fsync_time)), '; ') FROM pg_stat_io WHERE object = 'wal' AND writes + fsyncs > 0" \
    | tee -a "$OUT/walio.txt"
  stop "$SEG"
done
