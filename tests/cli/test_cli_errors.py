"""What the errors a frontend or a command prints say: the cache's
KeyError-based errors print their message as it was written, not repr-quoted (a client
that re-raised ``UnknownRequest`` used to show ``'"no running request \\'nope\\'"'``)."""

from __future__ import annotations

import pytest

from tpcache.cache import CacheConfig, RadixCache
from tpcache.cache.errors import CacheError, UnknownHandle, UnknownRequest
from tpcache.frontend import api


def test_unknown_request_and_handle_print_their_message_once_quoted() -> None:
    cache = RadixCache(CacheConfig(capacity_tokens=64, page_size=1))
    with pytest.raises(UnknownRequest) as got:
        cache.finish("nope")
    assert str(got.value) == "no running request 'nope'"
    assert isinstance(got.value, KeyError)  # still a KeyError for callers that catch one
    assert str(UnknownHandle("handle 7 is gone")) == "handle 7 is gone"


def test_the_message_survives_a_trip_through_an_error_reply() -> None:
    """As a client raises it: the reply carries str(exc), the client rebuilds the type."""
    cache = RadixCache(CacheConfig(capacity_tokens=64, page_size=1))
    with pytest.raises(CacheError) as got:
        cache.finish("nope")
    reply = api.ErrorReply(type(got.value).__name__, str(got.value))
    with pytest.raises(UnknownRequest) as again:
        api.raise_reply_error(api.decode_reply(api.encode(reply)))
    assert str(again.value) == "no running request 'nope'"
