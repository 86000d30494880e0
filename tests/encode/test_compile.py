"""Compiling off the caller's thread: small work never compiles; big work compiles in the background,
then switches to the compiled graph, and the caller's thread never compiles (CPU, a tracing-only
backend standing in for Inductor; tests/encode/test_compile_gpu.py has the real thing)."""

import sys
import threading

import numpy as np
import torch

from embedfleet.encode.compile import COMPILE_SWITCH_S, BackgroundCompile, Fused
from embedfleet.encode.encoder import Encoder
from embedfleet.encode.shapes import build_random_model
from embedfleet.platform.cache import compiled_before
from embedfleet.synth import review_texts


def test_compiles_in_the_background_once_work_is_big_then_switches(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBEDFLEET_HOME", str(tmp_path / "home"))
    enc = Encoder(str(build_random_model("minilm-l6", tmp_path / "m", tiny=True)), device="cpu")
    assert enc.describe()["compile"] == "off"  # on the CPU nothing is compiled
    assert enc.small and enc.model.hidden <= 512  # a MiniLM-sized width: a worker compiles it only for long jobs
    texts = review_texts(200, seed=1)
    ref = enc.encode(texts)

    compiled_on, intervals, interval = [], [], sys.getswitchinterval()

    def backend(gm, example_inputs):  # called wherever dynamo compiles a graph
        compiled_on.append(threading.current_thread().name)
        intervals.append(sys.getswitchinterval())
        return gm.forward

    part = Fused(enc.model._post)  # as on CUDA
    enc.model._post, enc.model.fused = part, [part]
    enc._compile = BackgroundCompile(enc.model, torch.device("cpu"), 1000, 128, "test-shape", tmp_path / "cache",
                                     start_after=5000,
                                     compiler=lambda fn: torch.compile(fn, backend=backend))
    enc.encode(texts[:3])  # a few dozen tokens: small work stays eager
    assert enc.describe()["compile"] == "waiting" and not compiled_on

    during = enc.encode(texts)  # ~12k tokens: compiling starts, in the background; this call runs eager
    assert enc.describe()["compile"] in ("compiling", "compiled")
    np.testing.assert_allclose(during, ref, atol=1e-5)
    assert enc.wait_compiled(timeout=300)
    assert enc.describe()["compile"] == "compiled" and part.compiled
    after = [enc.encode(texts[:k]) for k in (7, 50, 200)]  # other token counts: the same graph
    np.testing.assert_allclose(after[-1], ref, atol=1e-5)
    assert compiled_on and set(compiled_on) == {"embedfleet-compile"}, compiled_on
    # while it compiled, a caller's thread got the GIL back within COMPILE_SWITCH_S; afterwards as before
    assert set(intervals) == {min(interval, COMPILE_SWITCH_S)} and sys.getswitchinterval() == interval
    assert compiled_before(tmp_path / "cache", "test-shape") is not None  # the next process knows the cache has it
    report = enc.compile_report()  # a tracing backend: no Inductor, so no cache lookups to count
    assert report["state"] == "compiled" and report["seconds"] > 0
    phases = report["phases_s"]
    assert report["cache"] == {"fxgraph_hit": 0, "fxgraph_miss": 0, "aot_hit": 0, "aot_miss": 0, "graphs": 1}
    assert phases["_compile.compile_inner"] > 0 and phases["bytecode_tracing"] > 0  # dynamo traced, here


def test_a_function_that_fails_to_compile_stays_eager(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBEDFLEET_HOME", str(tmp_path / "home"))
    enc = Encoder(str(build_random_model("minilm-l6", tmp_path / "m", tiny=True)), device="cpu")
    texts = review_texts(50, seed=2)
    ref = enc.encode(texts)

    def broken(fn):
        def run(*args):
            raise RuntimeError("no compiler here")
        return run

    part = Fused(enc.model._post)
    enc.model._post, enc.model.fused = part, [part]
    enc._compile = BackgroundCompile(enc.model, torch.device("cpu"), 1000, 128, "broken", tmp_path / "cache",
                                     start_after=0,
                                     compiler=broken)
    enc.encode(texts[:5])
    assert enc.describe()["compile"] == "waiting"  # one call: a script that stops here never compiles
    enc.encode(texts)
    assert enc.wait_compiled(timeout=60)
    assert enc.describe()["compile"] == "failed" and not part.compiled
    np.testing.assert_allclose(enc.encode(texts), ref, atol=1e-6)
    assert compiled_before(tmp_path / "cache", "broken") is None


def test_pointing_the_compile_caches_here_imports_no_dynamo(tmp_path):
    """Unset, or already ours (a child of a process that set it): no import of torch._inductor, which
    pulls torch._dynamo in. Inductor's own default (written by whoever asked it first): replaced."""
    import json
    import os
    import subprocess
    import sys

    code = """
import json, os, sys
from embedfleet.platform.cache import cache_dir, use_compile_cache
from embedfleet.settings import Settings
use_compile_cache(cache_dir(Settings.from_env().home_path))
print(json.dumps({"dir": os.environ["TORCHINDUCTOR_CACHE_DIR"], "inductor": "torch._inductor" in sys.modules}))
"""
    home = tmp_path / "home"
    ours = str(home / "cache" / "inductor")
    base = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    base["EMBEDFLEET_HOME"] = str(home)

    def run(**env):
        p = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    assert run() == {"dir": ours, "inductor": False}
    assert run(TORCHINDUCTOR_CACHE_DIR=ours) == {"dir": ours, "inductor": False}
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # inductor's default (a parent process's inductor wrote it) counts as unset, told without importing inductor
    assert run(TORCHINDUCTOR_CACHE_DIR=default_cache_dir()) == {"dir": ours, "inductor": False}
    elsewhere = str(tmp_path / "mine")
    assert run(TORCHINDUCTOR_CACHE_DIR=elsewhere) == {"dir": elsewhere, "inductor": False}  # the user's own: kept


def test_a_compile_waits_while_a_call_runs_and_finishes_after(tmp_path, monkeypatch):
    """The compile's thread, started while a caller's call runs, pauses at its next Python call until the call
    ends (it would take the GIL from it), then compiles; encode() holds the compile back for short calls only, and
    embed() for its batch."""
    import time

    monkeypatch.setenv("EMBEDFLEET_HOME", str(tmp_path / "home"))
    enc = Encoder(str(build_random_model("minilm-l6", tmp_path / "m", tiny=True)), device="cpu")
    texts = review_texts(60, seed=4)
    ref = enc.encode(texts)
    compiled_at = []

    def backend(gm, example_inputs):
        compiled_at.append(time.monotonic())
        return gm.forward

    part = Fused(enc.model._post)
    enc.model._post, enc.model.fused = part, [part]
    comp = enc._compile = BackgroundCompile(enc.model, torch.device("cpu"), 1000, 128, "paused", tmp_path / "cache",
                                            start_after=0, compiler=lambda fn: torch.compile(fn, backend=backend))

    def paused() -> bool:  # the compile thread is waiting in its profile hook
        frame = sys._current_frames().get(comp._thread.ident)
        while frame is not None:
            if frame.f_code.co_name == "_pause_for_calls":
                return True
            frame = frame.f_back
        return False

    with comp.calls_first():
        comp.start()
        deadline = time.monotonic() + 60
        while not paused() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert paused()
        time.sleep(0.5)
        assert paused() and not compiled_at and comp.state == "compiling"  # no progress while the call runs
        ended = time.monotonic()
    assert comp.wait(timeout=300) and comp.state == "compiled" and part.compiled
    assert compiled_at and min(compiled_at) > ended
    np.testing.assert_allclose(enc.encode(texts), ref, atol=1e-5)

    held = []
    real = comp.calls_first
    monkeypatch.setattr(comp, "calls_first", lambda: (held.append(True), real())[1])
    enc.encode(texts[:5])
    assert held == [True]  # a short call holds the compile back
    enc.embed(enc.tokenize(texts[:5]))
    assert held == [True, True]  # so does one batch (serve, sync)
    monkeypatch.setattr("embedfleet.encode.encoder.LONG_CALL_TEXTS", 50)
    enc.encode(texts)
    assert held == [True, True]  # a long call does not: the compile started at its start runs beside it
