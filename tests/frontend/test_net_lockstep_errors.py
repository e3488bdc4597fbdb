"""A lockstep error raised through the network client carries its step as a field
(``ErrorReply.step``), not only in its message: a client catching ``RankFailure`` or
``DivergenceError`` reads ``.step``. On a TP=2 group of in-process ranks (real gloo) and
real ZMQ; and the field's schema evolution both ways."""

from __future__ import annotations

import threading

import msgspec
import pytest
from drill_worker import DrillWorker

from tpcache.client import NetworkClient
from tpcache.coordinator.build import GroupConfig
from tpcache.coordinator.core import CoordinatorConfig
from tpcache.coordinator.local_ranks import start_local_group
from tpcache.frontend import api
from tpcache.frontend.frontend import serve_network
from tpcache.frontend.netfront import FrontendConfig
from tpcache.lockstep.errors import DivergenceError, RankFailure
from tpcache.workers.spec import CacheSpec

PROMPT = list(range(1, 41))


@pytest.fixture()
def served():
    """One message in flight, one step a message: a step's result is checked when the
    next step is sent, so the failure of the step a call made reaches the next call."""
    cfg = GroupConfig(
        tp=2,
        capacity_tokens=1024,
        cache=CacheSpec(page_size=4, max_request_tokens=256),
        num_layers=1,
        kv_heads=2,
        head_dim=4,
        dtype="float32",
        cpu_budget_bytes=1 << 20,
        timeout_s=20.0,
        coordinator=CoordinatorConfig(auto_recover=False, max_inflight=1, coalesce=1),
    )
    coord = start_local_group(cfg, worker_cls=DrillWorker)
    lock = threading.Lock()
    front = serve_network(coord, FrontendConfig(endpoint="tcp://127.0.0.1:*"), lock)
    yield coord, front, lock
    front.close()
    coord.close()


def next_step(coord, lock) -> int:
    """The number the next step gets, once every step before it is checked."""
    with lock:
        coord.sync()
        return coord.stats()["steps_sent"]


def test_a_rank_failure_through_the_network_client_has_its_step(served) -> None:
    coord, front, lock = served
    with NetworkClient(front.endpoint) as c:
        c.admit("a", PROMPT)
        c.finish("a")
        step = next_step(coord, lock)
        assert step > 0  # not a step number that could be mistaken for a default
        coord.ranks.workers[1].inject_fault(step, "fail")  # the next step's first op
        c.admit("b", [*range(500, 540)])  # step `step`: sent, not yet checked
        with pytest.raises(RankFailure) as caught:
            c.admit("c", [*range(700, 740)])  # sending its step checks the one before
    err = caught.value
    why = "rank 1 failed at op 0 (Admit): RuntimeError: planted failure (fault drill)"
    assert (err.step, err.detail, str(err)) == (step, why, f"step {step}: {why}")
    assert err.retryable


def test_a_divergence_through_the_network_client_has_its_step(served) -> None:
    coord, front, lock = served
    with NetworkClient(front.endpoint) as c:
        c.admit("a", PROMPT)
        c.finish("a")
        step = next_step(coord, lock)
        coord.ranks.call("inject_fault", step, "corrupt")  # every rank, the same tamper
        c.admit("b", [*PROMPT, 7])  # ranks match a shorter prefix than the mirror
        with pytest.raises(DivergenceError) as caught:
            c.admit("c", [*range(700, 740)])
    err = caught.value
    assert err.step == step
    assert str(err) == (
        f"step {step}: rank(s) [0, 1] differ from the coordinator's mirror after step {step}"
    )
    assert err.retryable


def test_the_reply_carries_the_step_and_other_errors_none() -> None:
    failure = RankFailure(12, "rank 0 failed: ChannelError: hung", local=True)
    reply = api.decode_reply(api.encode(api.error_reply(failure)))
    assert reply == api.ErrorReply(
        "RankFailure", "step 12: rank 0 failed: ChannelError: hung", True, 12
    )
    diverged = api.decode_reply(api.encode(api.error_reply(DivergenceError(0, "x", (1,)), False)))
    assert (diverged.error, diverged.step, diverged.retryable) == ("DivergenceError", 0, False)
    with pytest.raises(DivergenceError) as caught:
        api.raise_reply_error(diverged)
    assert (caught.value.step, str(caught.value)) == (0, "step 0: x")
    busy = api.error_reply(api.Busy("full"))
    assert (busy.step, busy.retryable) == (None, True)


class _OldErrorReply(msgspec.Struct, tag_field="reply", tag="error", frozen=True):
    """``ErrorReply`` as it was before ``step``."""

    error: str
    message: str
    retryable: bool = False


def test_a_reply_without_the_step_still_decodes_and_an_old_client_reads_a_new_one() -> None:
    old = msgspec.msgpack.encode(_OldErrorReply("RankFailure", "step 3: rank 1 died", True))
    reply = api.decode_reply(old)
    assert reply == api.ErrorReply("RankFailure", "step 3: rank 1 died", True, None)
    with pytest.raises(RankFailure) as caught:
        api.raise_reply_error(reply)
    assert (caught.value.step, str(caught.value)) == (-1, "step -1: step 3: rank 1 died")
    new = api.encode(api.error_reply(RankFailure(3, "rank 1 died")))
    assert msgspec.msgpack.decode(new, type=_OldErrorReply) == _OldErrorReply(
        "RankFailure", "step 3: rank 1 died", True
    )
