"""``BlockIndex.cached_prefix``: what a router following the events predicts a request
finds cached: whole blocks of one chain from a root, in the request's namespace, on one
medium, never the last token."""

from __future__ import annotations

from tpcache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from tpcache.events.block_index import BlockIndex


def _index() -> BlockIndex:
    ix = BlockIndex()
    ix.apply_all(
        [
            BlockStored([11, 12], None, list(range(1, 9)), 4),  # 1..4, 5..8
            BlockStored([13], 12, [9, 10, 11, 12], 4),  # 9..12 after them
            BlockStored([21], None, [1, 2, 3, 4], 4, namespace="00000000000000aa"),
            BlockStored([31], None, [7, 7, 7, 7], 4, medium="CPU"),
        ]
    )
    return ix


def test_whole_blocks_of_one_chain_and_never_the_last_token() -> None:
    ix = _index()
    assert ix.cached_prefix(list(range(1, 14))) == 12
    assert ix.cached_prefix(list(range(1, 13))) == 8  # the 12th token is the last: computed
    assert ix.cached_prefix([1, 2, 3, 4, 5, 6, 9, 9, 9]) == 4  # the second block differs
    assert ix.cached_prefix([5, 6, 7, 8, 9]) == 0  # not from a root
    assert ix.cached_prefix([]) == 0 and ix.cached_prefix([1, 2, 3, 4]) == 0


def test_namespace_and_medium_keep_chains_apart() -> None:
    ix = _index()
    tokens = [1, 2, 3, 4, 5]
    assert ix.cached_prefix(tokens, namespace="00000000000000aa") == 4
    assert ix.cached_prefix(tokens, namespace="00000000000000bb") == 0
    assert ix.cached_prefix([7, 7, 7, 7, 7]) == 0
    assert ix.cached_prefix([7, 7, 7, 7, 7], medium="CPU") == 4


def test_removed_and_cleared_blocks_are_no_longer_predicted() -> None:
    ix = _index()
    ix.apply(BlockRemoved([12]))
    assert ix.cached_prefix(list(range(1, 14))) == 4  # the chain breaks at 5..8
    ix.apply(AllBlocksCleared())
    assert ix.cached_prefix(list(range(1, 14))) == 0
