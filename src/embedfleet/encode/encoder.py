"""The Encoder: texts in, L2-normalised float32 vectors out, in input order.

tokenize() (any thread, CPU) -> Tokenized, packed and length-sorted
embed() (one thread at a time, the device): one pinned host->device copy per call, token-budget
batches of packed sequences through the packed (or generic) forward, pooling and normalisation
on the device into one output buffer, one device->host copy at the end: no sync per batch.
encode() pipelines the two over chunks so the device never waits for the tokenizer.

Small work stays small: a query or a few thousand texts run eagerly in this process. On a GPU the
tokenizer's helper processes start with the constructor (elsewhere with warmup() or at the first call of
LONG_CALL_TEXTS texts), and chunks tokenize here until they are up. On CUDA the forward pass is compiled
in the background once enough work has come (`compile.py`).
"""

from __future__ import annotations

import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from embedfleet.encode import packed
from embedfleet.encode.batching import cumulative
from embedfleet.encode.budget import (SMALL_MODEL_HIDDEN, TokenBudget, activation_bytes_per_token, probe_batch_tokens,
                                      run_with_backoff)
from embedfleet.encode.compile import LONG_CALL_TEXTS, BackgroundCompile, Fused, compile_after_tokens, shape_key
from embedfleet.encode.models import check_remote_code, model_name, read_spec, resolve_model, unnamed_prompt
from embedfleet.encode.packed.attention import Packing, token_layout
from embedfleet.encode.pooling import apply_post, finish, pool_packed, post_modules
from embedfleet.encode.tokenize import Tokenized, TokenizerSpec, model_tokenizer
from embedfleet.errors import ModelError
from embedfleet.platform.cache import cache_dir, compiled_before, use_compile_cache
from embedfleet.settings import Settings

