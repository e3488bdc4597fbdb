"""What a connecting ZMQ socket's monitor says: whether the handshake with its peer is
done, whether a connection it made is gone, and, until the handshake, why not yet (the
error a caller gives when it never is). A rank's TCP loop (``rank_tcp``) and the KV-event
subscriber (``events.subscriber``) watch their connects with it."""

from __future__ import annotations

import os

import zmq
from zmq.utils.monitor import recv_monitor_message

# The monitor events watched: the handshake done (connected), the connection gone, and
# why a connect has not been made yet.
MONITOR_EVENTS = int(
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class ConnectWatch:
    """A connect, as its monitor (``sock.get_monitor_socket(MONITOR_EVENTS)``) tells it:
    ``up`` once the handshake is done, ``gone`` once the connection it made is lost;
    ``why`` says what went wrong so far. ``peer`` and ``me`` name the two ends in
    ``why`` ("the hub", "this rank")."""

    def __init__(self, peer: str, me: str) -> None:
        self.peer = peer
        self.me = me
        self.up = False  # set by take()
        self.gone = False  # set by take()
        self.retries = 0  # set by take()
        self.why = "no answer (the connect was neither made nor refused)"  # set by take()

    def take(self, monitor: zmq.Socket) -> None:
        """Read the events that have arrived."""
        while monitor.poll(0):
            event = recv_monitor_message(monitor)
            kind, value = int(event["event"]), int(event["value"])
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.up = True
            elif kind == zmq.EVENT_DISCONNECTED:
                # Before the handshake, ZMQ retries (a failed handshake said why already).
                self.gone = self.up
                if self.why.startswith("no answer"):
                    self.why = "the connection closed before the handshake"
            elif kind == zmq.EVENT_CONNECT_RETRIED:
                self.retries += 1
                self.why = f"{self.retries} connect attempt(s) failed (refused or unreachable)"
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.why = f"{self.peer} refused {self.me}'s key (CURVE handshake, status {value})"
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                self.why = f"the handshake failed (ZMTP protocol error {value:#x})"
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                self.why = f"the handshake failed ({os.strerror(value)})"
