"""Decoders of vLLM's KV-event payloads, written from vLLM's published layout (its
``vllm/distributed/kv_events.py``), not from tpcache's classes: what each of tpcache's
encodings must satisfy. Module level, as msgspec resolves the annotations by name.

- ``VLLM_WIRE``: current vLLM (after its pull request #42892). The batch is still an
  array ``[ts, events, data_parallel_rank]``; each event is a map tagged ``"type"``.
  Fields without a default are required; unknown fields are ignored (msgspec's default),
  and an unknown ``type`` fails. ``extra_keys`` entries are vLLM's typed keys, each a
  map tagged ``"type"`` (``lora``, ``cache_salt``, ``prompt_embeds``, ``mm``,
  ``legacy``).
- ``VLLM_ARRAY_WIRE``: vLLM up to v0.23, every event an array ``[type, field, ...]``
  (this one knows ``medium`` but not ``lora_name``: trailing fields are ignored).
"""

from __future__ import annotations

from typing import Any

import msgspec


class VKey(msgspec.Struct, tag=True):
    pass


class VLoraKey(VKey, tag="lora"):
    name: str


class VSaltKey(VKey, tag="cache_salt"):
    salt: str


class VEmbedsKey(VKey, tag="prompt_embeds"):
    hash: bytes


class VMediaKey(VKey, tag="mm"):
    modality: str
    hash: str
    block_offset: int


class VLegacyKey(VKey, tag="legacy"):
    value: Any


class VEvent(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class VStored(VEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    event_version: int = 1
    extra_keys: (
        list[tuple[VLoraKey | VSaltKey | VEmbedsKey | VMediaKey | VLegacyKey, ...] | None] | None
    ) = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VRemoved(VEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VCleared(VEvent, tag="AllBlocksCleared"):
    pass


class VBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[VStored | VRemoved | VCleared]
    data_parallel_rank: int | None = None


VLLM_WIRE = msgspec.msgpack.Decoder(VBatch)


class OldEvent(msgspec.Struct, array_like=True, tag=True):
    pass


class OldStored(OldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class OldCleared(OldEvent, tag="AllBlocksCleared"):
    pass


class OldBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[OldStored | OldRemoved | OldCleared]
    data_parallel_rank: int | None = None


VLLM_ARRAY_WIRE = msgspec.msgpack.Decoder(OldBatch)
