"""A rank's loop on a node other than its hub's: a ZMQ DEALER over CURVE TCP, watched by a
socket monitor so that the loop knows when its hub is reached, and when it is gone.
``channel_loop.serve`` chooses it for a ``tcp://`` endpoint and answers each message.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import zmq

from tpcache.transport.channel_msgs import HELLO, STOP, Attach, ChannelConnectError
from tpcache.transport.connect_watch import MONITOR_EVENTS, ConnectWatch
from tpcache.transport.netsec import make_client

_HEARTBEAT_MS = 1000  # a TCP rank's ZMTP ping interval; 5 missed: its hub is gone


def serve_tcp(
    rank: int,
    attach: Attach,
    answer: Callable[[bytes], bytes],
    stop: threading.Event,
    poll_s: float,
    connect_s: float,
) -> int:
    """Serve the hub at ``attach.endpoint`` (``tcp://``) over a DEALER socket: each message
    handed to ``answer``, whose reply goes back, until ``STOP``, ``stop`` is set or the hub's
    end is gone; returns the messages handled. Raises ``ChannelConnectError`` if the hub is
    not reached (through the CURVE handshake) within ``connect_s`` seconds."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    monitor: zmq.Socket | None = None
    handled = 0
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, attach.identity)
        sock.setsockopt(zmq.RCVHWM, attach.hwm)
        if attach.server_key is not None:
            make_client(sock, attach.server_key, attach.keypair)
        # ZMTP heartbeats (answered by ZMQ's I/O thread, also while a step runs): a hub
        # whose node went silent ends the connection as a closed one would.
        sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5 * _HEARTBEAT_MS)
        # A DEALER reconnects on its own and tells no one its peer left, nor that it
        # never reached it: the monitor does, so the loop leaves when the hub's end is
        # gone, as the Unix loop does (its hub may have closed without a STOP reaching
        # this rank), and fails when the hub is not reached in time.
        monitor = sock.get_monitor_socket(MONITOR_EVENTS)
        try:
            sock.connect(attach.endpoint)
        except zmq.ZMQError as exc:  # an endpoint ZMQ cannot use
            raise ChannelConnectError(rank, attach.endpoint, f"ZMQError: {exc}") from None
        sock.send(HELLO + str(rank).encode())
        poller = zmq.Poller()  # made once: a socket's poll() builds one per call
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        wait_ms = int(poll_s * 1000)
        link = ConnectWatch("the hub", "this rank")
        deadline = time.monotonic() + connect_s
        while not stop.is_set():
            ready = dict(poller.poll(wait_ms))
            if monitor in ready:
                link.take(monitor)
                if link.gone:
                    break  # disconnected after a good connect: the hub's end is gone
            if sock not in ready:
                if not link.up and time.monotonic() > deadline:
                    raise ChannelConnectError(
                        rank, attach.endpoint, f"not connected within {connect_s:g}s: {link.why}"
                    )
                continue
            link.up = True  # a message came: the handshake is done, seen or not
            body = sock.recv()
            if body[:1] == STOP:
                break
            sock.send(answer(body))
            handled += 1
    finally:
        if monitor is not None:
            sock.disable_monitor()
            monitor.close(linger=0)
        sock.close(linger=0)
        ctx.term()
    return handled
