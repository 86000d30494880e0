"""`embedfleet serve`: nearest-row search and embeddings over HTTP, the model loaded once (Starlette on uvicorn).

    GET|POST /search?q=TEXT[&k=N][&where=SQL][&hybrid=true][&rerank=true][&group_by_parent=true]
        ->  {"results": [{"id", "distance", "content", …}], "scan"}
    POST /v1/embeddings {"input": str | [str], "model", "encoding_format", "dimensions"}  ->  OpenAI's answer
    GET /v1/models  ->  the one model, as OpenAI lists models
    GET /health  ->  {"table", "model", "path", "device", "dim"}      GET /metrics  ->  Prometheus text
    GET /openapi.json  ->  the routes, described     GET /docs  ->  them in Swagger UI (its files from a CDN)

With an API key (--api-key, EMBEDFLEET_API_KEY) every route but /health wants `Authorization: Bearer KEY`;
without one, serve listens on loopback only. Embedding requests that arrive together are encoded together (one
batch on the device). Bodies over MAX_REQUEST_BYTES, more inputs than MAX_INPUTS and an input over
MAX_INPUT_CHARS are refused (413); every bad request gets a 4xx with one line.

The same results as `embedfleet search --json` (the same query encoder, the same SQL). Every request's
statement runs under `--statement-timeout`, and is cancelled on the server when its client goes away.
`where` is a stranger's SQL: it is refused unless `--allow-where`, and then it runs as a role that reads the
served table and nothing else (store/roles.py), in a READ ONLY transaction. It listens on 127.0.0.1 unless
--host says otherwise.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import hmac
import json
import logging
import queue
import socket
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from contextlib import contextmanager
from typing import Callable

import numpy as np

from embedfleet.errors import DatabaseError, EmbedfleetError, InputError, OptionError
from embedfleet.query.rerank import RERANK_DEPTH

__all__ = ["SearchService", "make_app", "serve"]

log = logging.getLogger(__name__)

MAX_K = 1000
SEARCH_PARAMS = frozenset({"q", "k", "where", "hybrid", "rerank", "group_by_parent"})
SWITCHES = ("hybrid", "rerank", "group_by_parent")  # /search's true-or-false parameters
# The search's own errors name its CLI flags; over HTTP the client gave these parameters.
# options whose HTTP spelling is not `name=value`: a switch is named as the client turned it on
HTTP_SWITCHES = {"hybrid": "hybrid=true", "group-by-parent": "group_by_parent=true"}

MAX_REQUEST_BYTES = 4 << 20  # a request's body
MAX_INPUTS = 2048  # texts in one /v1/embeddings request
# characters in one input: a model reads its first tokens only (it truncates, as sentence-transformers does), so a
# text far past any model's length is a client's mistake, refused as OpenAI refuses one over its token limit
MAX_INPUT_CHARS = 1 << 16
BATCH_TEXTS = 4096  # texts the batcher takes together at most
# texts the batcher encodes in one turn on the device: a search waits for at most one slice
SLICE_TEXTS_CPU, SLICE_TEXTS_GPU = 32, 512
CONNECTIONS = 4  # database connections kept for searches, per pool (requests beyond wait for one)
DISCONNECT_POLL_S = 0.05  # how often a request's client is checked while its search or its many texts wait
WATCHED_TEXTS = 64  # an embedding request of more texts is watched for its client going away


def as_http(err: InputError) -> str:
    """A search error in an HTTP client's words: `where='…': …`, not the CLI's `--where '…': …`."""
    if not isinstance(err, OptionError):
        return str(err)
    if err.value is None:
        return err.named(HTTP_SWITCHES.get(err.option, err.option))
    return f"{err.option}={err.value!r}: {err.detail}"


def _loopback(host: str) -> bool:
    """Whether `host` is this machine only: localhost, or an address in 127.0.0.0/8 or ::1."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve beyond this machine
        return False


def _pick_device(device: str) -> str:
    """"auto": a GPU where there is one (a long-lived process pays CUDA's start-up once), else the CPU."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class Running:
    """The connection a request's search runs on, so that another thread can cancel its statement."""

    def __init__(self):
        self.conn = None
        self.cancelled = False
        self._lock = threading.Lock()

    def attach(self, conn) -> None:
        with self._lock:
            self.conn = conn
            if self.cancelled:
                raise InputError("the client went away")

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            conn = self.conn
        if conn is not None and not conn.closed:
            (getattr(conn, "cancel_safe", None) or conn.cancel)()


