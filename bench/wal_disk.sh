#!/usr/bin/env bash
# PostgreSQL's WAL write path on a machine's disk, by WAL segment size (initdb --wal-segsize), on the GPU
# machine (device tool) or any Linux host, from the project root. Carry .whl and .models (bench/device_prelude.sh).
#   SINK_SEGS=16,256,16,256 bash bench/wal_disk.sh
# First the disk: 4 GiB of zeros with fdatasync. Then, for each segment size in SINK_SEGS (MB, in run order), a
# fresh server with its data in $DISK_HOME/efwal, the embedded server's bulk settings but max_wal_size 32GB (no
# checkpoint in a 3M-row load) and initdb's min_wal_size, loaded by bench/sink.py (the writers of SINK_PROCS GPU
# workers, no model; SINK_N rows); then its WAL I/O by process (pg_stat_io: write and fsync counts and times).
# Results under $OUT: <k>_seg<MB>.json in run order, walio.txt. Exits 1 if a load or a server failed.
set -o pipefail
. bench/device_prelude.sh
ROOT=${DISK_HOME:-/var/tmp}/efwal  # a directory of its own: it is handed to the pgserver user
mkdir -p "$ROOT" || exit 1
BIN=$(python3 -c "import os, pgserver; print(os.path.dirname(pgserver.__file__))")/pginstall/bin
FLAGS=$(python3 -c "
from pathlib import Path
from embedfleet.store.embedded import bulk_settings
s = {**bulk_settings(Path('$ROOT')), 'max_wal_size': '32GB', 'track_wal_io_timing': 'on'}
print(' '.join(f'-c {k}={v}' for k, v in s.items()))") || exit 1
if [ "$(id -u)" = 0 ]; then
  id pgserver >/dev/null 2>&1 || useradd -s /bin/bash pgserver
  chown pgserver "$ROOT"
fi
as_pg() { if [ "$(id -u)" = 0 ]; then su pgserver -s /bin/bash -c "$1"; else bash -c "$1"; fi; }
start() {  # SEG PORT: a fresh server with SEG MB WAL segments in $ROOT/seg$SEG
  local d="$ROOT/seg$1"; rm -rf "$d"
  as_pg "'$BIN/initdb' -D '$d' --wal-segsize=$1 -A trust -U postgres -E utf8" >/dev/null &&
    as_pg "'$BIN/pg_ctl' -D '$d' -l '$d/log' -w -o '-p $2 -k /tmp $FLAGS' start" >/dev/null ||
    { tail "$d/log" 2>/dev/null; return 1; }
}
stop() {  # SEG: immediate, its data is thrown away (a fast stop would first write out the shared buffers)
  as_pg "'$BIN/pg_ctl' -D '$ROOT/seg$1' -w -m immediate stop" >/dev/null && rm -rf "${ROOT:?}/seg$1"
}
q() { "$BIN/psql" -h /tmp -p "$1" -U postgres -At -c "$2"; }

df -h "$ROOT" /dev/shm; lsblk -d -o NAME,SIZE,ROTA,MODEL 2>/dev/null; nproc; free -g | head -2
sync; dd if=/dev/zero of="$ROOT/dd" bs=1M count=4096 conv=fdatasync 2>&1 | tail -n 1; rm -f "$ROOT/dd"

rc=0; k=0
for SEG in ${SINK_SEGS//,/ }; do
  k=$((k + 1)); PORT=$((5600 + SEG % 997))
  start "$SEG" "$PORT" || { rc=1; continue; }
  timeout "${SINK_LIMIT:-300}" python3 bench/sink.py --n "${SINK_N:-2000000}" --shards 32 --procs "${SINK_PROCS:-4,4}" \
    --work /dev/shm/efsink --model "$M" --db "postgresql://postgres@/postgres?host=/tmp&port=$PORT" \
    --out "$OUT/${k}_seg$SEG.json" 2>/tmp/sink.err | tail -n 4 || { rc=1; tail -n 20 /tmp/sink.err; }
  q "$PORT" "SELECT 'walio $k segsize=${SEG}MB ' || string_agg(format('%s/%s: %s writes %s MB %s ms, %s fsyncs %s ms',
    backend_type, context, writes, round(write_bytes / 1e6), round(write_time), fsyncs, round(fsync_time)), '; ')
    FROM pg_stat_io WHERE object = 'wal' AND writes + fsyncs > 0" | tee -a "$OUT/walio.txt" || rc=1
  stop "$SEG" || rc=1
done
exit $rc
