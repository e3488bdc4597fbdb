"""The operator's lines on refused clients: the network frontend's (no valid token, a
malformed request, a message not of its protocol, a CURVE key not allowed) and the OpenAI endpoint's (401 without
the API key, 503 beyond its connections), each naming the client; at most one line per
kind every 10 s, the rest counted. Real ZMQ and HTTP on loopback, real groups."""

from __future__ import annotations

import http.client
import logging
import socket
import time

import pytest
import zmq
from net_helpers import group
from test_openai_http import VOCAB, tiny_group

from tpcache.coordinator.local_ranks import start_local_group
from tpcache.engine.config import EngineConfig
from tpcache.engine.loop import Engine
from tpcache.frontend.api import decode_replies
from tpcache.frontend.frontend import serve_network
from tpcache.frontend.net_config import FrontendConfig
from tpcache.frontend.openai_http import OpenAIServer
from tpcache.logs import LineBuffer, LogLevelError, Throttle, check_level
from tpcache.transport.netsec import make_client, new_keypair

GOOD = "a-token-of-16-chars-or-more"


def refusals(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "tpcache.frontend" and r.levelno == logging.WARNING
    ]


def ask(sock: zmq.Socket, token: bytes, body: bytes) -> list:
    """One request of the frontend's wire form; its decoded replies."""
    sock.send_multipart([b"12345678", token, body])
    assert sock.poll(20_000), "no reply"
    rid, data = sock.recv_multipart()
    assert rid == b"12345678"
    return decode_replies(data)