class Turns:
    """The query encoder, one call at a time, in the order the calls asked for it, each handed the turn by the
    one before (no thundering herd): a long embedding request goes slice by slice, each slice asking again, so a
    search that arrives meanwhile waits for one slice, not the whole request, and a stream of searches cannot
    starve the request either."""

    def __init__(self):
        self._lock = threading.Lock()
        self._busy = False
        self._waiting: deque[threading.Event] = deque()

    @contextmanager
    def turn(self):
        with self._lock:
            mine = None if not self._busy else threading.Event()
            if mine is None:
                self._busy = True
            else:
                self._waiting.append(mine)
        if mine is not None:
            try:
                mine.wait()
            except BaseException:
                with self._lock:
                    if mine in self._waiting:  # never handed the turn: leave the line
                        self._waiting.remove(mine)
                        raise
                self._pass()  # handed it meanwhile: hand it on
                raise
        try:
            yield
        finally:
            self._pass()

    def _pass(self) -> None:
        with self._lock:
            if self._waiting:
                self._waiting.popleft().set()  # still busy: the next caller has the turn
            else:
                self._busy = False


class Batcher:
    """Embedding requests encoded on a thread of its own, those that arrived while the last batch ran as one batch
    (continuous batching): each request's texts get their vectors and token counts back through a future. A batch
    is encoded `slice_texts` at a time, each slice taking its turn on the encoder (Turns), its shortest requests
    first; each request is answered at the slice that ends it, and one whose future was cancelled (its client went
    away) is encoded no further."""

    def __init__(self, encode: Callable, turns: Turns, slice_texts: int = BATCH_TEXTS):
        self._encode, self._turns, self._slice = encode, turns, slice_texts
        self._todo: queue.Queue = queue.Queue()
        self.waiting = 0  # requests queued or in the batch being encoded (a gauge)
        self._count = threading.Lock()  # `waiting` changes on the server's thread and on this one
        self._thread = threading.Thread(target=self._run, name="embedfleet-batcher", daemon=True)
        self._thread.start()

    def submit(self, texts: list[str]) -> Future:
        fut: Future = Future()
        with self._count:
            self.waiting += 1
        self._todo.put((texts, fut))
        return fut

    def _encode_batch(self, batch: list[tuple[list[str], Future]]) -> None:
        # each request: its texts, its future, its encoded parts, how many of its texts are encoded
        pending = [[texts, fut, [], 0] for texts, fut in sorted(batch, key=lambda item: len(item[0]))]
        while pending := [p for p in pending if not p[1].cancelled()]:
            take, room = [], self._slice
            for p in pending:
                if room == 0:
                    break
                n = min(room, len(p[0]) - p[3])
                take.append((p, p[3], p[3] + n))
                room -= n
            with self._turns.turn():
                vectors, lengths = self._encode([t for p, a, b in take for t in p[0][a:b]])
            at = 0
            for p, a, b in take:
                p[2].append((vectors[at:at + b - a], lengths[at:at + b - a]))
                p[3], at = b, at + b - a
                if b == len(p[0]):
                    _settle(p[1], result=(np.concatenate([v for v, _ in p[2]]),
                                          int(sum(int(n.sum()) for _, n in p[2]))))
            pending = [p for p in pending if p[3] < len(p[0])]

    def _run(self) -> None:
        while True:
            first = self._todo.get()
            if first is None:
                return
            # no timer: what queued while the last batch ran goes in this one, and a lone request waits for nothing
            batch, n = [first], len(first[0])
            while n < BATCH_TEXTS:
                try:
                    item = self._todo.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._todo.put(None)
                    break
                batch.append(item)
                n += len(item[0])
            try:
                self._encode_batch(batch)
            except BaseException as e:  # noqa: BLE001 - every request of the batch not yet answered hears it
                for _, fut in batch:
                    _settle(fut, error=e)
            with self._count:
                self.waiting -= len(batch)

    def close(self) -> None:
        self._todo.put(None)


