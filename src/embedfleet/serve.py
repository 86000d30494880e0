"""`embedfleet serve`: nearest-row search over HTTP, the model loaded once.

    GET /search?q=TEXT[&k=N][&where=SQL]  ->  {"results": [{"id", "distance", "content", …}]}
    GET /health                           ->  {"table", "model", "path", "device", "dim"}

The same results as `embedfleet search --json` (the same query encoder, the same SQL), and the same
rule for `where`: the user's SQL runs in a READ ONLY transaction, so a filter that would write is
refused (400, one line saying why). It listens on 127.0.0.1 unless --host says otherwise: anyone who
can reach it can run read-only SQL on the table's database. The standard library's threading HTTP
server: a thread per connection, queries embedded one at a time (a MiniLM query takes milliseconds),
database searches on a small pool of connections.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import orjson

from embedfleet.errors import EmbedfleetError, InputError

__all__ = ["SearchService", "make_server", "serve"]

log = logging.getLogger(__name__)

MAX_K = 1000
CONNECTIONS = 4  # database connections kept for searches (requests beyond wait for one)


def _pick_device(device: str) -> str:
    """"auto": a GPU where there is one (a long-lived process pays CUDA's start-up once), else the CPU."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class SearchService:
    """One table's searches: the query encoder, and a pool of connections each with its Searcher."""

    def __init__(self, dsn: str, table: str, k: int = 10, model: str | None = None, device: str = "auto",
                 connections: int = CONNECTIONS):
        from embedfleet.store.ledger import connect
        from embedfleet.store.search import Searcher, query_encoder

        self.dsn, self.table, self.k = dsn, table, k
        self._connect, self._searcher = connect, Searcher
        first = connect(dsn)
        try:
            self.encoder = query_encoder(first, table, model, _pick_device(device))
            searcher = Searcher(first, table)
        except BaseException:
            first.close()
            raise
        self._idle: queue.LifoQueue = queue.LifoQueue()
        self._idle.put(searcher)
        self._open, self._limit = 1, max(1, connections)
        self._lock = threading.Lock()  # the query encoder: one query at a time
        self._pool_lock = threading.Lock()

    def describe(self) -> dict:
        return {"table": self.table, **self.encoder.describe()}

    def _take(self):
        with self._pool_lock:
            grow = self._idle.empty() and self._open < self._limit
            if grow:
                self._open += 1
        if grow:
            try:
                return self._searcher(self._connect(self.dsn), self.table)
            except BaseException:
                with self._pool_lock:
                    self._open -= 1
                raise
        return self._idle.get()

    def search(self, q: str, k: int | None = None, where: str | None = None) -> list[dict]:
        with self._lock:
            vec = self.encoder.encode([q])[0]
        searcher = self._take()
        try:
            return searcher.search(vec, k or self.k, where)
        except EmbedfleetError:  # the user's input (a bad where): the connection rolled back, still good
            raise
        except Exception:  # a connection in an unknown state: do not give it back
            searcher.conn.close()
            with self._pool_lock:
                self._open -= 1
            raise
        finally:
            if not searcher.conn.closed:
                self._idle.put(searcher)

    def close(self) -> None:
        self.encoder.close()
        while not self._idle.empty():
            self._idle.get().conn.close()


def _handler(service: SearchService):
    class Handler(BaseHTTPRequestHandler):
        server_version = "embedfleet"

        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            url = urlsplit(self.path)
            if url.path == "/health":
                return self._send(200, service.describe())
            if url.path != "/search":
                return self._send(404, {"error": f"no {url.path}: GET /search?q=…&k=…&where=…"})
            params = parse_qs(url.query, keep_blank_values=True)
            q = params.get("q", [""])[0]
            if not q.strip():
                return self._send(400, {"error": "give the query text: /search?q=…"})
            k = params.get("k", [None])[0]
            if k is not None and not (k.isdigit() and 1 <= int(k) <= MAX_K):
                return self._send(400, {"error": f"k={k!r}: a whole number from 1 to {MAX_K}"})
            where = params.get("where", [None])[0] or None
            try:
                results = service.search(q, int(k) if k else None, where)
            except InputError as e:
                return self._send(400, {"error": str(e)})
            except EmbedfleetError as e:
                return self._send(500, {"error": str(e)})
            except Exception as e:  # noqa: BLE001 - the server stays up; the client hears what failed
                log.exception("search failed")
                return self._send(500, {"error": f"{type(e).__name__}: {e}"})
            self._send(200, {"results": results})

        def _send(self, status: int, doc: dict) -> None:
            body = orjson.dumps(doc, default=str)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args) -> None:
            log.debug("%s %s", self.address_string(), fmt % args)

    return Handler


def make_server(service: SearchService, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), _handler(service))
    server.daemon_threads = True
    return server


def serve(dsn: str, table: str, host: str = "127.0.0.1", port: int = 8000, k: int = 10,
          model: str | None = None, device: str = "auto") -> None:
    """Serve until interrupted; prints the URL (to stderr) once it answers."""
    service = SearchService(dsn, table, k=k, model=model, device=device)
    try:
        try:
            server = make_server(service, host, port)
        except OSError as e:
            raise InputError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port") from None
        bound_host, bound_port = server.server_address[:2]
        info = service.describe()
        print(f"serving table {table!r} on http://{bound_host}:{bound_port}/search?q=… "
              f"({info['name']}, {info['path']} on {info['device']})", file=sys.stderr, flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            print("stopped", file=sys.stderr)
        finally:
            server.server_close()
    finally:
        service.close()
