"""Bad input found by trying to break it (#20 items 3-7): ids, priorities and counts the op
log cannot carry, id subclasses, forged and foreign handles, token containers numpy cannot
read, and outputs longer than a request's KV. Each is refused with a typed error before any
state changes (or, for subclass ids, taken as the plain value), on the single-process
caches and on a TP=2 group of in-process ranks (real gloo)."""

from __future__ import annotations

import enum

import numpy as np
import pytest
import torch

from tpcache.cache.errors import (
    CacheError,
    InvalidTokens,
    LockError,
    UnknownHandle,
    UnknownRequest,
)
from tpcache.cache.radix import CacheConfig, Handle, RadixCache
from tpcache.cache.swa.cache import HybridCache
from tpcache.cache.swa.config import HybridConfig, SwaHandle
from tpcache.coordinator.build import GroupConfig
from tpcache.coordinator.local_ranks import start_local_group
from tpcache.lockstep.ops import decode_step, unpack_tokens
from tpcache.workers.spec import CacheSpec

PROMPT = list(range(100, 130))


def base() -> RadixCache:
    return RadixCache(CacheConfig(256, 4))


def hybrid() -> HybridCache:
    return HybridCache(HybridConfig(256, 128, 8, 4))


def state(c) -> tuple:
    return (c.digest(), c.sizes(), c.running_ids())


@pytest.fixture(scope="module")
def coord():
    cfg = GroupConfig(
        tp=2,
        capacity_tokens=512,
        cache=CacheSpec(page_size=4, max_request_tokens=256),
        num_layers=1,
        kv_heads=2,
        head_dim=4,
        dtype="float32",
        cpu_budget_bytes=1 << 22,
        timeout_s=20.0,
    )
    c = start_local_group(cfg)
    yield c
    c.close()


def _group_state(coord) -> tuple:
    coord.sync()
    return (coord.mirror.digest(), coord.stats()["steps_done"], coord.ranks.call("digest"))


BAD_IDS = [2**64, -(2**63) - 1, 2**70, "\ud800", "", "x" * 257, True, 1.5, None, b"r", ("a",)]


@pytest.mark.parametrize("make", [base, hybrid])
@pytest.mark.parametrize("rid", BAD_IDS, ids=repr)
def test_a_cache_refuses_ids_the_op_log_cannot_carry(make, rid) -> None:
    c = make()
    before = state(c)
    with pytest.raises(CacheError):
        c.admit(rid, PROMPT)
    assert state(c) == before


@pytest.mark.parametrize("rid", BAD_IDS, ids=repr)
def test_the_coordinator_refuses_them_before_its_mirror_changes(coord, rid) -> None:
    before = _group_state(coord)
    with pytest.raises(CacheError):
        coord.admit(rid, PROMPT)
    assert _group_state(coord) == before
    assert coord.broken is None


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.admit("p", PROMPT, priority=2**70),
        lambda c: c.admit("p", PROMPT, priority=-(2**63) - 1),
        lambda c: c.admit("p", PROMPT, reserve=2**70),
        lambda c: c.evict(2**70),
        lambda c: c.evict(-1),
        lambda c: c.evict(4, 4),  # an SWA part on a cache without an SWA pool
        lambda c: c.extend(2**70, 1),
        lambda c: c.finish("\udfff"),
    ],
    ids=["prio-big", "prio-small", "reserve", "evict-big", "evict-neg", "evict-swa", "ext", "fin"],
)
def test_numbers_the_op_log_cannot_carry_are_refused_first(coord, call) -> None:
    before = _group_state(coord)
    with pytest.raises(CacheError):
        call(coord)
    assert _group_state(coord) == before
    # The group goes on: the next step is numbered right on every rank.
    coord.admit("after", PROMPT)
    coord.finish("after")
    coord.sync()
    assert coord.stats()["divergences"] == 0 and coord.broken is None


class Rid(enum.IntEnum):
    SEVEN = 7