def test_the_network_frontend_logs_each_client_it_refuses(caplog) -> None:
    caplog.set_level(logging.INFO, logger="tpcache")
    coord = group()
    front = serve_network(coord, FrontendConfig(endpoint="tcp://127.0.0.1:0", token=GOOD))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"\x01\x02client-one")
    sock.connect(front.endpoint)
    try:
        [err] = ask(sock, b"wrong", b"\x91\x80")
        assert err.error == "Unauthenticated"
        [line] = refusals(caplog)
        # Which frontend, which peer (its address and connection), what it did.
        assert line.startswith(f"network frontend {front.endpoint} refused a client (127.0.0.1, ")
        assert "connection 0102636c69656e742d6f6e65" in line  # its routing id, in hex
        assert line.endswith("no valid token (answered Unauthenticated)")
        [err] = ask(sock, GOOD.encode(), b"\xc1 not msgpack")
        assert err.error == "BadRequest"
        line = refusals(caplog)[1]
        assert "a malformed request: " in line and err.message in line
        # Not this protocol: no reply to send, a line all the same.
        sock.send_multipart([b"short-id", GOOD.encode()])
        deadline = time.monotonic() + 20
        while len(refusals(caplog)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert refusals(caplog)[2].endswith(
            "not tpcache's network protocol (2 frames, an id of 8 bytes); not answered"
        )
        # A second bad token within 10 s: counted, not logged; the frontend still answers.
        [err] = ask(sock, b"wrong-again", b"\x91\x80")
        assert err.error == "Unauthenticated"
        assert len(refusals(caplog)) == 3 and front.refused == 4
    finally:
        sock.close(0)
        ctx.term()
        front.close()
        coord.close()


def test_a_curve_client_whose_key_is_not_allowed_is_logged(caplog) -> None:
    caplog.set_level(logging.INFO, logger="tpcache")
    server_public, server_secret = new_keypair()
    allowed, stranger = new_keypair(), new_keypair()
    coord = group()
    config = FrontendConfig(
        endpoint="tcp://127.0.0.1:0",
        curve_secret_key=server_secret,
        curve_client_keys=(allowed[0],),
    )
    front = serve_network(coord, config)
    ctx = zmq.Context()
    socks = []
    try:
        for keypair in (stranger, allowed):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            make_client(sock, server_public, keypair)
            sock.connect(front.endpoint)
            socks.append(sock)
        socks[0].send_multipart([b"12345678", b"", b"\x91\x80"], zmq.NOBLOCK)
        deadline = time.monotonic() + 20
        while not refused_keys(caplog) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert refused_keys(caplog) == [
            f"refused a CURVE client: its public key {stranger[0]} is not an allowed client key"
        ]
        assert not socks[0].poll(200)  # never answered
        # The allowed key gets through to the frontend, which answers it.
        [answer] = ask(socks[1], b"", b"\x90")
        assert answer.message == "a message must carry at least one call"
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()
        front.close()
        coord.close()


def refused_keys(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tpcache.transport"]


def test_the_openai_endpoint_logs_401s_and_connections_beyond_its_bound(caplog) -> None:
    caplog.set_level(logging.INFO, logger="tpcache")
    coord = start_local_group(tiny_group(tp=1))
    engine = Engine(coord, EngineConfig(step_tokens=64, max_batch=4), vocab=VOCAB)
    engine.start()
    server = OpenAIServer(engine, api_key="s3cret", max_connections=1)
    server.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("GET", "/v1/models", headers={"Authorization": "Bearer nope"})
        assert conn.getresponse().status == 401
        assert refusals(caplog) == [
            "OpenAI endpoint refused GET /v1/models from 127.0.0.1: no valid API key (answered 401)"
        ]
        # The kept-alive connection above is the one connection served: one more is 503.
        extra = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        assert extra.recv(64).startswith(b"HTTP/1.1 503")
        extra.close()
        conn.close()
        line = refusals(caplog)[1]
        assert line.startswith("OpenAI endpoint refused a connection from 127.0.0.1: ")
        assert line.endswith("it serves 1 already (answered 503)")
    finally:
        server.close()
        engine.close()
        coord.close()


def test_throttle_holds_back_a_kind_for_its_interval_and_counts() -> None:
    logger = logging.getLogger("tpcache.test-throttle")
    logger.setLevel(logging.INFO)
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    keep = Keep()
    logger.addHandler(keep)
    now = [100.0]
    throttle = Throttle(logger, every_s=10.0, clock=lambda: now[0])
    try:
        assert throttle.warning("token", "first")
        now[0] = 109.9
        assert not throttle.warning("token", "held")
        assert not throttle.warning("token", "held too")
        assert throttle.warning("busy", "another kind goes out")
        now[0] = 110.0
        assert throttle.warning("token", "again")
        assert seen == [
            "first",
            "another kind goes out",
            "again (2 more like it since the last such line)",
        ]
        logger.setLevel(logging.ERROR)  # warnings off: nothing is counted or held
        now[0] = 500.0
        assert not throttle.warning("token", "quiet")
        logger.setLevel(logging.INFO)
        assert throttle.warning("token", "back")
        assert seen[-1] == "back"
    finally:
        logger.removeHandler(keep)


def test_line_buffer_numbers_lines_and_says_what_was_dropped() -> None:
    buf = LineBuffer(limit=3)
    buf.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("tpcache.test-buffer")
    logger.setLevel(logging.INFO)
    logger.addHandler(buf)
    try:
        for i in range(5):
            logger.info("line %d", i)
        assert buf.since(0) == (5, ["line 2", "line 3", "line 4"], 2)
        assert buf.since(3) == (5, ["line 3", "line 4"], 0)
        assert buf.since(5) == (5, [], 0)
        assert LineBuffer().id != buf.id
    finally:
        logger.removeHandler(buf)


@pytest.mark.parametrize("bad", ["LOUD", "", "info ", 10, None])
def test_a_level_outside_the_four_is_refused(bad) -> None:
    with pytest.raises(LogLevelError, match="must be one of DEBUG, INFO, WARNING, ERROR"):
        check_level(bad)
    assert check_level("debug") == logging.DEBUG and check_level("ERROR") == logging.ERROR
