"""torch.compile for the packed forward passes: only for big work, off the caller's thread, cached.

The glue between matmuls (norms, RoPE, activations, residual adds) costs more GPU time eager than
the matmuls themselves on CUDA, and torch.compile fuses it; but compiling takes seconds to tens of
seconds, more than a query or a few thousand texts take eager. So each such function is a `Fused`:
eager at first. Once an Encoder has met enough work (`compile_after_tokens`; checked when a call
after the first ends, or at the start of a long call), a `BackgroundCompile` thread runs the model over
two synthetic batches on a stream of its own with the compiled functions (the token count marked
dynamic, so one graph serves every batch), then switches every function over at once. The caller's
thread keeps running eager meanwhile and never compiles; while one of its calls runs, the compile's
Python work waits (`calls_first`), so that the call keeps the GIL and is never slower for it.

Graphs go to the persistent cache (`embedfleet.platform.cache`), and a machine that has compiled a model shape
before starts compiling it much sooner (the cache makes it cheap).

Knobs (config.Settings): compile=False (EMBEDFLEET_COMPILE=0) never compiles; compile_tokens
(EMBEDFLEET_COMPILE_TOKENS) sets the tokens of work after which compiling starts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable

import torch


__all__ = ["BackgroundCompile", "Fused", "compile_after_tokens", "fused"]

log = logging.getLogger(__name__)

# Tokens of work (over all calls) after which compiling starts. A machine's first compile of a shape
# takes seconds to minutes: only for long work (8M tokens, ~110k reviews). From the cache it costs a
# fraction of that (docs/decisions/compile-thresholds.md): worth it for a few thousand texts more.
COLD_AFTER_TOKENS = 1 << 23
WARM_AFTER_TOKENS = 1 << 18
# A call of this many texts is long (8M tokens of reviews): compiling starts at its beginning. Otherwise
# it starts when a second call (or a later one) ends: a compile's Python work (tracing, loading from the
# cache) holds the GIL and would slow a short call that ends before the graph is ready, and a process
# that makes one call and exits would wait for a compile it never uses (the thread is not a daemon).
LONG_CALL_TEXTS = 1 << 17

# The interpreter's switch interval while a compile runs: dynamo's tracing holds the GIL, and a running call's thread,
# which gives it up at each wait on the device, would otherwise wait the default 5 ms each time to take it back.
COMPILE_SWITCH_S = 0.0005
# The longest a compile waits for one call to end. A call still running then may be waiting on something the
# paused compile holds (a module's import, a log handler): the compile stops waiting for calls.
MAX_PAUSE_S = 10.0
_WARMING = threading.local()  # .compiler is set on the thread that compiles, while it does


def compile_after_tokens(cached: bool, tokens: int | None = None) -> int:
    """`tokens` (Settings.compile_tokens) where given, else the default for a shape compiled before here
    (`cached`) or not."""
    return (WARM_AFTER_TOKENS if cached else COLD_AFTER_TOKENS) if tokens is None else tokens


class Fused:
    """`fn` (its first argument carries the tokens), eager until a BackgroundCompile switches it to its
    compiled graph; a compiled graph that fails later falls back to eager, saying so once."""

    def __init__(self, fn: Callable):
        self.fn, self._run, self._compiled = fn, fn, None
        self.warmed, self.failed = False, None

    @property
    def compiled(self) -> bool:
        return self._run is not self.fn

    def __call__(self, *args):
        compiler = getattr(_WARMING, "compiler", None)
        if compiler is not None:
            return self._warm(compiler, args)
        run = self._run
        if run is self.fn or args[0].shape[0] < 2:  # 0 and 1 tokens would each compile a graph of their own
            return self.fn(*args)
        try:
            return run(*args)
        except torch.OutOfMemoryError:
            raise  # the encoder halves its token budget and retries
        except Exception as err:  # noqa: BLE001 - any compiler failure: run eager, say so once
            log.warning("torch.compile'd %s failed (%s); running it eager", self.fn.__name__,
                        str(err).splitlines()[0] if str(err) else type(err).__name__)
            self._run = self.fn
            return self.fn(*args)

    def _warm(self, compiler: Callable, args: tuple):
        """On the compiling thread: compile (on the first call) and run the compiled graph."""
        if self.failed is not None:
            return self.fn(*args)
        if self._compiled is None:
            self._compiled = compiler(self.fn)
        n = args[0].shape[0]
        for a in args:  # every activation's token dimension: one graph for any batch
            if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == n:
                torch._dynamo.maybe_mark_dynamic(a, 0)
        try:
            out = self._compiled(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as err:  # noqa: BLE001 - this function stays eager
            self.failed = err
            return self.fn(*args)
        self.warmed = True
        return out

    def switch(self) -> bool:
        if self.warmed and self.failed is None:
            self._run = self._compiled
        return self.compiled


def fused(fn: Callable, device: torch.device, enabled: bool = True) -> Callable:
    """A Fused `fn` on CUDA (where compiling pays), `fn` itself elsewhere or with EMBEDFLEET_COMPILE=0."""
    return Fused(fn) if device.type == "cuda" and enabled else fn


def shape_key(config: dict, dtype: torch.dtype, device: torch.device) -> str:
    """What a compiled graph depends on: the model's shape (not its weights), dtype, GPU and torch."""
    dims = {k: v for k, v in config.items() if isinstance(v, (int, float, str, bool)) and k not in ("_name_or_path",)}
    digest = hashlib.sha1(json.dumps(dims, sort_keys=True).encode()).hexdigest()[:16]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return f"{digest}|{str(dtype).removeprefix('torch.')}|{gpu}|torch {torch.__version__}"