@pytest.mark.parametrize("make", [base, hybrid])
def test_subclass_ids_are_known_by_their_plain_value(make) -> None:
    c = make()
    c.admit(np.str_("a"), PROMPT)
    c.admit(Rid.SEVEN, [*PROMPT, 5])
    assert c.running_ids() == ["a", 7]
    assert type(c.running_ids()[0]) is str and type(c.running_ids()[1]) is int
    c.extend(np.str_("a"), 3)
    c.check_integrity()
    assert c.finish(np.str_("a")) == 28  # whole pages of the 30-token prompt
    c.abort(7)
    c.check_integrity()
    assert c.sizes().held == 0 and c.running_ids() == []
    with pytest.raises(UnknownRequest):
        c.finish("a")


def test_subclass_ids_through_the_group(coord) -> None:
    got = coord.admit(np.str_("np"), PROMPT)
    assert got.prefix_len >= 0
    coord.extend(np.str_("np"), 2)
    coord.finish(np.str_("np"), [1, 2])
    coord.admit(Rid.SEVEN, PROMPT)
    coord.abort(7)
    coord.sync()
    coord.mirror.check_integrity()
    assert coord.stats()["divergences"] == 0
    assert set(coord.ranks.call("digest")) == {coord.mirror.digest()}


def _locked_hybrid() -> tuple[HybridCache, SwaHandle]:
    c = hybrid()
    c.admit("x", PROMPT)
    c.finish("x")
    return c, c.match_prefix(PROMPT).handle


def test_a_forged_swa_boundary_is_refused() -> None:
    """The issue's case: SwaHandle(node, 0) locked an unmarked node as its own boundary."""
    c, h = _locked_hybrid()
    before = state(c)
    for mark in (0, -1, h.swa_boundary + 999):
        forged = SwaHandle(h.node_id, h.owner, mark)
        with pytest.raises(LockError):
            c.lock(forged)
        with pytest.raises(LockError):
            c.unlock(forged)
    assert state(c) == before
    c.match_prefix(PROMPT)
    c.check_integrity()


@pytest.mark.parametrize("make", [base, hybrid])
def test_foreign_stale_and_malformed_handles_are_refused(make) -> None:
    a, b = make(), make()
    for c in (a, b):
        c.admit("x", PROMPT)
        c.finish("x")
    ha, hb = a.match_prefix(PROMPT).handle, b.match_prefix(PROMPT).handle
    assert (ha.node_id, type(ha)) == (hb.node_id, type(hb))
    before = state(a)
    kind = type(ha)
    extra = (ha.swa_boundary,) if kind is SwaHandle else ()
    bad = [
        hb,  # another cache's, naming a node this one has too
        kind(True, ha.owner, *extra),
        kind(np.int64(ha.node_id), ha.owner, *extra),
        kind([1], ha.owner, *extra),
        "handle",
        None,
    ]
    if kind is SwaHandle:
        bad.append(Handle(ha.node_id, ha.owner))  # the base kind on a hybrid cache
    for h in bad:
        with pytest.raises(UnknownHandle):
            a.lock(h)
        with pytest.raises(UnknownHandle):
            a.unlock(h)
    assert state(a) == before
    a.lock(ha)
    a.unlock(ha)
    a.reset()  # a new generation: the old handle names nothing now
    with pytest.raises(UnknownHandle):
        a.lock(ha)
    a.check_integrity()


UNREADABLE = {
    "bf16": lambda: torch.tensor(PROMPT, dtype=torch.bfloat16),
    "float": lambda: torch.tensor(PROMPT, dtype=torch.float32),
    "bool": lambda: torch.ones(4, dtype=torch.bool),
    "meta": lambda: torch.tensor(PROMPT, device="meta"),
    "sparse": lambda: torch.tensor(PROMPT).to_sparse(),
    "masked": lambda: np.ma.array(PROMPT, mask=[i == 3 for i in range(len(PROMPT))]),
    "2-D tensor": lambda: torch.tensor([PROMPT]),
    "bad __array__": lambda: _Bad(),
}


class _Bad:
    def __array__(self, *a, **k):
        raise RuntimeError("no")


@pytest.mark.parametrize("make", [base, hybrid])
@pytest.mark.parametrize("name", list(UNREADABLE))
def test_token_containers_that_cannot_be_read_are_invalid_tokens(make, name) -> None:
    c = make()
    c.admit("r", PROMPT)
    before = state(c)
    tokens = UNREADABLE[name]()
    for call in (
        lambda: c.admit("n", tokens),
        lambda: c.match_prefix(tokens),
        lambda: c.finish("r", tokens),
    ):
        with pytest.raises(InvalidTokens):
            call()
    assert state(c) == before