def _settle(fut: Future, result=None, error: BaseException | None = None) -> None:
    """Answer `fut` unless it is answered or cancelled (its client went away) already."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


class Metrics:
    """Prometheus metrics of one server (prometheus-client, the `metrics` extra): requests by route and status,
    their latency, embedding requests waiting, tokens embedded."""

    def __init__(self, waiting: Callable[[], float]):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("embedfleet_requests", "HTTP requests", ["route", "status"], registry=self.registry)
        self.latency = Histogram("embedfleet_request_seconds", "request latency", ["route"], registry=self.registry,
                                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.tokens = Counter("embedfleet_tokens", "tokens embedded for /v1/embeddings", registry=self.registry)
        Gauge("embedfleet_queue_depth", "embedding requests waiting or in the batch being encoded",
              registry=self.registry).set_function(waiting)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _Pool:
    """Searchers on connections to one DSN, opened as needed up to `limit`."""

    def __init__(self, make: Callable[[], object], limit: int):
        self._make, self._limit, self._open = make, max(1, limit), 0
        self._idle: queue.LifoQueue = queue.LifoQueue()
        self._lock = threading.Lock()

    def put_first(self, searcher) -> None:
        with self._lock:
            self._open += 1
        self._idle.put(searcher)

    def take(self):
        with self._lock:
            grow = self._idle.empty() and self._open < self._limit
            if grow:
                self._open += 1
        if not grow:
            return self._idle.get()
        try:
            return self._make()
        except BaseException:
            with self._lock:
                self._open -= 1
            raise

    def give(self, searcher, healthy: bool) -> None:
        if healthy and not searcher.conn.closed:
            self._idle.put(searcher)
            return
        searcher.conn.close()
        with self._lock:
            self._open -= 1

    def close(self) -> None:
        while not self._idle.empty():
            self._idle.get().conn.close()


class SearchService:
    """One table's searches: the query encoder, and pools of connections each with its Searcher: one for
    searches without a filter, one (as the reader role, `where_dsn`) for searches with one."""

    def __init__(self, dsn: str, table: str, k: int = 10, model: str | None = None, device: str = "auto",
                 connections: int = CONNECTIONS, where_dsn: str | None = None, statement_timeout: float = 5.0,
                 settings=None, trust_remote_code: bool = False, rerank: str | None = None):
        from embedfleet.pg.connect import connect
        from embedfleet.query.search import Searcher, query_encoder

        self.table, self.k, self.allow_where = table, k, where_dsn is not None
        self.connections = connections  # each pool's: searches beyond them wait for one
        self.statement_timeout = statement_timeout

        def opener(target: str) -> Callable[[], object]:
            def make():
                conn = connect(target)
                try:
                    # a backend whose client is gone notices within a second (PostgreSQL ≥ 14)
                    conn.execute("SELECT set_config('client_connection_check_interval', '1000', false) "
                                 "WHERE current_setting('server_version_num')::int >= 140000")
                    return Searcher(conn, table, statement_timeout)
                except BaseException:
                    conn.close()
                    raise
            return make

        first = opener(dsn)()
        try:
            self.encoder = query_encoder(first.conn, table, model, _pick_device(device), settings, trust_remote_code)
        except BaseException:
            first.conn.close()
            raise
        self._plain = _Pool(opener(dsn), connections)
        self._plain.put_first(first)
        self._filtered = _Pool(opener(where_dsn), connections) if where_dsn else None
        self._turns = Turns()  # the query encoder: one call at a time, in turn
        self.reranker = None
        if rerank:
            from embedfleet.query.rerank import Reranker

            self.reranker = Reranker(rerank, device=self.encoder.device, trust_remote_code=trust_remote_code)
        self._rerank_lock = threading.Lock()
        # /v1/embeddings: documents, with the model's default prompt
        self.batcher = Batcher(lambda texts: self.encoder.encode_counted(texts, prompt=None), self._turns,
                               SLICE_TEXTS_CPU if self.encoder.device == "cpu" else SLICE_TEXTS_GPU)

    def describe(self) -> dict:
        return {"table": self.table, **self.encoder.describe()}

    def search(self, q: str, k: int | None = None, where: str | None = None, running: Running | None = None,
               hybrid: bool = False, rerank: bool = False, group_by_parent: bool = False) -> tuple[list[dict], str]:
        """(the top-k rows, how they were found). `running` lets another thread cancel the statement. `hybrid`:
        the full-text ranking of `q` fused with the vector ranking (Searcher.hybrid). `group_by_parent`: the best
        passage of each of the k nearest records."""
        if where and self._filtered is None:
            raise InputError("filters are off on this server: start `embedfleet serve` with --allow-where")
        if rerank and self.reranker is None:
            raise InputError("reranking is off on this server: start `embedfleet serve` with --rerank MODEL")
        with self._turns.turn():
            vec = self.encoder.encode([q])[0]
        pool = self._filtered if where else self._plain
        searcher = pool.take()
        healthy = False
        try:
            if running is not None:
                running.attach(searcher.conn)
            want = k or self.k
            results = searcher.search(vec, max(want, RERANK_DEPTH) if rerank else want, where,
                                      group_by_parent=group_by_parent, text=q if hybrid else None)
            healthy = True
            if rerank:
                with self._rerank_lock:
                    results = self.reranker.rerank(q, results, want)
            return results, searcher.scan
        except EmbedfleetError:  # the user's input (a bad where): the connection rolled back, still good
            healthy = not searcher.conn.broken
            if where and not healthy:
                raise InputError(f"where={where!r} ended its own database connection") from None
            raise
        except Exception as e:
            import psycopg

            if where and isinstance(e, psycopg.Error) and searcher.conn.broken:
                raise InputError(f"where={where!r} ended its own database connection") from None
            if isinstance(e, psycopg.OperationalError):  # the server went away (its next searcher reconnects)
                raise DatabaseError(f"the database did not answer: {str(e).splitlines()[0]}") from None
            if isinstance(e, psycopg.errors.UndefinedTable):
                raise DatabaseError(f"table {self.table} is gone (dropped or renamed while serving)") from None
            raise
        finally:
            pool.give(searcher, healthy)

    def embed(self, texts: list[str]) -> Future:
        """The texts' vectors and their tokens, once the batcher has encoded them (with whatever else came)."""
        return self.batcher.submit(texts)

    def close(self) -> None:
        self.batcher.close()
        self.encoder.close()
        self._plain.close()
        if self._filtered is not None:
            self._filtered.close()


