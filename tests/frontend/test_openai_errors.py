"""The OpenAI endpoint's refusals and departures: bad requests answered with OpenAI's
error body (as the official client raises them), an unknown model, an oversized body,
wrong paths and methods, a missing API key, a closed engine; a client that goes away
mid-request has its engine request cancelled and its slots back. Real engine, real HTTP
on loopback."""

from __future__ import annotations

import http.client
import json
import os
import resource
import socket
import time

import openai
import pytest
from test_openai_http import VOCAB, client, tiny_group

from tpcache.coordinator.local_ranks import start_local_group
from tpcache.engine.config import EngineConfig
from tpcache.engine.loop import Engine
from tpcache.frontend.openai_http import OpenAIConfigError, OpenAIServer


@pytest.fixture(scope="module")
def served():
    coord = start_local_group(tiny_group())
    engine = Engine(coord, EngineConfig(step_tokens=256, max_batch=16, timeout_s=60.0), vocab=VOCAB)
    engine.start()
    server = OpenAIServer(engine, model_name="tiny", max_body_bytes=4096)
    server.start()
    try:
        yield coord, engine, server
    finally:
        server.close()
        engine.close()
        coord.close()


def raw(server: OpenAIServer, method: str, path: str, body: bytes = b"", headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request(method, path, body=body, headers=headers or {})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


@pytest.mark.parametrize(
    ("ask", "param", "says"),
    [
        ({"n": 2}, "n", "n must be 1"),
        ({"echo": True}, "echo", "echo is not supported"),
        ({"logprobs": 2}, "logprobs", "logprobs is not supported"),
        ({"best_of": 3}, "best_of", "best_of is not supported"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1, got 0"),
        ({"temperature": -1}, "temperature", "temperature must be in"),
        ({"top_p": 0}, "top_p", "top_p must be > 0"),
        ({"seed": -3}, "seed", "seed must be in"),
        ({"prompt": "hello"}, "prompt", "this server has no tokenizer"),
        ({"prompt": [1, VOCAB]}, "prompt", f"prompt token id {VOCAB} is outside"),
        ({"prompt": []}, "prompt", "and not empty"),
        ({"prompt": [[1], "a"]}, "prompt", "no tokenizer"),
        ({"prompt": [[1], [2, True]]}, "prompt", "must be an integer"),
        ({"stop": "\n"}, "stop", "stop strings need one"),
        ({"max_tokens": 5000}, "prompt", "prompt 0 needs KV for"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
        ({"frobnicate": 1}, "frobnicate", "Unrecognized request argument supplied: frobnicate"),
    ],
)
def test_bad_requests_get_openai_errors(served, ask, param, says) -> None:
    _, engine, server = served
    with pytest.raises(openai.BadRequestError) as exc:  # extra_body: sent as it is
        client(server).completions.create(
            model="tiny", prompt=[1, 2, 3], max_tokens=2, extra_body=ask
        )
    assert exc.value.status_code == 400
    err = exc.value.body
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert says in err["message"], err
    assert "openai-" not in err["message"]  # the server's own request ids stay its own
    assert engine.stats()["live"] == 0  # nothing queued or held


def test_defaults_of_unsupported_fields_are_accepted(served) -> None:
    _, _, server = served
    out = client(server).completions.create(
        model="tiny", prompt=[1, 2], max_tokens=2, echo=False, best_of=1, logprobs=None,
        frequency_penalty=0, presence_penalty=0.0, n=1, user="u", suffix=None,
    )  # fmt: skip
    assert len(out.choices[0].token_ids) == 2


def test_unknown_model_is_404_model_not_found(served) -> None:
    _, _, server = served
    with pytest.raises(openai.NotFoundError) as exc:
        client(server).completions.create(model="gpt-4", prompt=[1, 2], max_tokens=2)
    assert exc.value.body["code"] == "model_not_found" and exc.value.body["param"] == "model"
    assert "gpt-4" in exc.value.body["message"]


def test_http_level_refusals(served) -> None:
    _, _, server = served
    status, body = raw(server, "POST", "/v1/completions", b"{not json", {"Content-Type": "application/json"})  # fmt: skip
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = raw(server, "POST", "/v1/completions", b"[1, 2]")
    assert status == 400 and body["error"]["message"] == "the request body must be a JSON object"
    assert raw(server, "GET", "/v1/nothing")[0] == 404
    status, body = raw(server, "GET", "/v1/completions")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
    assert raw(server, "POST", "/v1/models", b"{}")[0] == 405
    # Over the limit: refused from the header, before the body is read (none is sent).
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Length", str(17 << 20))
    conn.endheaders()
    resp = conn.getresponse()
    body = json.loads(resp.read())
    assert resp.status == 413 and body["error"]["code"] == "request_too_large"
    assert "at most 4096" in body["error"]["message"]
    conn.close()
    with pytest.raises(openai.APIStatusError) as exc:  # the client sees it too
        client(server).completions.create(model="tiny", prompt=[1] * 3000, max_tokens=1)
    assert exc.value.status_code == 413


def wait_until(check, seconds: float = 20.0) -> None:
    end = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def test_a_client_leaving_cancels_its_request(served) -> None:
    coord, engine, server = served
    before = engine.stats()
    for stream in (True, False):
        body = json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": stream})  # fmt: skip
        s = send_raw(server.port, "POST /v1/completions HTTP/1.1", body.encode())
        wait_until(lambda: engine.stats()["live"] == 1)
        if stream:
            read_until(s, b"data: ")  # the stream has begun
        s.close()
        wait_until(lambda: engine.stats()["live"] == 0)
        wait_until(lambda: coord.stats()["running"] == 0)
    after = engine.stats()
    assert after["cancelled"] - before["cancelled"] == 2, after
    assert after["finished"] == before["finished"]
    assert after["generated"] - before["generated"] < 2000  # both stopped early
    assert coord.stats()["held"] == 0


def send_raw(port: int, head: str, body: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(f"{head}\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return s


def read_until(s: socket.socket, end: bytes) -> bytes:
    data = b""
    while end not in data:
        more = s.recv(65536)
        assert more, data
        data += more
    return data


def test_closing_the_server_ends_a_stream(served) -> None:
    _, engine, _ = served
    server = OpenAIServer(engine, model_name="tiny")
    server.start()
    body = json.dumps({"model": "tiny", "prompt": [4, 5], "max_tokens": 1000, "ignore_eos": True, "stream": True})  # fmt: skip
    s = send_raw(server.port, "POST /v1/completions HTTP/1.1", body.encode())
    read_until(s, b"data: ")
    server.close()
    rest = read_until(s, b"\r\n0\r\n\r\n")  # the last chunk
    assert b'"message": "the server is closing"' in rest and b"data: [DONE]" in rest
    s.close()
    wait_until(lambda: engine.stats()["live"] == 0)


def test_unread_bodies_end_the_connection(served) -> None:
    _, _, server = served
    # A refusal before the body was read: the body must not be taken for a request.
    s = send_raw(server.port, "POST /v1/nothing HTTP/1.1", b"GET /health HTTP/1.1\r\n\r\n")
    data = read_until(s, b"}}")
    assert data.startswith(b"HTTP/1.1 404") and b"Connection: close" in data
    assert s.recv(100) == b""  # closed, nothing more answered
    s.close()
    # Expect: 100-continue over the limit: refused before the client sends the body
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 99999\r\n\r\n")  # fmt: skip
    assert read_until(s, b"}}").startswith(b"HTTP/1.1 413")
    s.close()


def test_a_connection_past_descriptor_1023_is_served(served) -> None:
    """select.select refuses descriptors over 1023: a server that looked for its client
    leaving with it would take every such connection for gone."""
    _, _, server = served
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if max(soft, hard) < 1200:
        pytest.skip(f"the descriptor limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        out = client(server).completions.create(model="tiny", prompt=[1, 2], max_tokens=3)
        assert len(out.choices[0].token_ids) == 3
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_connections_past_the_bound_are_busy(served) -> None:
    _, engine, _ = served
    server = OpenAIServer(engine, model_name="tiny", max_connections=2)
    server.start()
    try:
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(2)]
        wait_until(lambda: server.httpd.active == 2)  # both taken by handler threads
        with pytest.raises(openai.InternalServerError) as exc:
            client(server).completions.create(model="tiny", prompt=[1, 2], max_tokens=2)
        assert exc.value.status_code == 503 and exc.value.body["code"] == "busy"
        for s in idle:
            s.close()
        wait_until(lambda: server.httpd.active == 0)
        out = client(server).completions.create(model="tiny", prompt=[1, 2], max_tokens=2)
        assert len(out.choices[0].token_ids) == 2
    finally:
        server.close()


def test_api_key_and_bind_rules(served, tmp_path) -> None:
    _, engine, _ = served
    (tmp_path / "tokenizer.json").write_text("{not a tokenizer")
    with pytest.raises(OpenAIConfigError, match=r"cannot load .*tokenizer\.json"):
        OpenAIServer(engine, tokenizer_dir=str(tmp_path))
    with pytest.raises(OpenAIConfigError, match="not loopback: give an api_key"):
        OpenAIServer(engine, host="0.0.0.0")
    with pytest.raises(OpenAIConfigError, match="api_key"):
        OpenAIServer(engine, api_key="")
    keyed = OpenAIServer(engine, model_name="tiny", api_key="s3cret")
    keyed.start()
    try:
        with pytest.raises(openai.AuthenticationError) as exc:
            client(keyed).models.list()  # client() sends the key "x"
        assert exc.value.body["code"] == "invalid_api_key"
        c = openai.OpenAI(base_url=keyed.url + "/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["tiny"]
        assert raw(keyed, "GET", "/health")[0] == 200  # health needs no key
    finally:
        keyed.close()


def test_closed_engine_is_503_retryable() -> None:
    coord = start_local_group(tiny_group(tp=1))
    engine = Engine(coord, EngineConfig(step_tokens=64, timeout_s=30.0), vocab=VOCAB)
    engine.start()
    server = OpenAIServer(engine, model_name="tiny")
    server.start()
    try:
        engine.close()
        with pytest.raises(openai.InternalServerError) as exc:
            client(server).completions.create(model="tiny", prompt=[1, 2], max_tokens=2)
        assert exc.value.status_code == 503 and exc.value.response.headers["Retry-After"] == "1"
        assert exc.value.body["type"] == "server_error" and "try again" in exc.value.body["message"]
        status, body = raw(server, "GET", "/health")
        assert (status, body) == (503, {"status": "closed"})
    finally:
        server.close()
        coord.close()
