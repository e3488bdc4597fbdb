"""What the step channel's hub and its ranks say to each other: the message kinds, one
message's body (``pack``/``unpack``), the limits both ends keep, what a rank needs to
attach (``Attach``), and the channel's errors. The protocol itself is told in
``channel.py``; the rank's loops are ``channel_loop.py`` (Unix) and ``rank_tcp.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from tpcache.errors import TpcacheError

STEPS, CALL, STOP = b"S", b"C", b"X"
HELLO, RESULTS, REPLY, ERROR = b"H", b"R", b"P", b"E"
UNIX = "unix://"  # the endpoint of a rank on the hub's node: its socket's path follows
# How long a rank may take to reach its hub. The hub listens before any rank is told
# where, so a connect on a working node or network takes a round trip and a CURVE
# handshake (milliseconds); 10 s is that many times over on a loaded host, with ZMQ's
# reconnects (every 0.1 s) retried ~100 times, and well under the coordinator's wait for
# its ranks (120 s by default), so the rank's reason arrives there before that times out.
CONNECT_S = 10.0
# The largest reply a rank sends its hub, and so the most one connection can make the hub
# hold at a time (its TCP socket's MAXMSGSIZE, its Unix reader's frame limit). A reply is
# a step's results (a few dozen bytes an op), a call's return value or an error; the only
# large ones are a forward's logits, float32 rows x vocabulary: 256 MiB holds one row for
# each of 512 requests over a 131,072-token vocabulary (a decode batch of a Llama 3
# model), or every row of a 2,048-token prefill over a 32,000-token one. A rank refuses
# to send more (``ReplyTooLarge``, raised to the caller) rather than be cut off.
MAX_REPLY = 256 << 20


_encode_frames = msgspec.msgpack.Encoder().encode
_decode_frames = msgspec.msgpack.Decoder(list[bytes]).decode


def pack(kind: bytes, number: bytes, frames: list[bytes]) -> bytes:
    """One message's body: its kind (1 byte), its number (8), its frames (one msgpack
    array of bin). One ZMQ frame instead of one per part: pyzmq's multipart calls cost
    more than a small step's cache work, on both sides."""
    return kind + number + _encode_frames(frames)


def unpack(body: bytes) -> list[bytes]:
    """The frames of a body ``pack`` made (its kind is ``body[:1]``, its number
    ``body[1:9]``). Raises ``msgspec.DecodeError`` for a body it did not make."""
    return _decode_frames(memoryview(body)[9:])


class BadChannelMessage(TpcacheError, ValueError):
    """A channel message of a kind, or naming a method, that the rank does not serve."""


class ChannelError(TpcacheError, RuntimeError):
    """A rank did not answer, stopped reading, or is gone; ``rank`` names it."""

    def __init__(self, rank: int, message: str, dead: bool = False) -> None:
        super().__init__(f"rank {rank}: {message}")
        self.rank = rank
        self.dead = dead


class ChannelConnectError(ChannelError):
    """A rank could not reach its hub: ``endpoint`` is where it tried, ``reason`` what
    the OS (or ZMQ) said. Its loop ends with this error, which the coordinator reports
    as the rank's reason; a rank whose hub goes after a good connect leaves quietly.
    Not ``dead``: its process lives. It crosses Ray as the loop's error (pickled whole,
    as every ``TpcacheError`` is)."""

    def __init__(self, rank: int, endpoint: str, reason: str) -> None:
        super().__init__(rank, f"could not connect to the step channel at {endpoint}: {reason}")
        self.endpoint = endpoint
        self.reason = reason


class ReplyTooLarge(TpcacheError, ValueError):
    """A rank's answer to a message is larger than the step channel carries
    (``Attach.max_reply``); the rank sent this error instead, and goes on."""

    def __init__(self, what: str, size: int, limit: int) -> None:
        super().__init__(
            f"the answer to {what} is {size:,} bytes, over the step channel's limit of "
            f"{limit:,}: for a forward, ask for fewer logit rows (the last of each request, "
            f"not every one) or a shorter chunk"
        )
        self.size = size
        self.limit = limit


@dataclass(frozen=True)
class Attach:
    """What one rank needs to join the channel (sent through the Ray setup call)."""

    endpoint: str
    identity: bytes
    server_key: str | None = None  # the hub's CURVE public key (TCP only)
    keypair: tuple[str, str] | None = None  # this rank's CURVE (public, secret)
    hwm: int = 1000  # messages queued at the rank before the hub's sends wait
    max_reply: int = MAX_REPLY  # bytes of one answer, the most the hub reads (MAX_REPLY)
