"""Joining a Ray cluster, from a ``tpcache`` command or a frontend, under Ray's token
authentication.

Ray 2.60 turns token authentication on for a cluster that ``ray.init()`` starts, and for
``ray start --head`` when a token file exists; a process that joins with an explicit
address (an argument or ``RAY_ADDRESS``) does not turn it on by itself: without
``RAY_AUTH_MODE=token`` it retries for ~20 s and fails with ``InvalidAuthToken``.
``join`` asks the address first whether anything answers, whether it wants a token and
whether ours is the right one; it sets ``RAY_AUTH_MODE=token`` (for this process and
its children) when the cluster wants a token and one is here, and otherwise raises
``ClusterJoinError`` with one line that says what is missing, within seconds.

A token here does not mean the cluster wants one. A head without token authentication
(``RAY_AUTH_MODE=disabled``) lets a driver with a token join, but that driver's own
gRPC server then refuses the cluster's calls to it, which carry no token ("Missing
authorization header" in its log), and every actor it creates is cancelled before it
runs (Ray 2.60). So the address is asked without a token first, and token
authentication is turned on only when the cluster refuses that: a first GCS client
without a token does not fix the mode for the process (``_enable_token_auth`` reloads
Ray's config, and the next client sends the token), so both questions are asked here.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tpcache.errors import TpcacheError

TOKEN_FILE = "~/.ray/auth_token"
_COPY = (
    f"copy the head node's {TOKEN_FILE} to {TOKEN_FILE} on this machine (or set "
    "RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH)"
)


class ClusterJoinError(TpcacheError, RuntimeError):
    """The cluster cannot be joined from here; the message says what is missing."""


@dataclass(frozen=True)
class Joined:
    """The cluster this process is a driver of."""

    address: str  # its GCS address, HOST:PORT: what another process passes to join it
    started: bool  # started by this process: it ends when this process does


def find_token() -> str | None:
    """Where Ray would read this process's token from (as Ray looks: ``RAY_AUTH_TOKEN``,
    then the file ``RAY_AUTH_TOKEN_PATH`` names, then ``~/.ray/auth_token``), or None.
    Set but unusable (a blank ``RAY_AUTH_TOKEN``, a ``RAY_AUTH_TOKEN_PATH`` that names a
    missing or empty file) is None too, with no look further: Ray does not look further
    either, it stops the process (``token_problem`` says why)."""
    if token_problem() is not None:
        return None
    if os.environ.get("RAY_AUTH_TOKEN") is not None:
        return "RAY_AUTH_TOKEN"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    return path if _non_empty(path) else None


def token_problem() -> str | None:
    """Why the token Ray was told to use cannot be used, or None. Ray's own check of it
    is a failed assertion that ends the process with nothing on stdout or stderr."""
    given = os.environ.get("RAY_AUTH_TOKEN")
    if given is not None:
        return None if given.strip() else "RAY_AUTH_TOKEN is set but blank"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path and not _non_empty(path):
        return f"RAY_AUTH_TOKEN_PATH names {path}, which cannot be read or is empty"
    return None


def _non_empty(path: str) -> bool:
    try:
        return bool(Path(path).read_text().strip())
    except OSError:
        return False


def join(address: str | None, namespace: str | None = None, *, worker_logs: bool = False) -> Joined:
    """Make this process a driver of a Ray cluster; returns which one.

    ``address``: ``HOST:PORT`` of the head (checked first, see the module docstring),
    ``auto`` (the cluster ``ray start`` made on this machine, as Ray finds it), ``local``
    (start a new cluster, ending with this process), or None (``RAY_ADDRESS`` if set,
    else ``local``). ``worker_logs``: Ray forwards the output of this driver's workers
    (the ranks, a served coordinator's actor) to this process's stderr; off, it stays in
    Ray's log files. Already a driver: that cluster. Raises ``ClusterJoinError``.
    """
    import ray

    if ray.is_initialized():
        return Joined(ray.get_runtime_context().gcs_address, False)
    if address in (None, "auto") and os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
    address = address or "local"
    kwargs: dict = {"namespace": namespace, "log_to_driver": worker_logs}
    if address == "local":
        ray.init(address="local", include_dashboard=False, **kwargs)
        return Joined(ray.get_runtime_context().gcs_address, True)
    if address != "auto" and "://" not in address:  # ray:// is Ray Client: its own checks
        check_address(address)
    try:
        ray.init(address=address, **kwargs)
    except ConnectionError as exc:  # "auto" found nothing
        raise ClusterJoinError(f"no Ray cluster to join at {address!r}: {exc}") from None
    return Joined(ray.get_runtime_context().gcs_address, False)


def check_address(address: str, timeout_s: float = 5.0) -> None:
    """Check that a Ray head answers at ``address`` (``HOST:PORT``) and takes this
    process's token if it wants one; turn token authentication on here only when the
    head refuses a driver without a token and a token is found.
    Raises ``ClusterJoinError`` naming what is missing; changes ``RAY_AUTH_MODE`` only to
    set it to ``token``."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterJoinError(f"a Ray address is HOST:PORT (the head's GCS port), got {address!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise ClusterJoinError(
            f"nothing answers at {address} ({why}): is the head up "
            f"(`ray start --head --port {port}` there) and the address right?"
        ) from None
    auth = _auth_module()
    if auth is None:  # a Ray without token authentication
        return
    mode = os.environ.get("RAY_AUTH_MODE")
    token = find_token()
    problem = token_problem()
    if problem is not None and mode is not None and mode.lower() == "token":
        raise ClusterJoinError(f"RAY_AUTH_MODE=token here, but {problem}")
    if mode is not None and mode.lower() == "token" and token is None:
        # Ray's C++ client would abort the process (a failed check), not raise.
        raise ClusterJoinError(f"RAY_AUTH_MODE=token here, but there is no token: {_COPY}")
    refused = _refuses(address)
    if refused is None:
        # Tokens stay as they are (off unless RAY_AUTH_MODE says token): a driver with
        # them on refuses the calls of a head without them.
        return
    _not_a_head(address, refused)
    if mode is None and token is not None:
        auth._enable_token_auth()
        refused = _refuses(address)
        if refused is None:
            return
        _not_a_head(address, refused)
        mode = "token"
    if mode is not None and mode.lower() == "disabled":
        raise ClusterJoinError(
            f"the Ray cluster at {address} uses token authentication, but RAY_AUTH_MODE="
            f"{mode} here: unset it (tpcache then turns it on) or set RAY_AUTH_MODE=token"
        )
    if problem is not None:
        raise ClusterJoinError(
            f"the Ray cluster at {address} uses token authentication, but {problem}"
        )
    if token is None:
        raise ClusterJoinError(
            f"the Ray cluster at {address} uses token authentication and there is no "
            f"token here: {_COPY}"
        )
    raise ClusterJoinError(f"the Ray cluster at {address} refused the token in {token}: {_COPY}")


def _not_a_head(address: str, refused: BaseException) -> None:
    """Raise ``ClusterJoinError`` unless ``refused`` is Ray's refusal of a token."""
    if isinstance(refused, _auth_error()):
        return
    first = str(refused).strip().splitlines()[0] if str(refused).strip() else ""
    raise ClusterJoinError(
        f"{address} does not answer as a Ray head: {type(refused).__name__}: {first}"
    )


def _refuses(address: str) -> BaseException | None:
    """What a GCS client of ``address`` raises, or None if it connects."""
    from ray._raylet import GcsClient

    with _quiet_stderr():  # Ray's C++ client logs its failure on fd 2; the caller says it
        try:
            GcsClient(address=address)
        except Exception as exc:
            return exc
    return None


def _auth_module():
    try:
        from ray._private.authentication import authentication_token_setup
    except ImportError:
        return None
    return authentication_token_setup


def _auth_error() -> type[BaseException]:
    import ray.exceptions

    return getattr(ray.exceptions, "AuthenticationError", PermissionError)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


# Resources every Ray node has under these names, or that name a node (``node:IP``):
# not what a user pins ranks with, so left out of what an error lists.
_BUILT_IN = ("memory", "object_store_memory", "node:")


def placement_problem(bundles: list[dict[str, float]], nodes: list[dict]) -> str | None:
    """Why no placement of ``bundles`` (one a rank) on the alive nodes of ``nodes``
    (``ray.nodes()``: each with ``Alive``, ``NodeManagerAddress`` and its total
    ``Resources``) can exist, or None. Checks that every resource asked for is on some
    node, that each bundle fits one node, and that the bundles together fit the cluster;
    Ray would wait for the start-up timeout before saying any of these. Pure."""
    alive = [n for n in nodes if n.get("Alive")]
    totals: dict[str, float] = {}
    for n in alive:
        for name, amount in n["Resources"].items():
            totals[name] = totals.get(name, 0.0) + amount
    for rank, bundle in enumerate(bundles):
        absent = [name for name in bundle if name not in totals]
        if absent:
            return (
                f"rank {rank} asks for {_listed({k: bundle[k] for k in absent})}, which no "
                f"node of the cluster has; {_described(alive)}"
            )
        if not any(all(n["Resources"].get(k, 0) >= v for k, v in bundle.items()) for n in alive):
            return f"rank {rank}'s {_listed(bundle)} fits on no one node; {_described(alive)}"
    asked: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            asked[name] = asked.get(name, 0.0) + amount
    over = {k: v for k, v in asked.items() if v > totals[k] + 1e-9}
    if over:
        having = ", ".join(f"{k}={totals[k]:g}" for k in over)
        return (
            f"the {len(bundles)} ranks ask for {_listed(over)} in all, the cluster has "
            f"{having}; {_described(alive)}"
        )
    return None


def check_placeable(bundles: list[dict[str, float]]) -> None:
    """``placement_problem`` against the nodes of the cluster this process drives (Ray
    knows them at once); raises ``PlacementError`` saying it. Changes nothing."""
    import ray

    from tpcache.coordinator.errors import PlacementError

    problem = placement_problem(bundles, ray.nodes())
    if problem is not None:
        raise PlacementError(f"cannot place the ranks: {problem}")


def _listed(resources: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in resources.items())


def _described(alive: list[dict]) -> str:
    """What each node has, as a user pins ranks with it (``ray start --resources``)."""
    if not alive:
        return "the cluster has no alive node"
    parts = []
    for n in alive:
        own = {k: v for k, v in n["Resources"].items() if not k.startswith(_BUILT_IN)}
        parts.append(f"{n.get('NodeManagerAddress', '?')}: {_listed(own) or 'nothing'}")
    return "the nodes have " + "; ".join(parts)
