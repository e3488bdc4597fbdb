"""KV events in vLLM's KV-event layout, in one of two encodings.

A batch is always an array ``[ts, events, data_parallel_rank]`` (vLLM's ``EventBatch``
keeps ``array_like``). Each event is tagged with its class name and encoded

- ``"map"`` (the default; current vLLM's form): a map with the tag under ``"type"``.
  vLLM switched its events from arrays to maps in its pull request #42892 (merged
  2026-06-09, after v0.23.0; a stream captured from v0.26.0 has maps), and its current
  ``msgspec`` structs reject arrays. The fields vLLM requires are always written
  (``lora_id``, ``medium``, ``lora_name`` even when None); the optional ones only when
  set, as vLLM's ``omit_defaults`` does. A map decoder ignores fields it does not know,
  which is how tpcache's extension (``namespace``) reaches routers without breaking
  vLLM's decoder.
- ``"array"`` (vLLM up to v0.23): an array ``[tag, field, ...]`` in vLLM's field order,
  up to ``lora_name``. A decoder that knows fewer fields (a vLLM before ``lora_name`` or
  ``medium``) ignores the trailing ones. Extensions are left out: a position past
  ``lora_name`` means another field (``extra_keys``) to the vLLM versions that have one.

``decode_batch`` reads both. Hashes are unsigned 64-bit ints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from tpcache.cache.errors import UnknownName

if TYPE_CHECKING:
    from tpcache.cache.namespace import CacheNamespace


class BlockStored(msgspec.Struct, tag=True, tag_field="type", frozen=True):
    """Blocks whose KV is cached. ``namespace`` (tpcache's extension, not vLLM's): None
    for the default namespace, else an opaque id (16 hex digits) of the cache namespace
    (a LoRA adapter, a tenant's salt) whose hash chain the blocks belong to. Blocks of a
    namespace never match a request of another, whatever their tokens; the salt itself
    is never announced."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    namespace: str | None = None


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


# The "map" encoding's twins: vLLM's required fields have no default (always written),
# optional ones are omitted while unset.
class _StoredMap(msgspec.Struct, omit_defaults=True, tag="BlockStored", tag_field="type"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    namespace: str | None = None


class _RemovedMap(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[int]
    medium: str | None


class _BatchMap(msgspec.Struct, array_like=True):
    ts: float
    events: list[_StoredMap | _RemovedMap | AllBlocksCleared]
    data_parallel_rank: int | None = None


# The "array" encoding's twins of the event structs, vLLM's fields in vLLM's order.
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


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_array_decoder = msgspec.msgpack.Decoder(_BatchArray)


def check_encoding(encoding: object) -> str:
    """``encoding`` if it is one of ``ENCODINGS``; else raises ``UnknownName``."""
    if not isinstance(encoding, str) or encoding not in ENCODINGS:
        raise UnknownName(f"unknown event encoding {encoding!r}; one of {ENCODINGS}")
    return encoding


def _to_map(e: KVEvent) -> _StoredMap | _RemovedMap | AllBlocksCleared:
    match e:
        case BlockStored():
            return _StoredMap(*msgspec.structs.astuple(e))
        case BlockRemoved():
            return _RemovedMap(e.block_hashes, e.medium)
    return e


def _to_array(e: KVEvent) -> _StoredArray | _RemovedArray | _ClearedArray:
    match e:
        case BlockStored():
            return _StoredArray(*msgspec.structs.astuple(e)[:7])
        case BlockRemoved():
            return _RemovedArray(e.block_hashes, e.medium)
    return _ClearedArray()


def encode_batch(batch: KVEventBatch, encoding: str = "map") -> bytes:
    """``batch`` as msgpack, its events as maps or as arrays (see the module doc).
    Raises ``UnknownName`` for another encoding."""
    if check_encoding(encoding) == "map":
        events = [_to_map(e) for e in batch.events]
        return _encoder.encode(_BatchMap(batch.ts, events, batch.data_parallel_rank))
    arrays = [_to_array(e) for e in batch.events]
    return _encoder.encode(_BatchArray(batch.ts, arrays, batch.data_parallel_rank))


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
    events: list[KVEvent] = []
    for e in got.events:
        match e:
            case _StoredArray():
                events.append(BlockStored(*msgspec.structs.astuple(e)))
            case _RemovedArray():
                events.append(BlockRemoved(e.block_hashes, e.medium))
            case _:
                events.append(AllBlocksCleared())
    return KVEventBatch(got.ts, events, got.data_parallel_rank)


def namespace_id(space: CacheNamespace | None) -> str | None:
    """What ``BlockStored.namespace`` says of ``space``: None for the default namespace,
    else its hash chain's seed in 16 hex digits (an id, from which a short salt could
    be guessed by trial: events go only to the operator's routers, who read prompts)."""
    return None if space is None else f"{space.seed:016x}"


def stored_event(
    hashes: list[int],
    parent: int | None,
    tokens: list[int],
    block_size: int,
    medium: str | None,
    space: CacheNamespace | None,
) -> BlockStored:
    """The ``BlockStored`` of blocks in namespace ``space`` (None: the default one)."""
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=block_size,
        lora_id=None if space is None else space.lora_id,
        medium=medium,
        lora_name=None if space is None else space.lora_name,
        namespace=namespace_id(space),
    )