def make_app(service: SearchService, api_key: str | None = None):
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, Response
    from starlette.routing import Route
    from starlette.schemas import SchemaGenerator

    metrics = _metrics(service)

    gates = {filtered: asyncio.Semaphore(service.connections) for filtered in (False, True)}

    def error(status: int, message: str, openai: bool = False, headers: dict | None = None) -> JSONResponse:
        """One line; for the OpenAI route in OpenAI's shape (its clients read error.message)."""
        if openai:
            kind = "invalid_request_error" if status < 500 else "server_error"
            return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                                status_code=status, headers=headers)
        return JSONResponse({"error": message}, status_code=status, headers=headers)

    async def health(request: Request) -> JSONResponse:
        """
        summary: the served table and model
        responses:
          200: {description: "the served table, the model, its path (packed or generic), device and dimensions"}
        """
        info = service.describe()  # open without a key: the model's name, not where it lies on this machine
        return JSONResponse({**info, "model": info.get("name", info["model"])})

    async def params_of(request: Request) -> dict | JSONResponse:
        params = dict(request.query_params)
        given = [key for key, _ in request.query_params.multi_items()]
        twice = next((key for key in given if given.count(key) > 1), None)
        if twice:  # `?q=a&q=b`: which one was meant is not ours to pick
            return error(400, f"{twice}: given {given.count(twice)} times; give each parameter once")
        if request.method == "POST":
            body = await _body(request)
            if isinstance(body, Response):
                return body
            body = {} if body is None else body
            if not isinstance(body, dict):
                return error(400, "POST /search takes a JSON object: {\"q\": …, \"k\": …}")
            kinds = {"q": (str,), "where": (str,), "k": (int,), **{name: (bool,) for name in SWITCHES}}
            wrong = next((key for key, v in body.items() if v is not None and key in kinds and (
                not isinstance(v, kinds[key]) or key == "k" and isinstance(v, bool))), None)
            if wrong:
                want = {"q": "a string", "where": "a string", "k": "a whole number"}.get(wrong, "true or false")
                import orjson

                shown = orjson.dumps(body[wrong]).decode()  # as the client wrote it, not as Python would
                return error(400, f"{wrong}: {shown[:80]}{'…' if len(shown) > 80 else ''} is not {want}")
            both = next((key for key, v in body.items() if v is not None and key in params), None)
            if both:
                return error(400, f"{both}: given both in the URL and in the body; give it once")
            params.update({key: str(v).lower() if isinstance(v, bool) else str(v) for key, v in body.items()
                           if v is not None})
        unknown = sorted(set(params) - SEARCH_PARAMS)
        if unknown:  # a misspelt parameter (`hybird`) is said, not ignored
            return error(400, f"{unknown[0]}: not a parameter of /search ({', '.join(sorted(SEARCH_PARAMS))})")
        return params

    async def _body(request: Request, openai: bool = False):
        # read (and past the limit, drop) what the client sends, so that it hears the 413 rather than a reset
        parts, seen = [], 0
        async for part in request.stream():
            seen += len(part)
            if seen <= MAX_REQUEST_BYTES:
                parts.append(part)
            elif seen > 16 * MAX_REQUEST_BYTES:
                break
        if seen > MAX_REQUEST_BYTES:
            return error(413, f"the request is over {MAX_REQUEST_BYTES >> 20} MiB", openai)
        raw = b"".join(parts)
        if not raw.strip():
            return None  # no body: a POST with its parameters in the URL
        import orjson

        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            return error(400, f"the body is not JSON ({e})", openai)

    async def search(request: Request) -> Response:
        """
        summary: the k nearest rows to q (GET with query parameters, or POST the same as a JSON object)
        parameters:
          - {name: q, in: query, required: true, schema: {type: string}}
          - {name: k, in: query, schema: {type: integer, minimum: 1, maximum: 1000}}
          - {name: where, in: query, description: SQL filter (with --allow-where), schema: {type: string}}
          - {name: hybrid, in: query, description: fuse a full-text ranking, schema: {type: boolean}}
          - {name: rerank, in: query, description: reorder by the server's --rerank model, schema: {type: boolean}}
          - {name: group_by_parent, in: query, description: "the best passage of each of k records (--passages)",
             schema: {type: boolean}}
        responses:
          200: {description: "{results: [{id, distance, content, …}], scan}"}
          400: {description: a bad parameter or filter}
          503: {description: "the database did not answer (down, or the search ran past its statement timeout)"}
        """
        params = await params_of(request)
        if isinstance(params, Response):
            return params
        q = params.get("q", "")
        if not q.strip():
            return error(400, "give the query text: /search?q=…")
        if len(q) > MAX_INPUT_CHARS:
            return error(413, f"q is {len(q):,} characters: at most {MAX_INPUT_CHARS:,}")
        k = params.get("k")
        if k is not None and not (k.isascii() and k.isdigit() and 1 <= int(k) <= MAX_K):
            return error(400, f"k={k!r}: a whole number from 1 to {MAX_K}")
        where = params.get("where") or None
        if where and not service.allow_where:
            return error(400, "filters are off on this server: start `embedfleet serve` with --allow-where")
        switches = {name: params.get(name, "false").lower() for name in SWITCHES}
        for name, value in switches.items():
            if value not in ("true", "false", "1", "0"):
                more = " (the model is the server's --rerank)" if name == "rerank" else ""
                return error(400, f"{name}={value!r}: true or false{more}")
        on = {name: value in ("true", "1") for name, value in switches.items()}
        # a search waits for its pool's connection here, on the event loop: searches queued for the filter's
        # connections hold no thread that a search without a filter needs
        gate = gates[where is not None]
        acquiring = asyncio.ensure_future(gate.acquire())  # one place in the line, kept while its client polls
        while not acquiring.done():
            await asyncio.wait({acquiring}, timeout=DISCONNECT_POLL_S)
            if not acquiring.done() and await request.is_disconnected():
                acquiring.cancel()
                await asyncio.wait({acquiring})
                if not acquiring.cancelled():  # acquired as it was cancelled: handed back
                    gate.release()
                return Response(status_code=499)
        try:
            running = Running()
            task = asyncio.ensure_future(run_in_threadpool(service.search, q, int(k) if k else None, where, running,
                                                           on["hybrid"], on["rerank"], on["group_by_parent"]))
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    running.cancel()  # the server stops the statement; nobody waits for the answer
                    await asyncio.wait({task})
                    task.exception()  # heard (its statement cancelled): nothing to log for a client that left
                    return Response(status_code=499)
        finally:
            gate.release()
        try:
            results, scan = task.result()
        except InputError as e:
            return error(400, as_http(e))
        except DatabaseError as e:
            return error(503, str(e))
        except Exception as e:  # noqa: BLE001 - the server stays up; the client hears what failed
            log.exception("search failed")
            return error(500, f"{type(e).__name__}: {e}")
        return Response(_json({"results": results, "scan": scan}), media_type="application/json")

    async def embeddings(request: Request) -> Response:
        """
        summary: OpenAI-compatible embeddings of input (a string or a list of strings)
        requestBody:
          content:
            application/json:
              schema:
                type: object
                required: [input]
                properties:
                  input: {oneOf: [{type: string}, {type: array, items: {type: string}}]}
                  model: {type: string}
                  encoding_format: {type: string, enum: [float, base64]}
                  dimensions: {type: integer}
        responses:
          200: {description: "{object: list, data: [{object: embedding, index, embedding}], model, usage}"}
          400: {description: "a bad input, encoding_format or dimensions"}
          413: {description: "too many inputs, an input too long, or a body too large"}
        """
        body = await _body(request, openai=True)
        if isinstance(body, Response):
            return body
        if not isinstance(body, dict) or "input" not in body:
            return error(400, openai=True, message="give input: a string or a list of strings")
        texts = body["input"]
        texts = [texts] if isinstance(texts, str) else texts
        if not isinstance(texts, list) or not all(isinstance(t, (str, int, list)) for t in texts):
            return error(400, openai=True, message=f"input: a string or a list of strings, not {_json_type(texts)}")
        if not all(isinstance(t, str) for t in texts):
            # token ids are the client's tokenizer's (tiktoken's, for LangChain's OpenAIEmbeddings), not this model's
            return error(400, openai=True, message="input: a string or a list of strings; token arrays are not taken, "
                         "since their ids are another tokenizer's (LangChain: OpenAIEmbeddings("
                         "check_embedding_ctx_length=False) sends text)")
        if not texts:
            return error(400, openai=True, message="input is empty")
        if not all(t.strip() for t in texts):  # as OpenAI: an empty string has nothing to embed
            at = next(i for i, t in enumerate(texts) if not t.strip())
            return error(400, openai=True, message=f"input[{at}] is empty: give text to embed")
        if not isinstance(body.get("model", ""), str):
            return error(400, openai=True, message=f"model {body['model']!r}: a string (this server embeds with "
                                                    f"{service.encoder.describe()['name']}, whatever it names)")
        if len(texts) > MAX_INPUTS:
            return error(413, openai=True, message=f"{len(texts):,} inputs: at most {MAX_INPUTS:,} a request")
        if (at := next((i for i, t in enumerate(texts) if len(t) > MAX_INPUT_CHARS), None)) is not None:
            return error(413, openai=True, message=f"input[{at}] is {len(texts[at]):,} characters: at most "
                                                    f"{MAX_INPUT_CHARS:,} an input (a model reads only its first "
                                                    "tokens): split the text")
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            return error(400, openai=True, message=f"encoding_format {fmt!r}: float or base64")
        dims = body.get("dimensions")
        if dims is not None and not (isinstance(dims, int) and not isinstance(dims, bool) and 0 < dims <= service.encoder.dim):
            return error(400, openai=True, message=f"dimensions {json.dumps(dims)}: a whole number from 1 to "
                                                    f"{service.encoder.dim}")
        submitted = service.embed(texts)
        answer = asyncio.wrap_future(submitted)
        # a request of many texts listens for its client going away; one of a few is answered sooner than it is looked
        while len(texts) > WATCHED_TEXTS and not answer.done():
            await asyncio.wait({answer}, timeout=DISCONNECT_POLL_S)
            if not answer.done() and await request.is_disconnected():
                submitted.cancel()  # the batcher encodes it no further
                return Response(status_code=499)
        try:
            vectors, tokens = await answer
        except Exception as e:  # noqa: BLE001 - the server stays up; the client hears what failed
            log.exception("embeddings failed")
            return error(500, openai=True, message=f"{type(e).__name__}: {e}")
        if dims is not None and dims < vectors.shape[1]:  # Matryoshka: the first dims, normalised again
            vectors = vectors[:, :dims]
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        if metrics is not None:
            metrics.tokens.inc(tokens)
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64" else v.tolist()}
                for i, v in enumerate(vectors)]
        name = service.encoder.describe()["name"]
        return Response(_json({"object": "list", "data": data, "model": name,
                               "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}),
                        media_type="application/json")

    async def models(request: Request) -> Response:
        """
        summary: the one model this server embeds with, as OpenAI lists models
        responses:
          200: {description: "{object: list, data: [{id, object: model, created, owned_by}]}"}
        """
        name = service.encoder.describe()["name"]
        return Response(_json({"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                                           "owned_by": "embedfleet"}]}), media_type="application/json")

    async def metrics_text(request: Request) -> Response:
        """
        summary: Prometheus metrics (requests, latency, queue depth, tokens)
        responses:
          200: {description: Prometheus text}
        """
        if metrics is None:
            return error(501, "metrics need prometheus-client: pip install 'embedfleet[metrics]'")
        return Response(metrics.text(), media_type="text/plain; version=0.0.4")

    schemas = SchemaGenerator({"openapi": "3.0.0", "info": {"title": "embedfleet serve", "version": "1"}})

    async def openapi(request: Request) -> Response:
        return JSONResponse(_described(schemas.get_schema(routes=request.app.routes), api_key is not None))

    async def docs(request: Request) -> HTMLResponse:
        return HTMLResponse(DOCS_PAGE)

    async def not_found(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error(404, f"no {request.url.path}: GET /search?q=…, POST /v1/embeddings, GET /v1/models, "
                         "GET /openapi.json, GET /docs")
        return error(exc.status_code, exc.detail, openai=request.url.path.startswith("/v1/"), headers=exc.headers)

    class Guard:
        """The API key on every route but /health, and each request counted and timed: plain ASGI, so that a
        route still hears its client go away."""

        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.app(scope, receive, send)
            t0, route = time.perf_counter(), scope["path"] if scope["path"] in ROUTES else "other"
            if api_key and route != "/health":
                scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
                # the scheme's name is case-insensitive (RFC 9110); the key is compared in constant time
                if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), api_key.encode()):
                    refused = error(401, "give the server's API key: Authorization: Bearer KEY",
                                    route == "/v1/embeddings", headers={"WWW-Authenticate": "Bearer"})
                    await refused(scope, receive, send)
                    _observe(metrics, route, 401, t0)
                    return
            status = [500]

            async def sent(message):
                if message["type"] == "http.response.start":
                    status[0] = message["status"]
                await send(message)

            await self.app(scope, receive, sent)
            _observe(metrics, route, status[0], t0)

    routes = [Route("/search", search, methods=["GET", "POST"]), Route("/v1/embeddings", embeddings, methods=["POST"]),
              Route("/v1/models", models),
              Route("/health", health), Route("/metrics", metrics_text),
              Route("/openapi.json", openapi, include_in_schema=False), Route("/docs", docs, include_in_schema=False)]
    return Starlette(routes=routes, exception_handlers={HTTPException: not_found}, middleware=[Middleware(Guard)])


ROUTES = ("/search", "/v1/embeddings", "/v1/models", "/health", "/metrics", "/openapi.json", "/docs")

# /openapi.json read by Swagger UI (its files from a CDN, as FastAPI's /docs has them)
DOCS_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>embedfleet serve</title>
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css"></head>
<body><div id="ui"></div>
<script src="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({url: "/openapi.json", dom_id: "#ui"});</script>
</body></html>
"""

def _json_type(value) -> str:
    """How JSON names `value`'s type, with an article: what a request sent where another was wanted."""
    if value is None:
        return "null"
    if isinstance(value, list):  # a list holding something that is neither text nor a token id
        return f"a list holding {_json_type(next(v for v in value if not isinstance(v, (str, int, list))))}"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", dict: "an object"}.get(
        type(value), type(value).__name__)


def _described(schema: dict, keyed: bool) -> dict:
    """Starlette's schema from the routes' docstrings, completed: POST /search takes its parameters as a JSON
    body, and with an API key every route but /health names the bearer scheme and its 401."""
    search = schema.get("paths", {}).get("/search", {})
    if "post" in search:
        post = search["post"]
        props = {p["name"]: {**p["schema"], **({"description": p["description"]} if "description" in p else {})}
                 for p in post.pop("parameters", [])}
        post["requestBody"] = {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "required": ["q"], "properties": props}}}}
    if keyed:
        schema.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, operations in schema.get("paths", {}).items():
            for operation in operations.values() if path != "/health" else ():
                operation["security"] = [{"bearer": []}]
                operation.setdefault("responses", {})[401] = {"description": "no API key, or a wrong one"}
    return schema


