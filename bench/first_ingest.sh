#!/usr/bin/env bash
# The README's first commands as a user meets them, each a fresh process on a fresh EMBEDFLEET_HOME, timed start to
# exit: `ingest` of the example reviews (it makes the embedded server), then `search`. Alternated between the
# embedded server's WAL files as made (WAL_SEGMENT_MB, 256) and PostgreSQL's stock 16 MB (the module's constant set
# before the CLI runs), to see what the resize costs a first command. From the project root, on the GPU machine
# (carry .whl and .models: bench/device_prelude.sh) or any host:
#   FIRST_RUNS=3 bash bench/first_ingest.sh        # prints a line a run; results $OUT/first_ingest.txt
. bench/device_prelude.sh
TIMEFORMAT=%R
cli() {  # SEG ARGS…: embedfleet's CLI with the embedded server's WAL files SEG MB
  python3 -c "import sys, embedfleet.store.embedded as e, embedfleet.cli as c
e.WAL_SEGMENT_MB = int(sys.argv[1]); sys.argv = ['embedfleet', *sys.argv[2:]]; c.main()" "$@"
}
timed() { { time "$@" >/dev/null 2>"$OUT/first_ingest.err" || echo "failed: $*" >&2; } 2>&1; }
for r in $(seq "${FIRST_RUNS:-3}"); do
  for seg in 256 16; do
    export EMBEDFLEET_HOME=${FIRST_HOME:-/tmp}/effirst_$seg; rm -rf "$EMBEDFLEET_HOME"
    ingest=$(timed cli $seg ingest examples/Cell_Phones_and_Accessories.jsonl \
      --meta examples/meta_Cell_Phones_and_Accessories.jsonl --preset amazon-reviews --quiet)
    search=$(timed cli $seg search "battery dies after a week" --table Cell_Phones_and_Accessories --where "rating <= 2")
    wal=$(du -sm "$EMBEDFLEET_HOME/pgdata/pg_wal" | cut -f1)
    echo "run $r wal_segment_mb $seg: ingest $ingest s, search $search s, pg_wal $wal MB" | tee -a "$OUT/first_ingest.txt"
    python3 -m embedfleet.cli db stop >/dev/null 2>&1; rm -rf "$EMBEDFLEET_HOME"
  done
done
