"""What ``tpcache generate``'s clients and its serving loop say to each other over ZMQ.

A client is a DEALER; the loop is a ROUTER. A client sends ``Submit`` (its prompt's
token ids, how many tokens to generate, and the request's position in the trace, which
the loop admits in); the loop answers ``Token`` for every generated token as it comes
(the first one is the client's time to first token) and ``Done`` at the end, or
``Refused`` for a request it will not run. No torch, no Ray: a client needs msgspec,
numpy and pyzmq only.

The client measures its own times (``ClientResult``): from just before its ``Submit``
is sent to the first ``Token`` (TTFT) and to ``Done`` (its end-to-end latency); so they
include the network hops and any wait for admission.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec
import numpy as np
import zmq

from tpcache.errors import TpcacheError
from tpcache.lockstep.ops import encode
from tpcache.lockstep.ops import pack_tokens as pack
from tpcache.lockstep.ops import unpack_tokens as unpack


class GenerateError(TpcacheError):
    """A generate run cannot start or cannot go on; the message says why."""


class Submit(msgspec.Struct, tag=True, frozen=True):
    seq: int  # the request's position in the trace: the order the loop admits in
    prompt: bytes  # int32 little-endian token ids
    max_new: int  # tokens to generate, >= 1


class Token(msgspec.Struct, tag=True, frozen=True):
    seq: int
    index: int  # 0 for the first generated token
    token: int


class Done(msgspec.Struct, tag=True, frozen=True):
    seq: int
    tokens: bytes  # int32 little-endian: every generated token
    prefix_len: int  # prompt tokens taken from the cache at admission
    computed: int  # prompt tokens run through the model


class Refused(msgspec.Struct, tag=True, frozen=True):
    seq: int
    error: str


ToLoop = Submit
ToClient = Token | Done | Refused

# Messages are encoded, and token ids packed, as the step channel's are (``lockstep.ops``).
# Both decoders raise ``msgspec.ValidationError``/``DecodeError`` for a malformed message.
decode_submit = msgspec.msgpack.Decoder(ToLoop).decode
decode_reply = msgspec.msgpack.Decoder(ToClient).decode


@dataclass(frozen=True)
class ClientResult:
    """One request as its client saw it."""

    seq: int
    tokens: np.ndarray  # generated token ids
    prefix_len: int
    computed: int
    ttft_s: float  # from sending Submit to the first Token
    e2e_s: float  # from sending Submit to Done


class GenClient:
    """One client: a DEALER connected to the loop's ``endpoint``. Not thread-safe (one
    per thread). ``close()`` disconnects at once (linger 0), even mid-request."""

    def __init__(self, ctx: zmq.Context, endpoint: str, timeout_s: float = 600.0) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.timeout_ms = int(timeout_s * 1000)

    def submit(self, seq: int, prompt: np.ndarray, max_new: int) -> float:
        """Send one request; returns the time it was sent (``time.perf_counter``)."""
        sent = time.perf_counter()
        self.sock.send(encode(Submit(seq, pack(prompt), max_new)))
        return sent

    def next_reply(self) -> ToClient:
        """The loop's next message. Raises ``GenerateError`` if none comes in time."""
        if not self.sock.poll(self.timeout_ms):
            raise GenerateError(f"no reply from the generate loop within {self.timeout_ms} ms")
        return decode_reply(self.sock.recv())

    def generate(self, seq: int, prompt: np.ndarray, max_new: int) -> ClientResult:
        """Send one request and wait for all of it. Raises ``GenerateError`` for a
        refused request or a silent loop."""
        sent = self.submit(seq, prompt, max_new)
        first = None
        while True:
            reply = self.next_reply()
            now = time.perf_counter()
            match reply:
                case Token():
                    first = now if first is None else first
                case Done():
                    return ClientResult(
                        seq,
                        unpack(reply.tokens).copy(),
                        reply.prefix_len,
                        reply.computed,
                        (first if first is not None else now) - sent,
                        now - sent,
                    )
                case Refused():
                    raise GenerateError(f"request {seq} refused: {reply.error}")

    def close(self) -> None:
        self.sock.close(linger=0)


__all__ = [
    "ClientResult",
    "Done",
    "GenClient",
    "GenerateError",
    "Refused",
    "Submit",
    "Token",
    "decode_reply",
    "decode_submit",
    "encode",
    "pack",
    "unpack",
]
