"""What bench scripts share: run one command of the real CLI for its `--json` document, the span of the
workers' loops from their summaries, and --pg-set's NAME=VALUE lists."""

from __future__ import annotations

import subprocess
import sys
import time


def run_json(args: list[str], env: dict | None = None) -> tuple[float, float, dict]:
    """(start time, wall seconds, the JSON document) of `embedfleet ARGS…`; a failure ends the bench."""
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "embedfleet.cli", *map(str, args)], capture_output=True, text=True,
                       env=env)
    wall = time.time() - t0
    if p.returncode != 0:
        raise SystemExit(f"embedfleet {' '.join(map(str, args[:3]))}… failed ({p.returncode}):\n{p.stderr[-3000:]}")
    import orjson

    return t0, wall, orjson.loads(p.stdout)


def loop_span(workers: list[dict]) -> tuple[float, float]:
    """(the first worker's loop start, seconds from it to the last one's end)."""
    first = min(w["started_at"] for w in workers)
    return first, max(w["started_at"] + w["wall_s"] for w in workers) - first


def name_values(items: list[str]) -> dict[str, str]:
    """{NAME: VALUE} of NAME=VALUE items (a server's settings); an item without "=" ends the bench."""
    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"expected NAME=VALUE, got {item!r}")
        out[name.strip()] = value.strip()
    return out
