"""KV events in vLLM's KV-event layout, in one of two encodings.

A batch is encoded as an array ``[ts, events, data_parallel_rank]``. Each event is
tagged with its class name, and encoded

- ``"map"`` (DESIGN.md's form, the default): a map with the tag under ``"type"``;
- ``"array"`` (what vLLM itself sends, and what its subscriber's structs decode, which
  reject maps): an array ``[tag, field, ...]`` in field order. A decoder that knows
  fewer fields (an older vLLM's, without ``lora_name``) ignores the trailing ones.

``decode_batch`` reads both. Hashes are unsigned 64-bit ints.
"""

from __future__ import annotations

import msgspec

from tpcache.cache.errors import UnknownName


class BlockStored(msgspec.Struct, tag=True, tag_field="type", frozen=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, tag_field="type", frozen=True):
    block_hashes: list[int]
    medium: str | None = "GPU"


class AllBlocksCleared(msgspec.Struct, tag=True, tag_field="type", frozen=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, frozen=True):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


ENCODINGS = ("map", "array")


# The "array" encoding's twins of the event structs, field for field.
class _ArrayEvent(msgspec.Struct, array_like=True, tag=True, frozen=True):
    pass


class _StoredArray(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class _RemovedArray(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class _ClearedArray(_ArrayEvent, tag="AllBlocksCleared"):
    pass


class _BatchArray(msgspec.Struct, array_like=True, frozen=True):
    ts: float
    events: list[_StoredArray | _RemovedArray | _ClearedArray]
    data_parallel_rank: int | None = None


_TO_ARRAY: dict[type, type] = {
    BlockStored: _StoredArray,
    BlockRemoved: _RemovedArray,
    AllBlocksCleared: _ClearedArray,
}
_FROM_ARRAY: dict[type, type] = {v: k for k, v in _TO_ARRAY.items()}
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_array_decoder = msgspec.msgpack.Decoder(_BatchArray)


def encode_batch(batch: KVEventBatch, encoding: str = "map") -> bytes:
    """``batch`` as msgpack, its events as maps or as arrays (see the module doc)."""
    if encoding == "map":
        return _encoder.encode(batch)
    if encoding != "array":
        raise UnknownName(f"unknown event encoding {encoding!r}; one of {ENCODINGS}")
    events = [_TO_ARRAY[type(e)](*msgspec.structs.astuple(e)) for e in batch.events]
    return _encoder.encode(_BatchArray(batch.ts, events, batch.data_parallel_rank))


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode a payload in either encoding; raises ``msgspec.DecodeError`` (or
    ``ValidationError``) if it is neither."""
    try:
        return _decoder.decode(payload)
    except msgspec.ValidationError as as_map:
        try:
            got = _array_decoder.decode(payload)
        except msgspec.ValidationError:
            raise as_map from None
    events = [_FROM_ARRAY[type(e)](*msgspec.structs.astuple(e)) for e in got.events]
    return KVEventBatch(got.ts, events, got.data_parallel_rank)
