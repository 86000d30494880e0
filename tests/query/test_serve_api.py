"""`serve` as a service: the official `openai` client against /v1/embeddings (the same vectors as Encoder.encode,
base64 and float, dimensions), concurrent requests batched, the API key (401), limits (413), /search by GET and
POST with hybrid, /metrics as Prometheus text, /openapi.json, and no listening beyond loopback without a key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

from conftest import one_line_error

KEY = "s3cret-key"
TEXTS = ["battery dies after a week", "the case fits well", "naïve café in Straße 東京 🙂",
         "a much longer review about the charger and the cable " * 8]


@pytest.fixture(scope="module")
def server(pg_server, tmp_path_factory):
    import psycopg

    root = tmp_path_factory.mktemp("serve-api")
    name = "t_serveapi"
    with psycopg.connect(pg_server.get_uri(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    dsn = pg_server.get_uri(database=name)
    env = dict(os.environ, EMBEDFLEET_HOME=str(root / "home"), PYTHONUNBUFFERED="1")
    env.pop("EMBEDFLEET_DB", None)
    env.pop("EMBEDFLEET_API_KEY", None)
    src = root / "docs.jsonl"
    src.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in
                           enumerate(TEXTS + [f"review {i} of a phone part, code QZ{i}" for i in range(30)])))
    subprocess.run([sys.executable, "-m", "embedfleet.cli", "ingest", str(src), "--db", dsn, "--devices", "cpu",
                    "--quiet", "--id-field", "id", "--table", "docs", "--fts"], env=env, check=True,
                   capture_output=True, timeout=600)
    proc = subprocess.Popen([sys.executable, "-m", "embedfleet.cli", "serve", "--table", "docs", "--db", dsn, "--port",
                             "0", "--device", "cpu", "--api-key", KEY], env=env, stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline()
    assert "serving" in line, line + proc.stderr.read() if proc.poll() is not None else line
    base = line.split("http://")[1].split("/search")[0]
    yield {"base": f"http://{base}", "dsn": dsn, "env": env}
    proc.terminate()
    proc.wait(timeout=30)


def _call(url: str, body: bytes | None = None, key: str | None = KEY, method: str | None = None):
    req = urllib.request.Request(url, data=body, method=method or ("POST" if body is not None else "GET"))
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    if body is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_the_openai_client_gets_the_encoders_vectors(server):
    import openai

    from embedfleet.encode.encoder import Encoder

    want = Encoder(device="cpu").encode(TEXTS)
    client = openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEY)
    got = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS)  # the client asks for base64
    vectors = np.asarray([d.embedding for d in got.data], np.float32)
    assert [d.index for d in got.data] == list(range(len(TEXTS))) and got.usage.prompt_tokens > len(TEXTS)
    assert np.min(np.sum(vectors * want, axis=1)) >= 0.9999
    one = client.embeddings.create(model="x", input=TEXTS[0], encoding_format="float", dimensions=128)
    v = np.asarray(one.data[0].embedding, np.float32)
    cut = want[0][:128] / np.linalg.norm(want[0][:128])
    assert v.shape == (128,) and float(v @ cut) >= 0.9999
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server["base"] + "/v1", api_key="wrong", max_retries=0).embeddings.create(
            model="x", input="hi")
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="x", input="hi", dimensions=4096)


def test_concurrent_requests_come_back_each_with_its_own_vectors(server):
    import openai

    client = openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEY)
    alone = {t: np.asarray(client.embeddings.create(model="x", input=t).data[0].embedding) for t in TEXTS}
    out: dict = {}

    def ask(i: int) -> None:
        t = TEXTS[i % len(TEXTS)]
        out[i] = (t, np.asarray(client.embeddings.create(model="x", input=[t]).data[0].embedding))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(out) == 16 and all(float(v @ alone[t]) >= 0.9999 for t, v in out.values())


def test_keys_limits_search_metrics_and_schema(server):
    base = server["base"]
    status, body = _call(base + "/health", key=None)  # the one open route: no path of this machine in it
    assert status == 200 and not json.loads(body)["model"].startswith("/")
    for path in ("/search?q=battery", "/metrics", "/openapi.json"):
        status, body = _call(base + path, key=None)
        assert status == 401 and "API key" in json.loads(body)["error"]
    status, body = _call(base + "/v1/embeddings", json.dumps({"input": ["x"] * 3000}).encode())
    assert status == 413 and "2,048" in json.loads(body)["error"]["message"]
    status, _ = _call(base + "/v1/embeddings", b'{"input": "' + b"x" * (5 << 20) + b'"}')
    assert status == 413
    status, body = _call(base + "/v1/embeddings", json.dumps({"input": ["ok", "word " * 400_000]}).encode())
    assert status == 413 and json.loads(body)["error"]["message"].startswith("input[1] is 2,000,000 characters")
    status, body = _call(base + "/v1/embeddings", b"not json")
    assert status == 400
    status, body = _call(base + "/search?q=battery+dies&k=3")
    assert status == 200 and len(json.loads(body)["results"]) == 3
    status, body = _call(base + "/search", json.dumps({"q": "QZ7", "k": 2, "hybrid": True}).encode())
    doc = json.loads(body)
    assert status == 200 and doc["results"][0]["id"] == "d11" and "score" in doc["results"][0]  # "QZ7" is row d11
    status, body = _call(base + "/search?q=x&where=true")
    assert status == 400 and "--allow-where" in json.loads(body)["error"]
    status, body = _call(base + "/metrics")
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert {"embedfleet_requests", "embedfleet_request_seconds", "embedfleet_tokens", "embedfleet_queue_depth"} <= set(
        families)
    statuses = {(s.labels["route"], s.labels["status"]) for s in families["embedfleet_requests"].samples}
    assert ("/v1/embeddings", "413") in statuses and ("/search", "401") in statuses
    assert _call(base + "/v1/models")[0] == 200
    families = {f.name: f for f in text_string_to_metric_families(_call(base + "/metrics")[1].decode())}
    assert ("/v1/models", "200") in {(s.labels["route"], s.labels["status"]) for s in families["embedfleet_requests"].samples}
    status, body = _call(base + "/openapi.json")
    schema = json.loads(body)
    assert status == 200 and {"/search", "/v1/embeddings", "/health"} <= set(schema["paths"])
    from openapi_spec_validator import validate

    validate(schema)  # a valid OpenAPI 3 document
    for path, operations in schema["paths"].items():
        for method, op in operations.items():
            for code, answer in op["responses"].items():  # OpenAPI's response object: a description (and content)
                assert isinstance(answer["description"], str) and set(answer) <= {"description", "content"}, (
                    path, method, code, answer)
            assert (op.get("security") == [{"bearer": []}] and "401" in op["responses"]) is (path != "/health")
    post = schema["paths"]["/search"]["post"]
    body_schema = post["requestBody"]["content"]["application/json"]["schema"]
    assert "parameters" not in post and body_schema["required"] == ["q"]
    assert {"q", "k", "where", "hybrid", "rerank", "group_by_parent"} == set(body_schema["properties"])
    assert schema["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    status, page = _call(base + "/docs")  # Swagger UI over the same document
    assert status == 200 and b'url: "/openapi.json"' in page
    assert _call(base + "/docs", key=None)[0] == 401


def test_loopback_is_127_0_0_0_8_and_1_and_localhost_only():
    from embedfleet.query.serve import _loopback

    assert all(map(_loopback, ("127.0.0.1", "127.0.0.5", "::1", "localhost")))
    assert not any(map(_loopback, ("0.0.0.0", "::", "192.168.1.1", "10.0.0.1", "example.com", "127.0.0.1.example.com")))


def test_bodies_of_the_wrong_type_a_lower_case_scheme_and_a_huge_hybrid_query(server):
    base = server["base"]
    for body in ({"q": ["a", "b"]}, {"q": 123}, {"q": "x", "k": "3"}, {"q": "x", "k": True}, {"q": "x", "hybrid": "yes"}):
        status, answer = _call(base + "/search", json.dumps(body).encode())
        assert status == 400 and "is not" in json.loads(answer)["error"], (body, answer)
        assert "True" not in answer.decode() and "['a'" not in answer.decode()  # JSON's spelling, not Python's
    status, answer = _call(base + "/v1/embeddings", json.dumps({"input": "hi", "dimensions": True}).encode())
    assert status == 400 and "dimensions true:" in json.loads(answer)["error"]["message"]  # JSON's spelling
    for sent, says in (("null", "not null"), ('{"a": 1}', "not an object"), ('[null]', "not a list holding null")):
        status, answer = _call(base + "/v1/embeddings", f'{{"input": {sent}}}'.encode())
        message = json.loads(answer)["error"]["message"]
        assert status == 400 and says in message and "token" not in message, (sent, message)
    for k in ("%C2%B2", "%E2%91%A0"):  # "²" and "①": digits to str.isdigit, not to int() (was a 500)
        status, answer = _call(base + f"/search?q=a&k={k}")
        assert status == 400 and "a whole number" in json.loads(answer)["error"], answer
    for body, says in (({"input": ""}, "input[0] is empty"), ({"input": ["a", " "]}, "input[1] is empty"),
                       ({"input": "hi", "model": 5}, "model 5")):
        status, answer = _call(base + "/v1/embeddings", json.dumps(body).encode())
        err = json.loads(answer)["error"]
        assert status == 400 and says in err["message"] and err["type"] == "invalid_request_error", (body, answer)
    status, answer = _call(base + "/v1/embeddings", json.dumps({"input": [[101, 2054, 102]]}).encode())
    assert status == 400 and "check_embedding_ctx_length=False" in json.loads(answer)["error"]["message"]
    req = urllib.request.Request(base + "/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as wrong:  # a GET: in OpenAI's shape too, naming what is allowed
        urllib.request.urlopen(req, timeout=60)
    assert wrong.value.code == 405 and json.loads(wrong.value.read())["error"]["type"] == "invalid_request_error"
    assert wrong.value.headers["Allow"] == "POST"
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="is empty"):
        client.embeddings.create(model="m", input="")
    assert [m.id for m in client.models.list()] == ["sentence-transformers/all-MiniLM-L6-v2"]  # the one it embeds with
    for bad in ("/search?q=battery&hybird=true", "/search?q=battery&K=3"):  # a misspelt parameter is said
        status, answer = _call(base + bad)
        assert status == 400 and "not a parameter of /search" in json.loads(answer)["error"], answer
    status, answer = _call(base + "/search", json.dumps({"q": "battery", "top_k": 3}).encode())
    assert status == 400 and "top_k" in json.loads(answer)["error"]
    req = urllib.request.Request(base + "/search?q=battery&k=1", headers={"Authorization": f"bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=60) as r:  # the scheme's name in any case
        assert r.status == 200
    for header in (f"Bearer {KEY}x", f"Basic {KEY}", KEY):
        req = urllib.request.Request(base + "/search?q=battery", headers={"Authorization": header})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=60)
        assert refused.value.code == 401 and refused.value.headers["WWW-Authenticate"] == "Bearer"
    status, answer = _call(base + "/search", json.dumps({"q": "w " * 32000, "k": 1, "hybrid": True}).encode())
    assert status == 400 and "shorten the query" in json.loads(answer)["error"]
    status, answer = _call(base + "/search", json.dumps({"q": "word " * 20000, "k": 1}).encode())
    assert status == 413 and "at most 65,536" in json.loads(answer)["error"]  # as an embedding's input
    status, answer = _call(base + "/search", json.dumps({"q": "a\x00b", "k": 1, "hybrid": True}).encode())
    assert status == 400 and "NUL character" in json.loads(answer)["error"], answer  # was a 500


def test_a_default_k_out_of_range_is_refused_at_start(server, cli):
    for k in ("0", "5000"):
        one_line_error(cli("serve", "--table", "docs", "--db", server["dsn"], "--port", "0", "--device", "cpu",
                           "-k", k), f"-k {k}: a whole number from 1 to")


def test_a_host_that_is_not_this_machines_is_said_to_be_the_hosts_fault(server, cli):
    """The advice was "pick another --port" whatever failed."""
    for host in ("nosuchhost.invalid", "192.0.2.1"):  # no such name; an address (TEST-NET-1) not on this machine
        one_line_error(cli("serve", "--table", "docs", "--db", server["dsn"], "--port", "0", "--device", "cpu",
                           "--host", host, "--api-key", "k"), "give an address of this machine as --host")


def test_a_host_that_is_no_address_is_said_to_be_one_and_a_port_in_use_is_said_before_the_model_loads(server, cli):
    """--host 999.1.1.1 was told to give --api-key; a port in use was said only once the model had loaded."""
    import socket

    for host in ("999.1.1.1", ""):
        one_line_error(cli("serve", "--table", "docs", "--db", server["dsn"], "--port", "0", "--device", "cpu",
                           "--host", host), "not an address or a name this machine resolves")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = str(held.getsockname()[1])
        one_line_error(cli("serve", "--table", "docs", "--db", server["dsn"], "--port", port, "--device", "cpu",
                           "--model", "/nonexistent/model"), "pick another --port")


def test_a_port_out_of_range_is_a_usage_error(server, cli):
    for port in ("99999", "-1"):
        p = cli("serve", "--table", "docs", "--db", server["dsn"], "--port", port, "--device", "cpu")
        assert p.returncode == 2 and "Invalid value for '--port'" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_listening_beyond_loopback_wants_a_key(server, cli):
    one_line_error(cli("serve", "--table", "docs", "--db", server["dsn"], "--host", "0.0.0.0", "--port", "0",
                       "--device", "cpu"), "--api-key")
    for key in ("", " ", " key"):  # a blank key protected nothing, on any address (an unset $KEY is "")
        one_line_error(cli("serve", "--table", "docs", "--db", server["dsn"], "--host", "::", "--port", "0",
                           "--device", "cpu", "--api-key", key), "--api-key: give a key without blanks")


def test_a_search_waits_for_one_slice_of_a_long_embedding_request_not_all_of_it(server):
    import re
    import time

    texts = [f"review {i}: the charger and the cable broke after {i % 97} days, naïve café Straße {i}" for i in
             range(2048)]
    embedded: list = []
    finished = threading.Event()

    def embed():
        embedded.append(_call(server["base"] + "/v1/embeddings", json.dumps({"input": texts}).encode()))
        finished.set()

    t = threading.Thread(target=embed)
    t.start()
    deadline = time.monotonic() + 60
    while not finished.is_set() and time.monotonic() < deadline:  # until the request is being encoded
        metrics = _call(server["base"] + "/metrics")[1].decode()
        if re.search(r"^embedfleet_queue_depth 1\.0$", metrics, re.M):
            break
        time.sleep(0.01)
    assert not finished.is_set(), "the request was encoded before the search could start: give it more texts"
    status, body = _call(server["base"] + "/search?q=a%20broken%20charger&k=3")
    assert status == 200 and len(json.loads(body)["results"]) == 3
    # the search came back between two slices of the request: it is still being encoded
    assert re.search(r"^embedfleet_queue_depth 1\.0$", _call(server["base"] + "/metrics")[1].decode(), re.M)
    t.join(120)
    assert embedded[0][0] == 200 and len(json.loads(embedded[0][1])["data"]) == len(texts)


def test_the_encoder_is_taken_in_turn_in_the_order_it_was_asked_for():
    import time

    from embedfleet.query.serve import Turns

    turns, order, threads = Turns(), [], []

    def call(i: int) -> None:
        with turns.turn():
            order.append(i)

    with turns.turn():  # held: every caller queues
        for i in range(8):
            threads.append(threading.Thread(target=call, args=(i,)))
            threads[-1].start()
            deadline = time.monotonic() + 10
            while len(turns._waiting) < i + 1 and time.monotonic() < deadline:
                time.sleep(0.001)
        assert order == []
    for t in threads:
        t.join(10)
    assert order == list(range(8))
    with turns.turn():  # free again: taken at once
        pass


def test_requests_that_queue_while_a_batch_runs_are_encoded_together_each_getting_its_own_rows():
    from embedfleet.query.serve import Batcher, Turns

    calls, started, release = [], threading.Event(), threading.Event()

    def encode(texts):
        calls.append(list(texts))
        if len(calls) == 1:  # the first batch holds the device until the others have queued
            started.set()
            release.wait(10)
        return np.array([[float(ord(t[0]))] for t in texts]), np.array([len(t) for t in texts])

    batcher = Batcher(encode, Turns())
    first = batcher.submit(["a"])
    assert started.wait(10)
    rest = [batcher.submit(texts) for texts in (["bb"], ["c", "ddd"], ["e"])]
    release.set()
    got = [f.result(10) for f in (first, *rest)]
    batcher.close()
    assert calls == [["a"], ["bb", "e", "c", "ddd"]]  # a lone request went alone; the queued ones as one batch,
    # the shortest first
    assert [v[:, 0].tolist() for v, _ in got] == [[97.0], [98.0], [99.0, 100.0], [101.0]]
    assert [tokens for _, tokens in got] == [1, 2, 4, 1]


def test_a_request_whose_client_left_is_encoded_no_further_and_a_short_one_is_answered_at_its_first_slice():
    """Three abandoned requests of 2,000 texts each kept a one-text request waiting 24 s, and a short request
    batched with a long one waited for all of it."""
    import time

    from embedfleet.query.serve import Batcher, Turns

    calls, short_done, started, release = [], [], threading.Event(), threading.Event()
    futures: dict = {}

    def encode(texts):
        calls.append(list(texts))
        if len(calls) == 1:  # holds the device until the others have queued
            started.set()
            release.wait(10)
        else:
            short_done.append(futures["short"].done())
            if len(calls) == 3:  # the long request's client goes away during its second slice
                futures["long"].cancel()
        return np.array([[float(len(t))] for t in texts]), np.ones(len(texts), dtype=int)

    batcher = Batcher(encode, Turns(), slice_texts=4)
    first = batcher.submit(["x"])
    assert started.wait(10)
    futures["long"] = batcher.submit([f"long {i}" for i in range(40)])
    futures["short"] = batcher.submit(["s"])
    gone = batcher.submit([f"gone {i}" for i in range(40)])
    assert gone.cancel()  # its client left while it queued
    release.set()
    vectors, tokens = futures["short"].result(10)
    assert vectors.tolist() == [[1.0]] and tokens == 1 and first.result(10)[1] == 1
    deadline = time.monotonic() + 10
    while batcher.waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    batcher.close()
    assert batcher.waiting == 0 and futures["long"].cancelled()
    assert calls[1] == ["s", "long 0", "long 1", "long 2"] and short_done == [False, True]  # answered at slice one
    assert len(calls) == 3 and not any(t.startswith("gone") for c in calls for t in c)  # nothing after the cancel


def test_post_with_its_query_in_the_url_and_a_table_dropped_while_serving(server, tmp_path):
    """POST /search?q=… with no body was "the body is not JSON"; a dropped table was a 500 with PostgreSQL's
    words and a CONTEXT line."""
    import psycopg

    src = tmp_path / "gone.jsonl"
    src.write_text("".join(json.dumps({"id": f"g{i}", "text": t}) + "\n" for i, t in enumerate(TEXTS)))
    subprocess.run([sys.executable, "-m", "embedfleet.cli", "ingest", str(src), "--db", server["dsn"], "--devices",
                    "cpu", "--quiet", "--id-field", "id", "--table", "gone"], env=server["env"], check=True,
                   capture_output=True, timeout=600)
    proc = subprocess.Popen([sys.executable, "-m", "embedfleet.cli", "serve", "--table", "gone", "--db", server["dsn"],
                             "--port", "0", "--device", "cpu"], env=server["env"], stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        assert "serving" in line, line
        base = "http://" + line.split("http://")[1].split("/search")[0]
        status, answer = _call(base + "/search?q=battery&k=2", b"", key=None)
        assert status == 200 and [r["id"] for r in json.loads(answer)["results"]][0] == "g0", answer
        with psycopg.connect(server["dsn"], autocommit=True) as conn:
            conn.execute("DROP TABLE gone")
        status, answer = _call(base + "/search?q=battery", key=None)
        assert status == 503 and json.loads(answer)["error"] == "table gone is gone (dropped or renamed while serving)"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