MAX_CHUNK, MIN_CHUNK = 16384, 2048  # encode() tokenizes chunks ahead while the device embeds
FIRST_CHUNK = 128  # encode()'s first chunk: the device idles only while this many texts are tokenized
_WARM_TEXTS = ["warm up"] * 8 + ["warm up " * 200] * 2  # a short and a long sequence: each kernel's first call
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def _device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelError(f"device {device!r}: use auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ModelError(f"device {device!r}: use auto, cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelError(f"device '{device}' asked for, but CUDA is not available here. Use --device cpu.")
        dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
    return dev


def _helpers_at_start(dev: torch.device) -> bool:
    """Whether the tokenizer's helpers start with the encoder: on a GPU, which outruns one tokenizing thread several
    times over (they serve every chunk that begins once they are up)."""
    return dev.type == "cuda"


def _start_cuda(dev: torch.device) -> None:
    """The CUDA context, on a thread while the weights are read."""
    torch.empty(1, device=dev)


@dataclass
class _Pending:
    host: torch.Tensor  # [n, dim] float32, input order (pinned on CUDA; result() is a view of it)
    done: torch.cuda.Event | None

    def result(self) -> np.ndarray:
        if self.done is not None:
            self.done.synchronize()
        return self.host.numpy()


class Encoder:
    """`Encoder(model)`: a directory or hub id (default: $EMBEDFLEET_MODEL, else the bundled MiniLM). `settings`:
    the process's knobs (compile, Triton, word cache, home), resolved from the environment when not given.
    `tokenizer_workers`: the tokenizer's helper processes (default: half the cores, at most 8; on a GPU they start
    with the encoder); 0 where only a few texts at a time come (queries)."""

    def __init__(self, model=None, device="auto", dtype=None, *, batch_tokens="auto", dim=None, prompt=None,
                 tokenizer_workers=None, settings: Settings | None = None, trust_remote_code: bool = False,
                 task: str | None = None):
        self.settings = s = settings or Settings.from_env()
        model = model or s.model
        self.spec = spec = read_spec(resolve_model(model))
        spec.check_task(task)
        self.task = task  # for a model's own module that takes one (else the prompt's name is its task)
        self._dev = _device(device)
        if isinstance(dtype, str) and dtype not in _DTYPES:
            raise ModelError(f"dtype {dtype!r}: use one of {', '.join(_DTYPES)} (or a torch dtype)")
        if not (dtype is None or isinstance(dtype, str) or isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ModelError(f"dtype {dtype!r}: use one of {', '.join(_DTYPES)} or a floating torch dtype")
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, (int, np.integer))):
            raise ModelError(f"dim {dim!r}: give the vectors' width as a whole number")
        _check_prompt_type(prompt)
        self.dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
        if self.dtype is None:
            self.dtype = torch.bfloat16 if self._dev.type == "cuda" else torch.float32
        if self._dev.type == "cuda":
            use_compile_cache(cache_dir(s.home_path))  # before any Triton kernel or compile: their caches here
        self._tok = None
        try:
            self._load(spec, model, s, dim, prompt, batch_tokens, tokenizer_workers, trust_remote_code)
        except BaseException:  # the helpers may be starting: they go with the half-built encoder
            if self._tok is not None:
                self._tok.close(wait=False)
            raise

    def _load(self, spec, model, s: Settings, dim, prompt, batch_tokens, tokenizer_workers, trust_remote_code: bool):
        """The tokenizer (its helpers starting, on a GPU), the weights on the device, the token budget, the
        background compile; on CUDA the libraries' first calls."""
        with ThreadPoolExecutor(1, thread_name_prefix="embedfleet-cuda") as aside:
            # On a GPU its context starts on that thread while this one reads the weights.
            starting = aside.submit(_start_cuda, self._dev) if self._dev.type == "cuda" else None
            if s.triton:
                packed.import_kernels_aside(spec, self._dev)
            state = packed.load_state(spec.hf_dir) if packed.supports(spec) else None
            self._tok = model_tokenizer(spec, word_cache=s.word_cache).build(tokenizer_workers)
            if _helpers_at_start(self._dev):
                self._tok.start_background()
            if starting is not None:
                starting.result()
        self.model = (packed.build(spec, self._dev, self.dtype, state, compile=s.compile, triton=s.triton)
                      if state is not None else None)
        del state
        self.path = "packed"
        if self.model is None:
            from embedfleet.encode.generic import CustomModuleModel, GenericModel

            check_remote_code(spec, trust_remote_code)
            self.model, self.path = (CustomModuleModel(spec, self._dev, self.dtype) if spec.custom else
                                     GenericModel(spec, self._dev, self.dtype, trust_remote_code)), "generic"
            if spec.custom:
                self.model.task = spec.task(prompt, self.task)
        hidden = self.model.hidden
        width = spec.output_dim(hidden)  # a Dense module after the pooling sets the vectors' width
        self._post = post_modules(spec, self._dev)
        if dim is not None and not 0 < int(dim) <= width:
            raise ModelError(f"--dim {dim} is out of range: {spec.path.name} makes {width}-dimensional vectors.")
        self.dim = int(dim) if dim else width
        self.max_seq_length = spec.max_seq_length
        self.name = model_name(model, spec.path)
        self.prompt = prompt
        self._warned: set[str] = set()
        self._check_prompt(prompt)
        if batch_tokens == "auto":
            per = activation_bytes_per_token(hidden, int(spec.config.get("intermediate_size", 4 * hidden)), self.dtype)
            batch_tokens = probe_batch_tokens(self._dev, per, self.max_seq_length, hidden)
        self.budget = TokenBudget(int(batch_tokens), self.max_seq_length)
        self._lock = threading.Lock()
        # On CUDA, the packed forward's glue is compiled in the background once enough work has come.
        self._compile = None
        if self.path == "packed" and any(isinstance(p, Fused) for p in self.model.fused):
            cache = cache_dir(s.home_path)
            self._compile = BackgroundCompile(self.model, self._dev, spec.config.get("vocab_size", 1000),
                                              self.max_seq_length, shape_key(spec.config, self.dtype, self._dev),
                                              cache, compile_after_tokens(compiled_before(cache, shape_key(
                                                  spec.config, self.dtype, self._dev)) is not None, s.compile_tokens))
        if self._dev.type == "cuda":
            # cuBLAS's and FlashAttention's first calls here, while the helpers start, rather than in the first encode
            self._launch(self.tokenize(_WARM_TEXTS, pool=False)).result()

    @property
    def device(self) -> str:
        return str(self._dev)

    @property
    def small(self) -> bool:
        """A model whose forward pass is cheap next to the host's work around it (budget.SMALL_MODEL_HIDDEN):
        its batches are bigger, and a worker compiles it only for long jobs."""
        return self.model.hidden <= SMALL_MODEL_HIDDEN

    def describe(self) -> dict:
        return {"model": str(self.spec.path), "name": self.name, "architecture": self.spec.architecture,
                "path": self.path, "dtype": str(self.dtype).removeprefix("torch."), "device": self.device,
                "batch_tokens": self.budget.tokens, "dim": self.dim, "max_seq_length": self.max_seq_length,
                "pooling": self.spec.pooling, "tokenizer_workers": self._tok.workers,
                "compile": self._compile.state if self._compile is not None else "off"}

    def tokenize(self, texts: list[str], prompt: str | None = None, pool: bool = True) -> Tokenized:
        if self.spec.custom:  # the task (or the one the prompt names) goes to the model's own module with these texts
            self.model.task = self.spec.task(prompt if prompt is not None else self.prompt, self.task)
        prefix = self.spec.prompt_text(prompt if prompt is not None else self.prompt)
        try:
            return self._tok.tokenize(texts, prefix, pool)
        except (TypeError, AttributeError):
            _check_strings(texts)
            raise

    def tokenizer_spec(self, prompt: str | None = None) -> TokenizerSpec:
        """This model's tokenizer and prompt, for tokenizing in another process."""
        return self._tok.spec(self.spec.prompt_text(prompt if prompt is not None else self.prompt))

    def embed(self, tok: Tokenized) -> np.ndarray:
        with self._calls_first():
            out = self._launch(tok).result()
        self._compile_if_due()
        return out

    def _calls_first(self, long: bool = False):
        """A caller's call (encode, embed): a compile under way waits while it runs, unless the call is long (it
        would take the GIL from a short one; a long one started the compile to run beside it)."""
        return self._compile.calls_first() if self._compile is not None and not long else nullcontext()

    def _compile_if_due(self) -> None:
        if self._compile is not None:
            self._compile.start_if_due()

    def warmup(self, wait: bool = True, compile: bool | None = True) -> None:
        """Pay start-up costs now rather than in the first real batches: the tokenizer's helper
        processes (waited for), and on CUDA the Triton kernels' loading and the forward pass's compilation,
        which run in the background (eager meanwhile); `wait` waits for them. `compile=None` (little work
        ahead) leaves the compile to the usual rule, once enough tokens have been seen; `False`
        never compiles (the work ahead would not pay for it)."""
        self._tok.start()
        loaded = getattr(self.model, "kernels_loaded", None)
        if loaded is not None and wait:  # the Triton kernels, loading on their thread (compiled on a first use)
            loaded.wait()
        if compile is False and self._compile is not None and self._compile.state == "waiting":
            self._compile = None  # (one already started, by a long call, is left to finish)
        if self._dev.type != "cuda":
            return
        if self._compile is not None and compile:
            self._compile.start()
            if wait:
                self._compile.wait()

    def compile_report(self) -> dict | None:
        """The background compile's state, seconds and cache hits (None where nothing compiles)."""
        return self._compile.report() if self._compile is not None else None

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for a background compile that has started (at once if none has); True when done."""
        return self._compile is None or self._compile.wait(timeout)

    def embed_async(self, tok: Tokenized) -> "_Pending":
        """Queue `tok` on the device and return at once; `.result()` waits for its vectors. Queue the
        next batch before reading this one's result and the device never idles between them."""
        self._compile_if_due()
        return self._launch(tok)

    def _check_prompt(self, prompt: str | None) -> None:
        """A role's name on a model without prompts adds nothing, and a word that names none of a model's prompts
        goes before each text as it is: each said once, as the CLI says it."""
        if prompt is None or prompt in self._warned:
            return
        if said := unnamed_prompt(self.spec, self.name, prompt):
            self._warned.add(prompt)
            warnings.warn(f"prompt={prompt!r}: {said}", UserWarning, stacklevel=3)

    def encode(self, texts: list[str] | str, prompt: str | None = None) -> np.ndarray:
        """Unit vectors [len(texts), dim] for `texts` (any iterable of strings); one string gives its vector [dim],
        as sentence-transformers does."""
        if isinstance(texts, str):
            return self.encode([texts], prompt)[0]
        self._open()
        _check_prompt_type(prompt)
        self._check_prompt(prompt)
        texts = _text_list(texts)
        long = len(texts) >= LONG_CALL_TEXTS
        if self._compile is not None and long:
            self._compile.start()  # a long call: the compiled graph will be ready for most of it
        with self._calls_first(long):
            out = self._encode(texts, prompt, pool=long or self._tok.pool_started)
        self._compile_if_due()
        return out

    def _encode(self, texts: list[str], prompt: str | None, pool: bool) -> np.ndarray:
        """The helpers serve a call once started (on a GPU, by the constructor), or if it is very long (it starts
        them: `pool`); until they are up, chunks tokenize here. A short call on a CPU never starts them."""
        size = min(MAX_CHUNK, max(MIN_CHUNK, len(texts) // 8))  # >= 8 chunks, so the overlap pays
        if len(texts) <= size:
            return self._launch(self.tokenize(texts, prompt, pool)).result()
        cuts = chunk_bounds(len(texts), size)
        chunks = [texts[a:b] for a, b in zip(cuts, cuts[1:])]
        out, pending = [], None
        # Two chunks tokenize ahead (keeping the pool busy between them) while the device embeds;
        # chunk k's result is read only after chunk k+1 has been queued on the device.
        with ThreadPoolExecutor(2, thread_name_prefix="embedfleet-tok") as ahead:
            futures = [ahead.submit(self.tokenize, c, prompt, pool) for c in chunks[:2]]
            for k in range(len(chunks)):
                if k + 2 < len(chunks):
                    futures.append(ahead.submit(self.tokenize, chunks[k + 2], prompt, pool))
                nxt = self._launch(futures[k].result())
                if pending is not None:
                    out.append(pending.result())
                pending = nxt
        out.append(pending.result())
        return np.concatenate(out)

    def _launch(self, tok: Tokenized) -> _Pending:
        n, dev, cuda = len(tok), self._dev, self._dev.type == "cuda"
        if n == 0:
            return _Pending(torch.zeros(0, self.dim), None)
        lengths = tok.lengths
        cu = cumulative(lengths)
        total = int(cu[-1])
        if self._compile is not None:
            self._compile.note(total)
        # Only ids, lengths and the input order travel; each token's sequence and position are
        # derived on the device (a few queued kernels instead of milliseconds of numpy a unit on
        # this thread, which feeds the GPU and shares the GIL with the writers).
        host = torch.empty(total + 2 * n, dtype=torch.int32, pin_memory=cuda)
        np.concatenate([tok.ids, lengths, tok.inverse], out=host.numpy(), casting="same_kind")
        with self._lock, torch.inference_mode():
            buf = host.to(dev, non_blocking=True)
            ids, len_d, inverse = buf.split([total, n, n])
            cu_d, seg, pos = token_layout(len_d, total)
            out = torch.empty(n, self.dim, dtype=torch.float32, device=dev)
            skip = 0 if self.spec.include_prompt else tok.prompt_tokens

            def step(s: int, e: int) -> None:
                t0, t1 = int(cu[s]), int(cu[e])
                pk = Packing(cu=cu_d[s : e + 1] - t0, max_len=int(lengths[s:e].max()), seg=seg[t0:t1] - s,
                             pos=pos[t0:t1], lengths=len_d[s:e])
                hidden = self.model(ids[t0:t1], pk)
                pooled = pool_packed(hidden, pk.cu, pk.seg, pk.lengths, self.spec.pooling, pk.pos, skip)
                out[s:e] = finish(apply_post(pooled, self._post) if self._post else pooled, self.dim)

            run_with_backoff(cu, self.budget, step, on_oom=torch.cuda.empty_cache if cuda else None)
            res = torch.empty(n, self.dim, dtype=torch.float32, pin_memory=cuda)
            res.copy_(out.index_select(0, inverse), non_blocking=cuda)  # back in input order
            done = None
            if cuda:
                # Waiting on it sleeps instead of spinning: a small model's worker waits most of the
                # time, and a spinning core is one its helpers and PostgreSQL cannot use.
                done = torch.cuda.Event(blocking=True)
                done.record()
        return _Pending(res, done)

    def digest(self) -> str:
        """What the model computes, whatever its folder's name: `ModelSpec.digest`."""
        return self.spec.digest()

    def close(self) -> None:
        self._tok.close()
        self.model = None

    def _open(self) -> None:
        if self.model is None:
            raise ModelError("this Encoder is closed: make a new one")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def chunk_bounds(n: int, size: int, first: int = FIRST_CHUNK) -> list[int]:
    """Where encode() cuts `n` texts into chunks: a small first one (the device waits for it alone), each next
    twice the last, so each is tokenized while the one before embeds, up to `size`."""
    bounds, step = [0], min(first, size)
    while bounds[-1] < n:
        bounds.append(min(n, bounds[-1] + step))
        step = min(size, 2 * step)
    return bounds


def _text_list(texts) -> list:
    """encode()'s texts as a list, or a TypeError saying what it takes (bytes would go by as numbers)."""
    if isinstance(texts, (bytes, bytearray)):
        raise TypeError("encode() takes strings, not bytes: decode them first (e.g. b.decode('utf-8'))")
    try:
        return list(texts)
    except TypeError:
        raise TypeError(f"encode() takes a string or an iterable of strings, not {type(texts).__name__}") from None


def _check_prompt_type(prompt) -> None:
    if prompt is not None and not isinstance(prompt, str):
        raise TypeError(f"prompt takes a string (a name of the model's prompts, or text put before each text), "
                        f"not {type(prompt).__name__}")


def _check_strings(texts: list) -> None:
    """A TypeError naming the first item of `texts` that is not a string (the tokenizer's own says nothing of which)."""
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"encode() takes strings: item {i} is {type(t).__name__}")
