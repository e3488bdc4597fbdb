"""torchrun: rank 0 leads, the other ranks follow (the transport when there is no
coordinator process: ``tpcache.torchrun``).

Under torchrun rank 0 drives the others with ``Command``s (``lead_command`` / ``follow``):
it broadcasts each command (length, then bytes); every rank runs it in the same order:
``RunStep`` applies a step exactly as a Ray rank's ``apply`` does (``lockstep.py``'s collectives);
``RunCall`` runs a ``RankWorker`` method (``forward`` enters the model's all-reduces),
then every rank's reply is gathered on every rank (one broadcast per rank, in rank
order), failures included, so a rank that failed still enters the gather; ``Stop`` ends
the loop. A command never depends on local state to decide which collectives it enters.
"""

from __future__ import annotations

import contextlib

from tpcache.lockstep.errors import LockstepError, UnknownOp, WhereError
from tpcache.lockstep.ops import (
    CallReply,
    Command,
    RunCall,
    RunStep,
    Stop,
    decode_command,
    decode_reply,
    encode,
)
from tpcache.transport.channel_loop import BadChannelMessage
from tpcache.workers.protocol import Agreement


class PeerCallError(WhereError):
    """A ``RunCall`` failed on rank ``rank`` (its error text travels; not its type)."""

    _fields = ("rank", "detail")

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"rank {rank}", message)
        self.rank = rank


def broadcast_command(group: Agreement, cmd: Command | None, src: int = 0) -> Command:
    """``src`` sends ``cmd`` (length, then bytes); every rank returns it decoded."""
    return decode_command(group.broadcast_bytes(encode(cmd) if cmd is not None else None, src))


def run_command(worker, cmd: Command, rank: int):
    """Run ``cmd`` on this rank's ``worker`` (a ``RankWorker``); returns its value, raises
    what it raised. ``RunStep`` goes through ``worker.apply``, hence ``apply_step``."""
    match cmd:
        case RunStep(data):
            return worker.apply(data)
        case RunCall(method, args, only):
            if only is not None and only != rank:
                return None
            if method.startswith("_"):
                raise BadChannelMessage(f"{method!r} is not a public RankWorker method")
            return getattr(worker, method)(*args)
    raise UnknownOp(f"cannot run {cmd!r}")


def gather_replies(group: Agreement, mine: CallReply, world_size: int) -> list[CallReply]:
    """Every rank's reply, on every rank, in rank order (collective: one broadcast each)."""
    data = encode(mine)
    return [decode_reply(group.broadcast_bytes(data, src)) for src in range(world_size)]


def lead_command(group: Agreement, worker, cmd: Command, world_size: int) -> list:
    """Rank 0 (under torchrun): broadcast ``cmd``, run it here too, and for a ``RunCall``
    gather every rank's reply. Returns the values by rank (``RunStep``: this rank's only).

    Raises what this rank raised (for a call: after the gather, so peers never wait), or
    ``PeerCallError`` naming the first rank whose call failed.
    """
    broadcast_command(group, cmd)
    if not isinstance(cmd, RunCall):
        return [run_command(worker, cmd, 0)] if not isinstance(cmd, Stop) else []
    err: Exception | None = None
    try:
        mine = CallReply(True, run_command(worker, cmd, 0))
    except Exception as exc:
        err = exc
        mine = CallReply(False, error=f"{type(exc).__name__}: {exc}")
    replies = gather_replies(group, mine, world_size)
    if err is not None:
        raise err
    for rank, reply in enumerate(replies):
        if not reply.ok:
            raise PeerCallError(rank, reply.error)
    return [reply.value for reply in replies]


def follow(group: Agreement, worker, rank: int, world_size: int) -> int:
    """Ranks other than 0 (under torchrun): run rank 0's commands until ``Stop``.

    A failed step or call does not end the loop (its error reached rank 0 through the
    step's agreement or the reply gather); a broken group does, by raising. Returns the
    number of commands run.
    """
    count = 0
    while True:
        cmd = broadcast_command(group, None)
        if isinstance(cmd, Stop):
            return count
        count += 1
        if isinstance(cmd, RunCall):
            try:
                reply = CallReply(True, run_command(worker, cmd, rank))
            except Exception as exc:
                reply = CallReply(False, error=f"{type(exc).__name__}: {exc}")
            gather_replies(group, reply, world_size)
        else:
            # A LockstepError was raised on every rank together; rank 0 reports it.
            with contextlib.suppress(LockstepError):
                run_command(worker, cmd, rank)


__all__ = [
    "PeerCallError",
    "broadcast_command",
    "follow",
    "gather_replies",
    "lead_command",
    "run_command",
]
