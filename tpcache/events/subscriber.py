"""A reference subscriber for the KV-event stream (``tpcache events`` prints it:
``cli/events.py``).

It shows what a router must do with the stream: drop duplicates by sequence number,
fill gaps by replay, and start from a snapshot when joining late.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterator

import msgspec
import zmq

from tpcache.cache.events import KVEventBatch, decode_batch
from tpcache.closing import Closing
from tpcache.errors import TpcacheError
from tpcache.events.block_index import BlockIndex, IndexProblem, ProblemKind, StoredBlock
from tpcache.events.replay_server import BUSY_SEQ, END_SEQ, SNAPSHOT_REQUEST, decode_seq
from tpcache.transport.connect_watch import MONITOR_EVENTS, ConnectWatch
from tpcache.transport.netsec import NetSecError, check_key, make_client

__all__ = [
    "BlockIndex",
    "EventSubscriber",
    "EventSubscriberError",
    "IndexProblem",
    "ProblemKind",
    "StoredBlock",
]

Received = tuple[int, KVEventBatch]


class EventSubscriberError(TpcacheError, RuntimeError):
    """A malformed message, a replay request that timed out, or no replay endpoint."""


def _parse(frames: list[bytes]) -> tuple[int, bytes]:
    if len(frames) != 3:
        raise EventSubscriberError(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    if len(frames[1]) != 8:
        raise EventSubscriberError(f"sequence frame of {len(frames[1])} bytes, expected 8")
    return decode_seq(frames[1]), frames[2]


def _decode(seq: int, payload: bytes) -> Received:
    try:
        return seq, decode_batch(payload)
    except msgspec.MsgspecError as exc:
        raise EventSubscriberError(f"batch {seq}: undecodable payload: {exc}") from exc


class EventSubscriber(Closing):
    """SUB on ``endpoint`` (and a DEALER on ``replay_endpoint``), both connected.

    ``next_batch`` delivers live batches in sequence order without duplicates: a batch
    at or below ``last_seq`` is skipped; a gap is filled by a replay when there is a
    replay endpoint (else counted in ``gaps``). ``request_replay`` and
    ``request_snapshot`` move ``last_seq`` forward, so live batches already covered by
    them are skipped. Not thread-safe (ZMQ sockets): use it from one thread.
    ``curve_server_key``: the publisher's CURVE public key, when it is a CURVE server;
    ``curve_keypair``: this subscriber's own (public, secret) key pair, for a publisher
    that lets in listed clients only. ``connect_timeout``: seconds to wait, on
    construction, for the handshake with a publisher at ``endpoint``; if none is done by
    then, ``EventSubscriberError`` says what the connect saw (refused, closed, a key
    refused). None: no wait (a SUB connects whenever the publisher comes up).
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        context: zmq.Context | None = None,
        replay_timeout: float = 5.0,
        curve_server_key: str | None = None,
        curve_keypair: tuple[str, str] | None = None,
        connect_timeout: float | None = None,
    ) -> None:
        if not replay_timeout > 0:
            raise EventSubscriberError(f"replay_timeout must be > 0 s, got {replay_timeout}")
        if connect_timeout is not None and not 0 < connect_timeout < math.inf:
            raise EventSubscriberError(f"connect_timeout must be > 0 s, got {connect_timeout}")
        if curve_server_key is not None:
            try:
                check_key("curve_server_key", curve_server_key)
            except NetSecError as exc:
                raise EventSubscriberError(str(exc)) from None
        self._curve = curve_server_key
        self._keypair = curve_keypair  # this client's (public, secret); None: a fresh one
        # Separate from next_batch's timeout: a caller polling every few ms must not
        # fail a gap replay that needs a little longer.
        self._replay_timeout = replay_timeout
        self._ctx = context if context is not None else zmq.Context()
        self._own_ctx = context is None
        self._replay_endpoint = replay_endpoint
        # Owned by this subscriber.
        self.last_seq: int | None = None  # highest sequence delivered so far
        self.gaps = 0  # batches missed and not recovered by replay
        self._pending: deque[Received] = deque()  # replayed batches not yet delivered
        self._sub = self._ctx.socket(zmq.SUB)
        self._dealer: zmq.Socket | None = None
        try:
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
            if self._curve is not None:
                make_client(self._sub, self._curve, self._keypair)
            if connect_timeout is None:
                self._sub.connect(endpoint)
            else:
                self._connect_watched(endpoint, connect_timeout)
            if replay_endpoint is not None:
                self._dealer = self._open_dealer()
        except zmq.ZMQError as exc:
            self.close()
            raise EventSubscriberError(
                f"cannot connect {endpoint!r} / {replay_endpoint!r}: {exc}"
            ) from exc
        except EventSubscriberError:
            self.close()
            raise

    def _connect_watched(self, endpoint: str, timeout: float) -> None:
        """Connect the SUB and wait for its handshake with a publisher (see the class
        docstring); raises ``EventSubscriberError`` if none is done within ``timeout``."""
        monitor = self._sub.get_monitor_socket(MONITOR_EVENTS)
        watch = ConnectWatch("the publisher", "this subscriber")
        try:
            self._sub.connect(endpoint)
            deadline = time.monotonic() + timeout
            while not watch.up and (left := deadline - time.monotonic()) > 0:
                if monitor.poll(max(1, int(left * 1000))):
                    watch.take(monitor)
        finally:
            self._sub.disable_monitor()
            monitor.close(linger=0)
        if not watch.up:
            raise EventSubscriberError(
                f"nothing published at {endpoint} within {timeout:g} s: {watch.why}; is "
                f"a coordinator serving KV events there (tpcache serve --events-endpoint)?"
            )

    def _open_dealer(self) -> zmq.Socket:
        assert self._replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            if self._curve is not None:
                make_client(dealer, self._curve, self._keypair)
            dealer.connect(self._replay_endpoint)
        except zmq.ZMQError:
            dealer.close(linger=0)
            raise
        return dealer

    def recv_live(self, timeout: float | None = None) -> Received | None:
        """The next live message as sent (no ordering, no dedup); None on timeout."""
        if not self._sub.poll(None if timeout is None else int(timeout * 1000)):
            return None
        return _decode(*_parse(self._sub.recv_multipart()))

    def next_batch(self, timeout: float | None = None) -> Received | None:
        """The next batch after ``last_seq``, in order; None if none came in ``timeout``.

        Raises EventSubscriberError on a malformed message or a gap replay that got no
        end marker within ``replay_timeout`` per message.
        """
        while True:
            while self._pending:
                seq, batch = self._pending.popleft()
                if self.last_seq is None or seq > self.last_seq:
                    self.last_seq = seq
                    return seq, batch
            got = self.recv_live(timeout)
            if got is None:
                return None
            seq, last = got[0], self.last_seq
            if last is not None and seq <= last:
                continue
            if last is not None and seq > last + 1:
                missing = seq - last - 1
                if self._dealer is not None:
                    replayed = self._replay(last + 1, self._replay_timeout)
                    # From the oldest kept when the gap starts before the buffer.
                    self._pending.extend(r for r in replayed if last < r[0] < seq)
                    missing -= len(self._pending)
                self.gaps += missing
            self._pending.append(got)

    def __iter__(self) -> Iterator[Received]:
        """``next_batch`` forever (blocks while nothing comes)."""
        while True:
            got = self.next_batch()
            if got is not None:
                yield got

    def request_replay(self, start_seq: int, timeout: float = 5.0) -> list[Received]:
        """Buffered batches with seq >= ``start_seq`` (from the oldest kept if older).

        Moves ``last_seq`` to the last one returned. Raises EventSubscriberError when
        there is no replay endpoint or no end marker came within ``timeout`` per message.
        """
        got = self._replay(start_seq, timeout)
        if got:
            last = got[-1][0]
            self.last_seq = last if self.last_seq is None else max(self.last_seq, last)
        return got

    def request_snapshot(self, timeout: float = 5.0) -> Received:
        """``(seq, batch)``: ``BlockStored`` events rebuilding the index as of ``seq``.

        ``seq`` is -1 if nothing was published yet. Sets ``last_seq`` to ``seq``, so
        ``next_batch`` continues right after it. Raises like ``request_replay``.
        """
        got = self._request(SNAPSHOT_REQUEST, timeout)
        if len(got) != 1:
            raise EventSubscriberError(f"snapshot reply of {len(got)} messages, expected 1")
        self.last_seq = got[0][0]
        return got[0]

    def _replay(self, start_seq: int, timeout: float) -> list[Received]:
        if start_seq < 0:
            raise EventSubscriberError(f"start_seq must be >= 0, got {start_seq}")
        return self._request(start_seq.to_bytes(8, "big", signed=False), timeout)

    def _request(self, body: bytes, timeout: float) -> list[Received]:
        if self._dealer is None:
            raise EventSubscriberError("no replay endpoint configured")
        # Bounded: a DEALER with no peer blocks on send, and one whose CURVE handshake
        # was refused has none (a test hung here for good).
        self._dealer.setsockopt(zmq.SNDTIMEO, max(1, int(timeout * 1000)))
        try:
            self._dealer.send(body)
        except zmq.Again:
            self._dealer.close(linger=0)
            self._dealer = self._open_dealer()
            raise EventSubscriberError(
                f"no end marker within {timeout}s (the request could not be sent: "
                "nothing accepted the connection)"
            ) from None
        replies: list[Received] = []
        while self._dealer.poll(int(timeout * 1000)):
            seq, payload = _parse(self._dealer.recv_multipart())
            if seq == END_SEQ:
                return replies
            if seq == BUSY_SEQ:
                raise EventSubscriberError("the publisher is busy building snapshots; ask again")
            replies.append(_decode(seq, payload))
        # A reply cut short may still trickle in; a fresh socket will not see it.
        self._dealer.close(linger=0)
        self._dealer = self._open_dealer()
        raise EventSubscriberError(f"no end marker within {timeout}s ({len(replies)} received)")

    def close(self) -> None:
        """Close the sockets (and the context if this subscriber made it). Idempotent."""
        self._sub.close(linger=0)
        if self._dealer is not None:
            self._dealer.close(linger=0)
        if self._own_ctx and not self._ctx.closed:
            self._ctx.term()
