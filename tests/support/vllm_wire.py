"""The structs of vLLM's KV-event subscriber, written from its published layout (each
event an array ``[type, field, ...]``; its BlockStored has no ``lora_name``), not from
tpcache's classes: what the "array" encoding must satisfy. Module level, as msgspec
resolves the annotations by name."""

from __future__ import annotations

import msgspec


class VEvent(msgspec.Struct, array_like=True, tag=True):
    pass


class VStored(VEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VRemoved(VEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class VCleared(VEvent, tag="AllBlocksCleared"):
    pass


class VBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[VStored | VRemoved | VCleared]
    data_parallel_rank: int | None = None


VLLM_WIRE = msgspec.msgpack.Decoder(VBatch)