def _metrics(service) -> Metrics | None:
    try:
        return Metrics(lambda: float(service.batcher.waiting))
    except ImportError:
        return None


def _observe(metrics: Metrics | None, route: str, status: int, t0: float) -> None:
    if metrics is not None:
        metrics.requests.labels(route, str(status)).inc()
        metrics.latency.labels(route).observe(time.perf_counter() - t0)


def _json(doc) -> bytes:
    import orjson

    return orjson.dumps(doc, default=str)


def _check_host(host: str) -> None:
    """`host` is an address, or a name this machine resolves: one line otherwise, before anything is asked of it."""
    try:
        if not host.strip():
            raise socket.gaierror("empty")
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise InputError(f"--host {host!r}: not an address or a name this machine resolves; give an address of "
                         "this machine as --host (127.0.0.1, ::1, 0.0.0.0 for all)") from None


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        # a port in use or reserved is the port's; a name that resolves to nothing, or an address not on this
        # machine, is the host's
        fix = "pick another --port" if e.errno in (errno.EADDRINUSE, errno.EACCES) else \
            "give an address of this machine as --host (127.0.0.1, ::1, 0.0.0.0 for all)"
        raise InputError(f"cannot listen on {host}:{port} ({e.strerror}); {fix}") from None
    return sock


