"""How a rank comes into its TP group: joining one (``join_default_group``, behind
``TPGroup.init``) or taking an engine's own (``attached_backend``, behind
``TPGroup.attach``). The collectives on the group are ``group.py``'s.

Two timeouts. ``join_timeout_s`` bounds joining: the rendezvous of ``init``, which waits
for the slowest rank's process to start (a Ray worker importing torch takes seconds, tens
of seconds on a loaded machine, and a replacement rank during recovery starts only after
the failure). ``timeout_s`` bounds each collective, so a hung peer is found fast. One
timeout cannot do both: ``init_process_group(timeout=)`` also becomes the default group's
collective timeout. So ``init`` joins the default group with ``join_timeout_s`` and then
makes ``dist.new_group(timeout=timeout_s)`` over all ranks, which every collective here
uses; it meets on the already formed group's store, in milliseconds. (torch's private
``_set_pg_timeout`` on the default group works on torch 2.13 too, but it is private and
its gloo path was broken in some releases, pytorch#165422; ``new_group(timeout=)`` is
public and has bounded gloo collectives since torch 1.0.)
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tpcache.group.spec import (
    GroupError,
    GroupInputError,
    GroupSpec,
    check_seconds,
    loopback_only,
)

_PG_METHODS = ("allreduce", "broadcast", "allgather", "barrier", "rank", "size", "name")


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` means nccl for a CUDA device when CUDA is available, else gloo."""
    if backend != "auto":
        return backend
    return "nccl" if device.type == "cuda" and torch.cuda.is_available() else "gloo"


def join_default_group(spec: GroupSpec, device: torch.device) -> tuple[Any, str, torch.device]:
    """Join this process's default group and make the group every collective runs on
    (the module docstring says why two); returns it, its backend and the device its
    tensors live on. Raises as ``TPGroup.init`` says."""
    backend = resolve_backend(spec.backend, device)
    if backend == "nccl":
        if device.type != "cuda" or not torch.cuda.is_available():
            raise GroupError(f"nccl needs a CUDA device, got {device} ({spec.where})")
        comm_device = device
    else:
        comm_device = torch.device("cpu")
    if dist.is_initialized():
        raise GroupError(
            f"this process already has a process group ({spec.where}); "
            "hand its TP group to TPGroup.attach instead"
        )
    if backend == "nccl":
        torch.cuda.set_device(comm_device)
    try:
        local = loopback_only() if spec.store_path is not None else contextlib.nullcontext()
        with local:
            dist.init_process_group(
                backend,
                init_method=spec.init_method,
                rank=spec.rank,
                world_size=spec.world_size,
                # Bounds the store rendezvous, and would bound the default group's
                # collectives too: hence the second group below.
                timeout=timedelta(seconds=spec.join_timeout_s),
            )
            # Every rank is in by now, so this meets at once; its timeout is the one
            # every collective here runs under.
            pg = dist.new_group(timeout=timedelta(seconds=spec.timeout_s))
    except Exception as exc:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        raise GroupError(
            f"init of {backend} group failed for {spec.where} "
            f"(join timeout {spec.join_timeout_s:g}s): {first_line(exc)}"
        ) from exc
    return pg, backend, comm_device


def attached_backend(
    pg: Any, device: torch.device | None, timeout_s: float
) -> tuple[str, torch.device]:
    """The backend of ``pg``, a group the caller made and owns, and the device its
    tensors live on. Raises as ``TPGroup.attach`` says."""
    # A ProcessGroup, or a backend made directly (ProcessGroupGloo is no subclass).
    if not all(callable(getattr(pg, m, None)) for m in _PG_METHODS):
        raise GroupInputError(f"attach needs a torch.distributed process group, got {pg!r}")
    check_seconds("timeout_s", timeout_s)
    backend = str(pg.name()).lower()
    if backend not in ("gloo", "nccl"):
        raise GroupInputError(f"attach supports gloo and nccl groups, got {backend!r}")
    if backend == "nccl":
        if device is None or device.type != "cuda":
            raise GroupInputError(f"an nccl group needs a CUDA device, got {device}")
        return backend, device
    return backend, torch.device("cpu")


def first_line(exc: BaseException) -> str:
    # torch's distributed errors carry a C++ stack trace after the first line.
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