def _cache_counts() -> dict:
    """Inductor's FX-graph cache and AOTAutograd's cache, hits and misses so far in this process (whether
    a compile on a machine that compiled the shape before loaded its graphs or made them again), and the
    graphs dynamo traced."""
    from torch._dynamo.utils import counters

    return {"fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
            "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
            "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
            "aot_miss": counters["aot_autograd"]["autograd_cache_miss"],
            "graphs": counters["stats"]["unique_graphs"]}  # more than one a function: a recompile


# dynamo's timed phases worth telling apart: all of it, tracing, AOTAutograd with Inductor inside, Inductor,
# waiting for kernels, loading compiled code, guards
_PHASES = ("_compile.compile_inner", "bytecode_tracing", "create_aot_dispatcher_function", "compile_fx_inner",
           "async_compile.wait", "PyCodeCache.load_by_key_path", "build_guards")


def _compile_phases() -> dict:
    """Seconds this process has spent in each of _PHASES (dynamo's own timers, summed over its compiles)."""
    from torch._dynamo.utils import compile_times

    try:
        keys, values = compile_times(repr="csv", aggregate=True)
    except Exception:  # noqa: BLE001 - another torch's format: the counts above still tell
        return {}
    return {k: round(float(v), 2) for k, v in zip(keys, values) if k in _PHASES}


# Two synthetic batches (sequences, tokens each): the second, of another token count, shows that the
# first compiled a graph for any count (or makes torch.compile's automatic dynamic shapes do it).
_EXAMPLES = (((40, 23), (6, 301)), ((17, 29),))


