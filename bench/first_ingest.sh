#!/usr/bin/env bash
# The README's first commands as a user meets them, each a fresh process on a fresh EMBEDFLEET_HOME, timed start to
# exit: `ingest` of the example reviews (it makes the embedded server), then `search`. Alternated between the
# embedded server's WAL files as made (WAL_SEGMENT_MB, 256) and PostgreSQL's stock 16 MB (the module's constant set
# before the CLI runs: no resize), to see what the resize costs a first command; the order swaps every run, after one
# warm-up ingest (left out) that takes the machine's own first start (a fresh host's first torch import, its disk's first
# writes). The model is EMBEDFLEET_MODEL's (the prelude's fp16 MiniLM where it is carried). From the project root, on
# the GPU machine (carry .whl and .models: bench/device_prelude.sh) or any host:
#   FIRST_RUNS=4 bash bench/first_ingest.sh   # a line a run in $OUT/first_ingest.txt, stderr in first_ingest.err
. bench/device_prelude.sh
TIMEFORMAT=%R
REVIEWS=(examples/Cell_Phones_and_Accessories.jsonl --meta examples/meta_Cell_Phones_and_Accessories.jsonl
         --preset amazon-reviews --quiet)
cli() {  # SEG ARGS…: embedfleet's CLI with the embedded server's WAL files SEG MB
  python3 -c "import sys, embedfleet.store.embedded as e, embedfleet.cli as c
e.WAL_SEGMENT_MB = int(sys.argv[1]); sys.argv = ['embedfleet', *sys.argv[2:]]; c.main()" "$@"
}
timed() {  # prints "SECONDS s" ARGS… took, or "failed" (its stderr kept)
  local t; echo "== $*" >>"$OUT/first_ingest.err"
  t=$( { time "$@" >/dev/null 2>>"$OUT/first_ingest.err"; } 2>&1 ) && echo "$t s" || echo failed
}
fresh() {  # HOME: none there, no server running on it
  EMBEDFLEET_HOME=$1 python3 -m embedfleet.cli db stop >/dev/null 2>&1; rm -rf "$1"
}
: >"$OUT/first_ingest.txt"; : >"$OUT/first_ingest.err"
export EMBEDFLEET_HOME=${FIRST_HOME:-/tmp}/effirst_warm; fresh "$EMBEDFLEET_HOME"
echo "warm-up ingest (left out): $(timed cli 256 ingest "${REVIEWS[@]}")" | tee -a "$OUT/first_ingest.txt"
fresh "$EMBEDFLEET_HOME"
for r in $(seq "${FIRST_RUNS:-3}"); do
  order="256 16"; [ $((r % 2)) = 0 ] && order="16 256"
  for seg in $order; do
    export EMBEDFLEET_HOME=${FIRST_HOME:-/tmp}/effirst_$seg; fresh "$EMBEDFLEET_HOME"
    ingest=$(timed cli "$seg" ingest "${REVIEWS[@]}")
    search=$(timed cli "$seg" search "battery dies after a week" --table Cell_Phones_and_Accessories --where "rating <= 2")
    wal=$(du -sm "$EMBEDFLEET_HOME/pgdata/pg_wal" | cut -f1)
    echo "run $r wal_segment_mb $seg: ingest $ingest, search $search, pg_wal $wal MB" | tee -a "$OUT/first_ingest.txt"
    fresh "$EMBEDFLEET_HOME"
  done
done
! grep -q failed "$OUT/first_ingest.txt" || { echo "a command failed: $OUT/first_ingest.err"; exit 1; }
