"""`embedfleet serve`: nearest-row search over HTTP, the model loaded once (Starlette on uvicorn).

    GET /search?q=TEXT[&k=N][&where=SQL]  ->  {"results": [{"id", "distance", "content", …}], "scan"}
    GET /health                           ->  {"table", "model", "path", "device", "dim"}

The same results as `embedfleet search --json` (the same query encoder, the same SQL). Every request's
statement runs under `--statement-timeout`, and is cancelled on the server when its client goes away.
`where` is a stranger's SQL: it is refused unless `--allow-where`, and then it runs as a role that reads the
served table and nothing else (store/roles.py), in a READ ONLY transaction. It listens on 127.0.0.1 unless
--host says otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import socket
import sys
import threading
from typing import Callable

from embedfleet.errors import DatabaseError, EmbedfleetError, InputError

__all__ = ["SearchService", "make_app", "serve"]

log = logging.getLogger(__name__)

MAX_K = 1000
CONNECTIONS = 4  # database connections kept for searches, per pool (requests beyond wait for one)
DISCONNECT_POLL_S = 0.05  # how often a request's client is checked while its search runs


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
                 settings=None, trust_remote_code: bool = False):
        from embedfleet.pg.connect import connect
        from embedfleet.query.search import Searcher, query_encoder

        self.table, self.k, self.allow_where = table, k, where_dsn is not None
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
        self._encode_lock = threading.Lock()  # the query encoder: one query at a time

    def describe(self) -> dict:
        return {"table": self.table, **self.encoder.describe()}

    def search(self, q: str, k: int | None = None, where: str | None = None,
               running: Running | None = None, hybrid: bool = False) -> tuple[list[dict], str]:
        """(the top-k rows, how they were found). `running` lets another thread cancel the statement. `hybrid`:
        the full-text ranking of `q` fused with the vector ranking (Searcher.hybrid)."""
        if where and self._filtered is None:
            raise InputError("filters are off on this server: start `embedfleet serve` with --allow-where")
        with self._encode_lock:
            vec = self.encoder.encode([q])[0]
        pool = self._filtered if where else self._plain
        searcher = pool.take()
        healthy = False
        try:
            if running is not None:
                running.attach(searcher.conn)
            results = searcher.search(vec, k or self.k, where, text=q if hybrid else None)
            healthy = True
            return results, searcher.scan
        except EmbedfleetError:  # the user's input (a bad where): the connection rolled back, still good
            healthy = not searcher.conn.broken
            if where and not healthy:
                raise InputError(f"--where {where!r} ended its own database connection") from None
            raise
        except Exception as e:
            import psycopg

            if where and isinstance(e, psycopg.Error) and searcher.conn.broken:
                raise InputError(f"--where {where!r} ended its own database connection") from None
            raise
        finally:
            pool.give(searcher, healthy)

    def close(self) -> None:
        self.encoder.close()
        self._plain.close()
        if self._filtered is not None:
            self._filtered.close()


def make_app(service: SearchService):
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status)

    async def health(request: Request) -> JSONResponse:
        return JSONResponse(service.describe())

    async def search(request: Request) -> Response:
        params = request.query_params
        q = params.get("q", "")
        if not q.strip():
            return error(400, "give the query text: /search?q=…")
        k = params.get("k")
        if k is not None and not (k.isdigit() and 1 <= int(k) <= MAX_K):
            return error(400, f"k={k!r}: a whole number from 1 to {MAX_K}")
        where = params.get("where") or None
        if where and not service.allow_where:
            return error(400, "filters are off on this server: start `embedfleet serve` with --allow-where")
        hybrid = params.get("hybrid", "false").lower()
        if hybrid not in ("true", "false", "1", "0"):
            return error(400, f"hybrid={hybrid!r}: true or false")
        running = Running()
        task = asyncio.ensure_future(run_in_threadpool(service.search, q, int(k) if k else None, where, running,
                                                       hybrid in ("true", "1")))
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                running.cancel()  # the server stops the statement; nobody waits for the answer
                await asyncio.wait({task})
                return Response(status_code=499)
        try:
            results, scan = task.result()
        except InputError as e:
            return error(400, str(e))
        except DatabaseError as e:
            return error(503, str(e))
        except Exception as e:  # noqa: BLE001 - the server stays up; the client hears what failed
            log.exception("search failed")
            return error(500, f"{type(e).__name__}: {e}")
        return Response(_json({"results": results, "scan": scan}), media_type="application/json")

    async def not_found(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error(404, f"no {request.url.path}: GET /search?q=…&k=…&where=…")
        return error(exc.status_code, exc.detail)

    return Starlette(routes=[Route("/search", search), Route("/health", health)],
                     exception_handlers={HTTPException: not_found})


def _json(doc) -> bytes:
    import orjson

    return orjson.dumps(doc, default=str)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise InputError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port") from None
    sock.listen(128)  # connections wait in the backlog until the server accepts them: none is refused
    return sock


def serve(dsn: str, table: str, host: str = "127.0.0.1", port: int = 8000, k: int = 10,
          model: str | None = None, device: str = "auto", where_dsn: str | None = None,
          statement_timeout: float = 5.0, settings=None, trust_remote_code: bool = False) -> None:
    """Serve until interrupted (SIGINT or SIGTERM); prints the URL (to stderr) once it listens."""
    import uvicorn

    service = SearchService(dsn, table, k=k, model=model, device=device, where_dsn=where_dsn,
                            statement_timeout=statement_timeout, settings=settings, trust_remote_code=trust_remote_code)
    try:
        sock = _listen(host, port)
        bound_host, bound_port = sock.getsockname()[:2]
        info = service.describe()
        print(f"serving table {table!r} on http://{bound_host}:{bound_port}/search?q=… "
              f"({info['name']}, {info['path']} on {info['device']}; filters "
              f"{'on, as a read-only role' if where_dsn else 'off'})", file=sys.stderr, flush=True)
        server = uvicorn.Server(uvicorn.Config(make_app(service), log_level="warning", lifespan="off",
                                               access_log=False))
        server.run(sockets=[sock])
        print("stopped", file=sys.stderr)
    finally:
        service.close()