def test_a_torch_size_is_a_sequence_of_ints(coord) -> None:
    c = base()
    got = c.admit("s", torch.Size(PROMPT))
    assert got.num_tokens == len(PROMPT)
    got = coord.admit("size", torch.Size(PROMPT))
    coord.finish("size")
    coord.sync()


def test_only_output_tokens_with_kv_travel_to_the_ranks(coord) -> None:
    """A finish with 200,000 output tokens on a request holding 2 output slots sends the
    ranks 2 tokens, and caches the same as a finish with those 2."""
    sent: list[bytes] = []
    send = coord.ranks.send

    def spy(steps: list[bytes]):
        sent.extend(steps)
        return send(steps)

    coord.ranks.send = spy  # a recording wrapper around the real transport
    try:
        coord.admit("long", PROMPT[:10], reserve=2)
        n = coord.finish("long", np.arange(1, 200_001))
        coord.sync()
    finally:
        del coord.ranks.send
    assert n == 12
    finishes = [
        op for data in sent for op in decode_step(data).ops if type(op).__name__ == "Finish"
    ]
    assert [unpack_tokens(op.output).tolist() for op in finishes] == [[1, 2]]
    assert coord.stats()["divergences"] == 0
    # Every output token is still checked.
    coord.admit("bad", PROMPT[:10], reserve=2)
    with pytest.raises(InvalidTokens):
        coord.finish("bad", [1, 2, 3, -4])
    coord.abort("bad")
    coord.sync()


def test_a_batch_with_one_malformed_call_applies_none_of_it(coord) -> None:
    """#20 item 8: the batch's first call was applied, then an untyped error came back."""
    from tpcache.frontend import api
    from tpcache.frontend.frontend import handle, handle_many

    before = _group_state(coord)
    good = api.encode(api.AdmitCall("L1", list(range(1, 50))))
    for bad in (5, None, "str", b"\x91\xc1", api.encode(api.ExtendCall("x", -1))[:-1]):
        replies = [api.decode_reply(r) for r in handle_many(coord, [good, bad])]
        assert len(replies) == 2
        assert all(isinstance(r, api.ErrorReply) and r.error == "BadRequest" for r in replies)
        assert "call 1" in replies[0].message and "none applied" in replies[0].message
        assert _group_state(coord) == before
    for bad in ("str", 5, None, [good], {"call": "stats"}):  # not one encoded call
        reply = api.decode_reply(handle(coord, bad))
        assert isinstance(reply, api.ErrorReply) and reply.error == "BadRequest", reply
    for bad in ("str", 5, None, {"call": "stats"}):  # not a list of calls
        (reply,) = [api.decode_reply(r) for r in handle_many(coord, bad)]
        assert isinstance(reply, api.ErrorReply) and reply.error == "BadRequest", reply
    assert _group_state(coord) == before
    # A well-formed batch whose second call the cache refuses: the first applies.
    replies = [
        api.decode_reply(r)
        for r in handle_many(coord, [good, api.encode(api.FinishCall("nobody"))])
    ]
    assert isinstance(replies[0], api.AdmitReply)
    assert isinstance(replies[1], api.ErrorReply) and replies[1].error == "UnknownRequest"
    coord.abort("L1")
    coord.sync()


def test_a_pool_too_large_for_memory_is_an_allocator_error() -> None:
    """A capacity no machine holds (a typo'd ``--capacity`` or ``--host-capacity``) is
    refused with a typed error naming the pool, not a bare MemoryError; the replay says
    so and fails."""
    import subprocess
    import sys

    from tpcache.cache.errors import AllocatorError
    from tpcache.cache.host.cache import HostCache, HostConfig

    huge = 10**14
    with pytest.raises(AllocatorError, match="does not fit in this machine's memory"):
        RadixCache(CacheConfig(huge, 16))
    with pytest.raises(AllocatorError, match="does not fit"):
        HostCache(HostConfig(1024, 16, "lru", host_capacity_tokens=huge))
    out = subprocess.run(
        [sys.executable, "-m", "tpcache", "replay", "--limit", "3", "--capacity", "4000000",
         "--host-capacity", str(huge)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0 and "AllocatorError" in out.stderr and "Traceback" not in out.stderr
