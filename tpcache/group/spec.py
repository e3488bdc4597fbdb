"""Where and how a rank joins its TP group (``GroupSpec``), the group's errors, and the
small helpers the group and its callers share (seconds, u64 <-> i64, addresses).

Kept apart from ``group.py`` so that what only describes a group imports no torch.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tpcache.errors import TpcacheError
from tpcache.transport.private_dir import RDV_PREFIX, PrivateDir

_BACKENDS = ("gloo", "nccl", "auto")
I64_MIN = -(2**63)
I64_MAX = 2**63 - 1


class GroupError(TpcacheError, RuntimeError):
    """The group could not form, or a collective failed; the message names rank and address."""


class GroupInputError(GroupError, ValueError):
    """A collective was called with bad arguments; raised before entering it."""


def check_seconds(name: str, value: Any) -> None:
    """Raise GroupInputError unless ``value`` is a finite number of seconds > 0 (not a bool)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value > 0)
    ):
        raise GroupInputError(f"{name}={value!r} must be a finite number of seconds > 0")


def u64_to_i64(value: int) -> int:
    """The int64 with the same 64 bits as unsigned ``value`` (raises ValueError if out of range)."""
    if not 0 <= value < 2**64:
        raise GroupInputError(f"{value} is not an unsigned 64-bit value")
    return value - 2**64 if value >= 2**63 else value


def i64_to_u64(value: int) -> int:
    """The unsigned value with the same 64 bits as int64 ``value``."""
    if not I64_MIN <= value <= I64_MAX:
        raise GroupInputError(f"{value} is not a signed 64-bit value")
    return value + 2**64 if value < 0 else value


@dataclass(frozen=True)
class GroupSpec:
    """Where and how one rank joins its TP group.

    ``timeout_s`` bounds each collective: how long a hung peer goes unnoticed.
    ``join_timeout_s`` bounds the rendezvous: how long ``TPGroup.init`` waits for the
    slowest rank's process to arrive. They differ because joining waits on process
    start-up (seconds, tens of seconds under load) while a collective among live ranks
    takes milliseconds. ``join_timeout_s`` is a plain 120 s rather than derived from
    ``timeout_s``: start-up time does not scale with the collective bound, and 120 s is
    how long the Ray side waits for ranks to be placed (``RayRanks.start_timeout_s``).
    Both are always passed to torch, never its 10-30 min defaults.
    """

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    backend: str = "auto"
    timeout_s: float = 60.0
    join_timeout_s: float = 120.0
    # Every rank on one node: meet through a file there (in a private directory) instead
    # of a TCP store, and talk over loopback only (the TCP store listens on every
    # interface, whatever host it is given). ``master_addr``/``master_port`` unused then.
    store_path: str | None = None

    def __post_init__(self) -> None:
        if self.store_path is not None and (
            not isinstance(self.store_path, str) or not self.store_path.startswith("/")
        ):
            raise GroupInputError(f"store_path must be an absolute path, got {self.store_path!r}")
        for name in ("rank", "world_size", "master_port"):
            if type(getattr(self, name)) is not int:
                raise GroupInputError(f"{name} must be an int, got {getattr(self, name)!r}")
        if self.world_size < 1:
            raise GroupInputError(f"world_size={self.world_size} must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise GroupInputError(f"rank={self.rank} is outside [0, {self.world_size})")
        if not 1 <= self.master_port <= 65535:
            raise GroupInputError(f"master_port={self.master_port} is outside [1, 65535]")
        if not isinstance(self.master_addr, str) or not self.master_addr.strip():
            raise GroupInputError(f"master_addr must be a non-empty host, got {self.master_addr!r}")
        if self.backend not in _BACKENDS:
            raise GroupInputError(f"backend={self.backend!r} is not one of {_BACKENDS}")
        check_seconds("timeout_s", self.timeout_s)
        check_seconds("join_timeout_s", self.join_timeout_s)

    @property
    def init_method(self) -> str:
        if self.store_path is not None:
            return f"file://{self.store_path}"
        host = self.master_addr
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # an IPv6 literal needs brackets in a URL
        return f"tcp://{host}:{self.master_port}"

    @property
    def where(self) -> str:
        """``rank r/world at addr:port``, for error messages."""
        at = self.store_path or f"{self.master_addr}:{self.master_port}"
        return f"rank {self.rank}/{self.world_size} at {at}"


@contextlib.contextmanager
def loopback_only() -> Iterator[None]:
    """Gloo's and NCCL's sockets on the loopback interface while a group forms (they
    read these variables when they make their devices); the caller's values after."""
    names = [n for _, n in socket.if_nameindex() if n.startswith("lo")]
    keys = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
    saved = {k: os.environ.get(k) for k in keys}
    if names:
        for k in keys:
            os.environ[k] = names[0]
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def free_port(host: str = "") -> int:
    """A TCP port free now on ``host`` (default: every interface, as the rendezvous store
    listens). Racy by nature: another process may take it before the group binds it; a
    taken port makes ``TPGroup.init`` raise GroupError."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def node_ip(probe: str = "10.255.255.255") -> str:
    """The address other nodes can reach this one at (best effort).

    Asks the kernel which local address routes to ``probe`` (a UDP connect sends no
    packet); falls back to the host name's address, then to 127.0.0.1, which is only
    right for a single-node group.
    """
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((probe, 1))
        addr = str(s.getsockname()[0])
        if not addr.startswith("0."):
            return addr
    with contextlib.suppress(OSError):
        return socket.gethostbyname(socket.gethostname())
    return "127.0.0.1"


class StoreDir:
    """The directory of a rendezvous file for a group whose ranks all run on one node:
    new for each group, readable only by this user, removed with ``drop``, or by the
    next group's if its owner was killed (``private_dir``)."""

    def __init__(self) -> None:
        self._dir: PrivateDir | None = None

    def new_store(self) -> str:
        """A rendezvous file's path in a new directory (the last one is removed)."""
        self.drop()
        self._dir = PrivateDir(RDV_PREFIX)
        return os.path.join(self._dir.path, "store")

    def drop(self) -> None:
        if self._dir is not None:
            self._dir.remove()
            self._dir = None