def serve(dsn: str, table: str, host: str = "127.0.0.1", port: int = 8000, k: int = 10,
          model: str | None = None, device: str = "auto", where_dsn: str | None = None,
          statement_timeout: float = 5.0, settings=None, trust_remote_code: bool = False,
          api_key: str | None = None, rerank: str | None = None) -> None:
    """Serve until interrupted (SIGINT or SIGTERM); prints the URL (to stderr) once it listens."""
    import uvicorn

    if not 1 <= k <= MAX_K:
        raise InputError(f"-k {k}: a whole number from 1 to {MAX_K} (what a request without its own k gets)")
    if api_key is not None and (not api_key.strip() or api_key != api_key.strip()):
        raise InputError("--api-key: give a key without blanks at its ends (an empty or blank one protects nothing, "
                         "and a client's header drops the spaces)")
    _check_host(host)
    if not _loopback(host) and not api_key:
        raise InputError(f"--host {host} listens beyond this machine: give --api-key KEY (or EMBEDFLEET_API_KEY) so "
                         "that every request needs it")
    sock = _listen(host, port)  # bound before the model loads: a port in use is said at once
    try:
        service = SearchService(dsn, table, k=k, model=model, device=device, where_dsn=where_dsn,
                                statement_timeout=statement_timeout, settings=settings,
                                trust_remote_code=trust_remote_code, rerank=rerank)
    except BaseException:
        sock.close()
        raise
    try:
        sock.listen(128)  # once it can answer; connections wait in the backlog until accepted: none refused
        bound_host, bound_port = sock.getsockname()[:2]
        info = service.describe()
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host  # an IPv6 address, as a URL writes it
        print(f"serving table {table!r} on http://{shown}:{bound_port}/search?q=… and /v1/embeddings "
              f"({info['name']}, {info['path']} on {info['device']}; filters "
              f"{'on, as a read-only role' if where_dsn else 'off'}; API key {'on' if api_key else 'off'})",
              file=sys.stderr, flush=True)
        server = uvicorn.Server(uvicorn.Config(make_app(service, api_key), log_level="warning", lifespan="off",
                                               access_log=False))
        server.run(sockets=[sock])
        print("stopped", file=sys.stderr)
    finally:
        sock.close()
        service.close()
