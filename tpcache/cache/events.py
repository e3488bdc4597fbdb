"""KV events in the format vLLM's KV-event subscribers (and Dynamo's router) read.

A batch is encoded as an array ``[ts, events, data_parallel_rank]``; each event is a map
tagged by ``"type"`` with the class name. Hashes are unsigned 64-bit ints.
"""

from __future__ import annotations

import msgspec


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


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode a payload; raises ``msgspec.DecodeError`` (or ValidationError) if malformed."""
    return _decoder.decode(payload)
