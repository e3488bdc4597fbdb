"""The request calls shared by every client (``frontend/calls.py``): what each call
builds, how a batch hands replies back, and a reply of the wrong kind refused."""

from __future__ import annotations

import numpy as np
import pytest

from tpcache.cache.errors import UnknownRequest
from tpcache.frontend import api
from tpcache.frontend.calls import Batch, RequestCalls, UnexpectedReply, checked, ints


class Recorder(RequestCalls[object, object, object, object]):
    def __init__(self) -> None:
        self.sent: list[tuple[api.Call, type | None]] = []

    def _send(self, call, reply_type):
        self.sent.append((call, reply_type))
        return len(self.sent)


def test_each_call_builds_its_record_with_the_reply_it_expects() -> None:
    r = Recorder()
    r.admit("a", np.array([1, 2, 3], dtype=np.int32), 2, 5, lora_id=7)
    r.extend("a", 4)
    r.cache_unfinished("a", (1, 2))
    r.finish("a", [9])
    r.abort("a")
    calls = [c for c, _ in r.sent]
    assert calls == [
        api.AdmitCall("a", [1, 2, 3], 2, 5, lora_id=7),
        api.ExtendCall("a", 4),
        api.CacheUnfinishedCall("a", [1, 2]),
        api.FinishCall("a", [9]),
        api.AbortCall("a"),
    ]
    kinds = [t for _, t in r.sent]
    assert kinds == [api.AdmitReply, api.SlotsReply, api.CachedReply, api.CachedReply, None]
    assert all(type(t) is int for t in calls[0].tokens)  # numpy ints would not encode


def test_a_batch_hands_each_call_its_own_reply_or_error() -> None:
    b = Batch(checked)
    a = b.admit("a", [1, 2])
    e = b.extend("b", 1)
    f = b.finish("a")
    with pytest.raises(RuntimeError, match="not been sent"):
        a.result()
    err = api.ErrorReply("UnknownRequest", "no request 'b'")
    b.settle([api.AdmitReply(0, [4, 5]), err, api.CachedReply(2)])
    assert a.result() == api.AdmitReply(0, [4, 5])
    with pytest.raises(UnknownRequest):
        e.result()
    assert f.result() == api.CachedReply(2)
    other = Batch(checked)  # each call is checked against the reply kind it expects
    wrong = other.finish("a")
    other.settle([api.SlotsReply([1])])
    with pytest.raises(UnexpectedReply, match=r"expected a CachedReply.*SlotsReply"):
        wrong.result()
    with pytest.raises(ValueError):  # one reply per call, no fewer
        Batch(checked).settle([api.CachedReply(1)])


def test_a_reply_of_the_wrong_kind_is_a_typed_error() -> None:
    with pytest.raises(UnexpectedReply, match=r"expected a SlotsReply.*CachedReply"):
        checked(api.CachedReply(1), api.SlotsReply)
    assert checked(api.OkReply(), None) is None
    with pytest.raises(UnknownRequest, match="no request 'b'"):  # an error beats the type
        checked(api.ErrorReply("UnknownRequest", "no request 'b'"), api.SlotsReply)


def test_tokens_of_any_int_sequence_become_python_ints() -> None:
    for tokens in (range(3), np.arange(3), (np.int64(0), np.int32(1), 2), [0, 1, 2]):
        got = ints(tokens)
        assert got == [0, 1, 2] and all(type(t) is int for t in got), tokens
