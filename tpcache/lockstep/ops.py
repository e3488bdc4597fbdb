"""The op log: what the coordinator sends every rank, and what each rank answers.

One ``Step`` is a batch of ops applied in order. Token ids travel as raw little-endian
int32 bytes (msgpack ``bin``), so a 32k-token prompt costs one copy, not 32k ints.
Commands are frozen; new fields get defaults and go last.
"""

from __future__ import annotations

import msgspec
import numpy as np

from tpcache.cache.records import RequestId

OP_TOKENS = np.dtype("<i4")  # an op's tokens: little-endian int32


def pack_tokens(tokens: np.ndarray) -> bytes:
    return np.ascontiguousarray(tokens, OP_TOKENS).tobytes()


def unpack_tokens(data: bytes) -> np.ndarray:
    # The dtype as an object, passed positionally: half the call's cost of a dtype
    # string by keyword (0.21 against 0.43 us), on every rank for every op with tokens.
    return np.frombuffer(data, OP_TOKENS)


class OpNamespace(msgspec.Struct, array_like=True, frozen=True):
    """An admit's cache namespace (``cache.namespace.CacheNamespace``), as the mirror
    validated it: a LoRA adapter's id and name, a tenant's cache salt."""

    lora_id: int | None
    lora_name: str | None
    salt: str | None


class Admit(msgspec.Struct, tag=True, frozen=True):
    """``evict_pages`` / ``evict_swa_pages``: what the mirror's eviction for this admit was
    asked for (its shortfall in full and SWA pages, the cache's ``eviction_ask``), which
    every rank asks too: the decision, not the counts it freed (see lockstep.py).
    ``namespace``: ``None`` for the default one (an older op's meaning)."""

    rid: RequestId
    tokens: bytes
    priority: int = 0
    evict_pages: int = 0
    evict_swa_pages: int = 0  # hybrid cache only
    reserve: int = 0  # slots past the prompt, allocated with it
    namespace: OpNamespace | None = None


class Extend(msgspec.Struct, tag=True, frozen=True):
    """``evict_*`` as in ``Admit``."""

    rid: RequestId
    n: int
    evict_pages: int = 0
    evict_swa_pages: int = 0


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
    swa_tokens: int = 0  # then SWA KV (hybrid cache), counting what the first part freed


class Reset(msgspec.Struct, tag=True, frozen=True):
    pass


class CopySync(msgspec.Struct, tag=True, frozen=True):
    """Agree how many copies of the host tier's copy log are done on every rank (one
    MIN all-reduce of each rank's done count, -1 from a rank where a copy failed). Changes
    no cache state: the agreed count travels back in ``StepResult.copies_done`` and comes
    back as a ``CopiesDone`` (``workers/copysync.py``). ``want``/``wait_s``: a rank first
    waits up to ``wait_s`` seconds for its first ``want`` copies (a forward waits for
    them), so one round usually settles it instead of many."""

    want: int = 0
    wait_s: float = 0.0


class CopiesDone(msgspec.Struct, tag=True, frozen=True):
    """The first ``n`` copies are done everywhere (a count a ``CopySync`` agreed): every
    rank and the mirror apply ``cache.host.copies_done(n)`` at this point of the op log."""

    n: int


Op = Admit | Extend | CacheUnfinished | Finish | Abort | Evict | Reset | CopySync | CopiesDone


class Step(msgspec.Struct, frozen=True):
    """One step of the op log. ``peer_check``: the ranks check their digests with each
    other at the step's end (one all-reduce); False where the sender compares every
    rank's digest with its own mirror (the coordinator), which also names the odd rank."""

    step: int
    ops: list[Op]
    peer_check: bool = True


class OpResult(msgspec.Struct, frozen=True):
    """What one op did on one rank: the prefix it matched, how many slots it was given and
    their sum, and the pages evicted per pool. Compact on purpose: the coordinator
    compares these with its mirror's, and slot ids are fully covered by the digest."""

    prefix_len: int = 0
    num_slots: int = 0
    slot_sum: int = 0
    evicted_pages: int = 0
    evicted_swa_pages: int = 0


class StepResult(msgspec.Struct, frozen=True):
    step: int
    rank: int
    digest: int  # unsigned 64-bit, after the whole step
    results: list[OpResult]
    apply_us: float = 0.0
    ops_us: float = 0.0  # of apply_us: the ops and the digest, before the step's collective
    copies_done: int = -1  # the count the step's last CopySync agreed (-1: none ran)


