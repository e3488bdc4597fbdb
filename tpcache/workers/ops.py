"""The op log: what the coordinator sends every rank, and what each rank answers.

One ``Step`` is a batch of ops applied in order. Token ids travel as raw little-endian
int32 bytes (msgpack ``bin``), so a 32k-token prompt costs one copy, not 32k ints.
Commands are frozen; new fields get defaults and go last.
"""

from __future__ import annotations

import msgspec
import numpy as np

RequestId = int | str


def pack_tokens(tokens: np.ndarray) -> bytes:
    return np.ascontiguousarray(tokens, dtype="<i4").tobytes()


def unpack_tokens(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i4")


class Admit(msgspec.Struct, tag=True, frozen=True):
    rid: RequestId
    tokens: bytes
    priority: int = 0
    evict_pages: int = 0  # pages the coordinator's mirror evicted for this admit


class Extend(msgspec.Struct, tag=True, frozen=True):
    rid: RequestId
    n: int
    evict_pages: int = 0


class CacheUnfinished(msgspec.Struct, tag=True, frozen=True):
    rid: RequestId
    tokens: bytes


class Finish(msgspec.Struct, tag=True, frozen=True):
    rid: RequestId
    output: bytes


class Abort(msgspec.Struct, tag=True, frozen=True):
    rid: RequestId


class Evict(msgspec.Struct, tag=True, frozen=True):
    num_tokens: int


class Reset(msgspec.Struct, tag=True, frozen=True):
    pass


Op = Admit | Extend | CacheUnfinished | Finish | Abort | Evict | Reset


class Step(msgspec.Struct, frozen=True):
    step: int
    ops: list[Op]


class OpResult(msgspec.Struct, frozen=True):
    """What one op did on one rank: the prefix it matched, the first slot it was given
    and how many, and pages evicted. Compact on purpose: the coordinator compares these
    with its mirror's, and slot ids are fully covered by the digest."""

    prefix_len: int = 0
    num_slots: int = 0
    slot_sum: int = 0
    evicted_pages: int = 0


class StepResult(msgspec.Struct, frozen=True):
    step: int
    rank: int
    digest: int  # unsigned 64-bit, after the whole step
    results: list[OpResult]
    apply_us: float = 0.0


_encoder = msgspec.msgpack.Encoder()
_step_decoder = msgspec.msgpack.Decoder(Step)
_result_decoder = msgspec.msgpack.Decoder(StepResult)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_step(data: bytes) -> Step:
    return _step_decoder.decode(data)


def decode_result(data: bytes) -> StepResult:
    return _result_decoder.decode(data)