class BackgroundCompile:
    """Compiles a packed model's Fused functions on a thread of its own, then switches them over.

    `state`: "waiting" (not started), "compiling", "compiled" or "failed" (the model stays eager).
    The thread is not a daemon: a process that ends while it compiles waits for it (its graphs are
    then in the cache for the next process) rather than tear torch down under it.
    """

    def __init__(self, model, device: torch.device, vocab_size: int, max_len: int, key: str, cache: Path,
                 start_after: int | None = None, compiler: Callable | None = None):
        from embedfleet.platform.cache import compiled_before

        self.model, self.device, self.key, self.cache_root = model, device, key, cache
        self.parts: list[Fused] = [p for p in getattr(model, "fused", []) if isinstance(p, Fused)]
        self._vocab, self._max_len = max(2, min(int(vocab_size), 1000)), int(max_len)
        self.cached_seconds = compiled_before(cache, key)
        self.start_after = start_after if start_after is not None else compile_after_tokens(self.cached_seconds is not None)
        self._compiler = compiler
        self._seen = self._calls = 0
        self.state, self.seconds, self.error = "waiting", None, None
        self.cache: dict | None = None  # the compile's Inductor and AOTAutograd cache hits and misses, graphs
        self.phases: dict | None = None  # seconds in dynamo's timed phases
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._running = 0  # callers' calls under calls_first
        self._idle = threading.Event()
        self._idle.set()
        self._pausing = True  # until a pause outlasts MAX_PAUSE_S

    @contextmanager
    def calls_first(self):
        """A caller's call: while it runs, the compile's thread pauses at its next Python function call (a
        profile hook on that thread), so the call is never slowed by the compile taking the GIL."""
        with self._lock:
            self._running += 1
            self._idle.clear()
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                if not self._running:
                    self._idle.set()

    def _pause_for_calls(self, frame, event, arg) -> None:
        """The compile thread's profile hook."""
        if event == "call" and self._pausing and not self._idle.is_set():
            if not self._idle.wait(MAX_PAUSE_S):
                self._pausing = False
                log.warning("a call outlasted %.0f s while the compile waited for it; compiling beside calls",
                            MAX_PAUSE_S)

    def note(self, tokens: int) -> None:
        """Count `tokens` of work."""
        self._seen += tokens

    def start_if_due(self) -> None:
        """At the end of each call: start once there has been enough work, over two calls or more
        (see LONG_CALL_TEXTS)."""
        self._calls += 1
        if self.state == "waiting" and self._seen >= self.start_after and self._calls >= 2:
            self.start()

    def start(self) -> None:
        with self._lock:
            if self._thread is not None or not self.parts:
                if not self.parts:
                    self._done.set()
                return
            self.state = "compiling"
            self._thread = threading.Thread(target=self._run, name="embedfleet-compile", daemon=False)
        log.info("compiling the forward pass in the background (%s)",
                 f"cached: last took {self.cached_seconds:.1f} s" if self.cached_seconds is not None
                 else "first time on this machine")
        self._thread.start()

    def report(self) -> dict:
        """State, seconds, the last compile's seconds on this machine before this one, cache hits/misses,
        phases."""
        return {"state": self.state, "seconds": self.seconds, "cached_before_s": self.cached_seconds,
                "cache": self.cache, "phases_s": self.phases}

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a started compile to finish (at once if none started); True when finished."""
        with self._lock:
            if self._thread is None:
                return True
        return self._done.wait(timeout)

    def _batch(self, groups) -> tuple[torch.Tensor, object]:
        from embedfleet.encode.packed.attention import Packing, token_layout

        lengths = [min(length, self._max_len) for count, length in groups for _ in range(count)]
        total = sum(lengths)
        len_d = torch.tensor(lengths, dtype=torch.int32, device=self.device)
        ids = (torch.arange(total, device=self.device) % self._vocab).to(torch.int32)
        cu, seg, pos = token_layout(len_d, total)
        return ids, Packing(cu=cu, max_len=max(lengths), seg=seg, pos=pos, lengths=len_d)

    def _run(self) -> None:
        t0 = time.perf_counter()
        cuda = self.device.type == "cuda"
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, COMPILE_SWITCH_S))
        sys.setprofile(self._pause_for_calls)  # this thread's only
        try:
            from embedfleet.platform.cache import use_compile_cache

            use_compile_cache(self.cache_root)
            before = _cache_counts()
            compiler = self._compiler or torch.compile
            stream = torch.cuda.Stream(self.device) if cuda else None
            # The current device and stream are per thread: this thread's batches run beside the caller's.
            with (torch.cuda.device(self.device) if cuda else nullcontext()), \
                    (torch.cuda.stream(stream) if cuda else nullcontext()), torch.inference_mode():
                _WARMING.compiler = compiler
                try:
                    for groups in _EXAMPLES:
                        self.model(*self._batch(groups))
                finally:
                    _WARMING.compiler = None
                if cuda:
                    stream.synchronize()
            after = _cache_counts()
            self.cache, self.phases = {k: after[k] - before[k] for k in after}, _compile_phases()
            switched = [p.switch() for p in self.parts if p.warmed or p.failed is not None]
            failed = [p for p in self.parts if p.failed is not None]
            self.seconds = time.perf_counter() - t0
            if failed:
                self.error = failed[0].failed
                log.warning("torch.compile failed for %s (%s); running eager", failed[0].fn.__name__,
                            str(self.error).splitlines()[0] if str(self.error) else type(self.error).__name__)
            self.state = "compiled" if any(switched) else "failed"
            if self.state == "compiled" and not failed:
                from embedfleet.platform.cache import record_compiled

                record_compiled(self.cache_root, self.key, self.seconds)
                log.info("forward pass compiled in %.1f s (cache: %s); switched to it", self.seconds,
                         ", ".join(f"{k} {v}" for k, v in self.cache.items()))
        except Exception as err:  # noqa: BLE001 - the model stays eager; say why once
            self.state, self.error, self.seconds = "failed", err, time.perf_counter() - t0
            log.warning("compiling the forward pass failed (%s); running eager", str(err).splitlines()[0])
        finally:
            sys.setprofile(None)
            if sys.getswitchinterval() == min(interval, COMPILE_SWITCH_S):  # unless someone set another meanwhile
                sys.setswitchinterval(interval)
            self._done.set()