# ---- the model (tpcache.model.reference): the same structs under Ray and torchrun --------------
class Forward(msgspec.Struct, tag=True, frozen=True):
    """Run the model on the new ``tokens`` of running request ``rid``.

    ``slots``: full-pool slot ids (little-endian int64) of every position of the context,
    cached prefix and new tokens (``start + len(tokens)`` of them), as the cache's row
    holds them; ``swa_slots``: SWA-pool slot ids of positions ``swa_start`` .. end
    (hybrid cache only). Each rank checks them against its own cache before computing.
    """

    rid: RequestId
    tokens: bytes
    start: int
    slots: bytes
    swa_start: int = 0
    swa_slots: bytes = b""
    all_logits: bool = True  # every new position's logits; False: the last one's
    # False: no logit rows come back for this item, only its last position's argmax
    # (``ForwardBatchResult.top``), which is all greedy decoding needs.
    logits: bool = True


class ForwardBatch(msgspec.Struct, tag=True, frozen=True):
    """One forward over many running requests (prefill chunks and decodes mixed): each
    item is a ``Forward``, at most one per request. Every rank checks every item against
    its own cache, and the whole batch runs as one call of the rank's model runner."""

    items: list[Forward]


class ForwardBatchResult(msgspec.Struct, frozen=True):
    """What one rank's runner returned for a ``ForwardBatch``.

    Only rank 0 sends logits: after the all-reduces every rank holds the same ones, and
    shipping ``batch x vocab`` floats from every rank each step would cost more than the
    step's own bookkeeping. ``rows[i]``: logit rows of item i in ``logits`` (its new
    tokens, or 1 without ``all_logits``; 0 when the item asked for none, on other ranks,
    or when the runner gave no logits); ``logits``: little-endian float32
    ``[sum(rows), vocab]``. Every rank sends, per item, ``top``: the argmax of its last
    logits row (little-endian int64, ties to the lowest id), and ``top_logit``: the logit
    there (little-endian float64), so the ranks' outputs are compared without the logits
    (both empty when the runner gave no logits). ``token_ids``: little-endian int64, one
    per item, when the runner sampled."""

    rank: int
    computed: list[int]  # new tokens per item
    rows: list[int]
    vocab: int
    logits: bytes
    token_ids: bytes = b""
    top: bytes = b""
    top_logit: bytes = b""


class ForwardResult(msgspec.Struct, frozen=True):
    """What one rank computed: ``logits`` (little-endian float32, ``[computed, vocab]``)."""

    rank: int
    computed: int  # tokens run through the model by this forward (the new ones)
    context: int  # positions their attention covered (prefix + new)
    vocab: int
    logits: bytes


def pack_slots(slots: np.ndarray) -> bytes:
    return np.ascontiguousarray(slots, dtype="<i8").tobytes()


def unpack_slots(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i8")


# ---- torchrun: what rank 0 broadcasts to every rank (see lead.follow) -------------------
class RunStep(msgspec.Struct, tag=True, frozen=True):
    """Apply an encoded ``Step`` (the same bytes a Ray rank gets in ``apply``)."""

    data: bytes


class RunCall(msgspec.Struct, tag=True, frozen=True):
    """Call ``RankWorker.<method>(*args)``; every rank replies. ``rank`` set: only that
    rank calls it (the others reply None), e.g. to plant a fault on one rank."""

    method: str
    args: list = []
    rank: int | None = None


class Stop(msgspec.Struct, tag=True, frozen=True):
    """Leave the command loop (the group stays; the process may tear it down)."""


Command = RunStep | RunCall | Stop


class CallReply(msgspec.Struct, frozen=True):
    ok: bool
    value: object = None
    error: str = ""


_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


# One reused decoder per message type; its bound ``decode`` is the function.
decode_step = msgspec.msgpack.Decoder(Step).decode
decode_result = msgspec.msgpack.Decoder(StepResult).decode
# the forward calls of a model runner
decode_forward = msgspec.msgpack.Decoder(Forward).decode
decode_forward_result = msgspec.msgpack.Decoder(ForwardResult).decode
decode_forward_batch = msgspec.msgpack.Decoder(ForwardBatch).decode
decode_forward_batch_result = msgspec.msgpack.Decoder(ForwardBatchResult).decode
# what rank 0 broadcasts under torchrun, and the replies
decode_command = msgspec.msgpack.Decoder(Command).decode
decode_reply = msgspec.msgpack.Decoder(CallReply).decode
