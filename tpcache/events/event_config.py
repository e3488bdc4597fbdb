"""Configuration of the KV-event publisher (see ``publisher``)."""

from __future__ import annotations

from dataclasses import dataclass

from tpcache.cache.events import ENCODINGS
from tpcache.errors import TpcacheError
from tpcache.transport.netsec import NetSecError, check_key, endpoint_is_local

_TRANSPORTS = ("tcp", "ipc", "inproc", "pgm", "epgm", "ws", "wss", "tipc", "vmci")


class EventConfigError(TpcacheError, ValueError):
    """A field of ``EventConfig`` is invalid; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"EventConfig.{field}: {message}")
        self.field = field


def _check_endpoint(field: str, endpoint: object) -> None:
    if not isinstance(endpoint, str):
        raise EventConfigError(field, f"must be a str, got {type(endpoint).__name__}")
    if not endpoint:
        raise EventConfigError(field, "empty endpoint")
    transport, sep, address = endpoint.partition("://")
    if not sep or not address:
        raise EventConfigError(field, f"{endpoint!r} is not 'transport://address'")
    if transport not in _TRANSPORTS:
        raise EventConfigError(
            field, f"unknown transport {transport!r} in {endpoint!r}; one of {_TRANSPORTS}"
        )
    if transport == "tcp":
        host, sep, port = address.rpartition(":")
        # libzmq takes port 70000 and binds port 4464, so the range is checked here.
        if not sep or not host or not (port == "*" or (port.isdigit() and int(port) < 65536)):
            raise EventConfigError(field, f"{endpoint!r} needs 'tcp://host:port' (port or *)")


def _check_int(field: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise EventConfigError(field, f"must be an int, got {type(value).__name__}")
    if value < minimum:
        raise EventConfigError(field, f"must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class EventConfig:
    """Where and how KV events are published. Validated on construction.

    ``endpoint`` is bound, or with ``connect=True`` connected (to a proxy or a binding
    subscriber). The default binds loopback: ``tcp://127.0.0.1:5557``;
    ``tcp://127.0.0.1:*`` binds a free port (``EventPublisher.endpoint`` tells which). ``replay_endpoint`` is always
    bound. ``queue_size`` bounds both the batches waiting for the send thread and the PUB
    socket's per-subscriber send queue; ``snapshot_queue`` the snapshot requests waiting
    to be built (more get a busy marker).

    ``encoding``: ``"map"``, current vLLM's events (vLLM after v0.23), or ``"array"``,
    older vLLM's (up to v0.23); it also picks the replay framing a vLLM subscriber gets
    (``replay_server``). Events carry token ids (users' prompts). On a network address (any tcp address that
    is not loopback, wildcards included) both sockets must be CURVE servers
    (``curve_secret_key``; subscribers need its public key, and with
    ``curve_client_keys`` only those client keys are let in), or ``insecure=True`` must
    say that anyone who reaches the ports may read them.
    """

    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    queue_size: int = 100_000
    data_parallel_rank: int | None = None
    encoding: str = "map"  # events as maps (vLLM after v0.23) or "array" (up to v0.23)
    curve_secret_key: str | None = None  # Z85; the PUB and ROUTER sockets are CURVE servers
    curve_client_keys: tuple[str, ...] = ()  # Z85 public keys let in (empty: any client)
    insecure: bool = False  # a network address without CURVE, on purpose
    snapshot_queue: int = 4
    connect: bool = False  # connect ``endpoint`` instead of binding it

    def __post_init__(self) -> None:
        _check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            _check_endpoint("replay_endpoint", self.replay_endpoint)
            # Two wildcard ports ("tcp://127.0.0.1:*") get two different free ports.
            if self.replay_endpoint == self.endpoint and not self.endpoint.endswith(":*"):
                raise EventConfigError("replay_endpoint", "must differ from endpoint")
        if not isinstance(self.topic, str):
            raise EventConfigError("topic", f"must be a str, got {type(self.topic).__name__}")
        _check_int("buffer_steps", self.buffer_steps, 1)
        _check_int("queue_size", self.queue_size, 1)
        if self.data_parallel_rank is not None:
            _check_int("data_parallel_rank", self.data_parallel_rank, 0)
        if self.encoding not in ENCODINGS:
            raise EventConfigError("encoding", f"must be one of {ENCODINGS}, got {self.encoding!r}")
        _check_int("snapshot_queue", self.snapshot_queue, 1)
        self._check_security()

    def _check_security(self) -> None:
        try:
            if self.curve_secret_key is not None:
                check_key("curve_secret_key", self.curve_secret_key)
            if not isinstance(self.curve_client_keys, tuple):
                raise NetSecError("curve_client_keys must be a tuple of Z85 public keys")
            for key in self.curve_client_keys:
                check_key("a key of curve_client_keys", key)
        except NetSecError as exc:
            raise EventConfigError("curve_secret_key", str(exc)) from None
        if self.curve_client_keys and self.curve_secret_key is None:
            raise EventConfigError("curve_client_keys", "need curve_secret_key (CURVE is off)")
        for flag in ("insecure", "connect"):
            if not isinstance(getattr(self, flag), bool):
                raise EventConfigError(flag, f"must be a bool, got {getattr(self, flag)!r}")
        for field, ep in (("endpoint", self.endpoint), ("replay_endpoint", self.replay_endpoint)):
            if ep is None or endpoint_is_local(ep) or self.insecure:
                continue
            if self.curve_secret_key is None:
                raise EventConfigError(
                    field,
                    f"{ep!r} is reachable from the network and events carry token ids "
                    "(prompts): give a CURVE key (curve_secret_key; `tpcache serve "
                    "--events-curve-secret-file PATH`), or allow anyone who reaches it "
                    "(insecure=True; --events-insecure), or bind loopback",
                )
            if field == "endpoint" and not self.binds:
                raise EventConfigError(
                    field,
                    f"connecting to {ep!r} (a proxy on another host) cannot use CURVE here: "
                    "bind the PUB socket instead, or set insecure=True (--events-insecure)",
                )

    @property
    def binds(self) -> bool:
        """True when the publisher binds ``endpoint``, False when it connects."""
        return not self.connect
