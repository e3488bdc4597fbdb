"""Who may reach a socket: loopback by default, CURVE on a network address.

Every socket tpcache opens binds loopback unless the operator names another address;
one that carries token ids (KV events, replays and snapshots, the step channel) on a
network address must be authenticated (ZMQ CURVE: the server's secret key stays with
it, clients are handed its public key, and may be limited to a list of their own public
keys) or the operator must say explicitly that it may be read by anyone who reaches it.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from tpcache.errors import TpcacheError
from tpcache.logs import Throttle

logger = logging.getLogger("tpcache.transport")


class NetSecError(TpcacheError, ValueError):
    """A key that is not a CURVE key, or an address that needs authentication."""


def tcp_host(endpoint: str) -> str | None:
    """The host of a ``tcp://host:port`` endpoint (brackets of an IPv6 literal removed);
    None for another transport."""
    transport, _, address = endpoint.partition("://")
    if transport != "tcp":
        return None
    host = address.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address; ``*`` means every interface) is only
    reachable from this machine."""
    if host in ("*", "0.0.0.0", "::", ""):
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def endpoint_is_local(endpoint: str) -> bool:
    """Whether a ZMQ endpoint can only be reached from this machine (ipc, inproc, or a
    loopback tcp address)."""
    host = tcp_host(endpoint)
    if host is None:
        return endpoint.startswith(("ipc://", "inproc://"))
    return is_loopback(host)


def check_key(name: str, key: str) -> None:
    """Raise ``NetSecError`` unless ``key`` is a Z85 CURVE key (40 chars, 32 bytes)."""
    if not isinstance(key, str) or len(key) != 40:
        raise NetSecError(f"{name} must be a 40-character Z85 CURVE key")
    try:
        z85.decode(key.encode("ascii"))
    except Exception as exc:
        raise NetSecError(f"{name} is not a Z85 CURVE key: {exc}") from None


def new_keypair() -> tuple[str, str]:
    """A fresh CURVE (public, secret) key pair, Z85 text."""
    public, secret = zmq.curve_keypair()
    return public.decode("ascii"), secret.decode("ascii")


def public_of(secret: str) -> str:
    """The public key of a CURVE secret key."""
    return zmq.curve_public(secret.encode("ascii")).decode("ascii")


# ZMQ holds the handshake's commands to a socket's MAXMSGSIZE too: the largest a client
# sends is CURVE's INITIATE, 257 bytes and its metadata (the socket type, a routing id of
# up to 255 bytes), 547 bytes in all. A limit below this would let no client in at all.
HANDSHAKE_BYTES = 1024
# What CURVE adds to every message on the wire: the MESSAGE command's name, its nonce,
# the box's MAC and the flags byte.
CURVE_FRAME_BYTES = 33


def limit_receive(sock: zmq.Socket, max_message: int, rcvhwm: int) -> None:
    """Bound what one peer can make ``sock`` hold. Call it before the socket binds or
    connects: ZMQ copies a socket's options there, and a later change reaches no
    connection made through that endpoint.

    A peer that sends a frame larger than ``max_message`` (the largest the socket's
    protocol carries; CURVE's framing and the handshake are allowed for here) is
    disconnected by ZMQ as soon as the frame's header arrives, before the frame is
    buffered; at most ``rcvhwm`` messages wait per connection for the socket's reader,
    beyond which ZMQ stops reading that connection. So one connection can make this
    process hold at most about ``rcvhwm`` messages of ``max_message`` bytes, and one that
    has not completed its handshake (a peer without the key) a single frame."""
    sock.setsockopt(zmq.MAXMSGSIZE, max(max_message + CURVE_FRAME_BYTES, HANDSHAKE_BYTES))
    sock.setsockopt(zmq.RCVHWM, rcvhwm)


# Subscriptions waiting per subscriber for a PUB socket's reader: a subscriber sends one
# per topic it follows (tpcache's, one).
SUBSCRIPTIONS_WAITING = 16


def limit_subscriptions(pub: zmq.Socket, topic: bytes) -> None:
    """``limit_receive`` for a PUB socket, before it binds or connects. All it receives is
    subscriptions: a topic prefix behind a one-byte flag or a SUBSCRIBE command's name, so
    the longest a subscriber of ``topic`` sends is that name and ``topic``."""
    limit_receive(pub, len(b"\x09SUBSCRIBE") + len(topic), SUBSCRIPTIONS_WAITING)


def make_server(sock: zmq.Socket, secret: str) -> None:
    """Make ``sock`` a CURVE server (before it binds): only clients that know the public
    key of ``secret`` complete the handshake, and the traffic is encrypted."""
    sock.curve_secretkey = secret.encode("ascii")
    sock.curve_publickey = public_of(secret).encode("ascii")
    sock.curve_server = True


def make_client(
    sock: zmq.Socket, server_public: str, keypair: tuple[str, str] | None = None
) -> None:
    """Make ``sock`` a CURVE client of the server with ``server_public`` (before it
    connects), with ``keypair`` (public, secret) as its own, or a fresh one."""
    public, secret = keypair or new_keypair()
    sock.curve_serverkey = server_public.encode("ascii")
    sock.curve_publickey = public.encode("ascii")
    sock.curve_secretkey = secret.encode("ascii")


_auth_lock = threading.Lock()
_authenticators: dict[int, tuple[ThreadAuthenticator, int]] = {}


def allow_clients(ctx: zmq.Context, client_keys: tuple[str, ...]) -> None:
    """Limit CURVE servers of ``ctx`` to clients with these public keys (a ZAP handler
    on its own thread, one per context). Release with ``release_clients``."""
    with _auth_lock:
        auth, users = _authenticators.get(id(ctx), (None, 0))
        if auth is None:
            auth = ThreadAuthenticator(ctx)
            auth.start()
        allowed = {k.encode("ascii"): True for k in client_keys}
        auth.configure_curve_callback(domain="*", credentials_provider=_Allowed(allowed))
        _authenticators[id(ctx)] = (auth, users + 1)


def release_clients(ctx: zmq.Context) -> None:
    with _auth_lock:
        auth, users = _authenticators.get(id(ctx), (None, 0))
        if auth is None:
            return
        if users <= 1:
            auth.stop()
            del _authenticators[id(ctx)]
        else:
            _authenticators[id(ctx)] = (auth, users - 1)


class _Allowed:
    def __init__(self, keys: dict[bytes, bool]) -> None:
        self.keys = keys
        self.refusals = Throttle(logger)  # the operator's line on a refused client

    def callback(self, domain: str, key: bytes) -> bool:
        """Whether the client of public ``key`` (Z85, as pyzmq hands it over) may connect."""
        if key in self.keys:
            return True
        shown = key.decode("ascii", "replace")
        self.refusals.warning(
            "curve", f"refused a CURVE client: its public key {shown} is not an allowed client key"
        )
        return False


__all__ = [
    "NetSecError",
    "allow_clients",
    "check_key",
    "endpoint_is_local",
    "is_loopback",
    "limit_receive",
    "limit_subscriptions",
    "make_client",
    "make_server",
    "new_keypair",
    "public_of",
    "release_clients",
    "tcp_host",
]
