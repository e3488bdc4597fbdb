"""What the publisher remembers (sequence numbers, the replay buffer, the block index)
and how it answers replay and snapshot requests on its ROUTER socket.

Two framings, told apart by the request's first frame (after the routing identity):

- **vLLM's** (a REQ socket, or a DEALER that sends the REQ envelope): ``[b"", start]``,
  ``start`` an 8-byte big-endian unsigned sequence. Every reply starts with the empty
  delimiter frame. With the "map" encoding (current vLLM, since its pull request #45177:
  v0.26 on) a batch is ``[b"", topic, seq, payload]`` and the end ``[b"", b"", -1,
  b""]``; with "array" (older vLLM) ``[b"", seq, payload]`` and ``[b"", -1, b""]``.
  A DEALER reads the whole replay. A REQ socket can read only one message per request,
  so a REQ peer (its ZMTP ``Socket-Type``) gets one: the first batch from ``start``, or
  the end marker when there is none; it asks again from the next sequence until the end
  marker comes (vLLM's server sends a REQ the whole replay, which the REQ cannot read
  and which then answers its next request). A malformed body gets ``BAD_SEQ`` (-3) with
  an empty payload, so a waiting REQ is released (vLLM's own subscriber reads an empty
  payload as the end). This framing never asks for a snapshot.
- **tpcache's own** (a DEALER, no delimiter), an extension: ``[start]`` is a replay,
  answered ``(topic, seq, payload)`` per batch, then ``END_MARKER``; ``[b"SNAPSHOT"]``
  is a snapshot: one ``(topic, seq, payload)`` message whose payload is a
  ``KVEventBatch`` of ``BlockStored`` events rebuilding the publisher's block index as
  of batch ``seq`` (-1: no batch yet), then ``END_MARKER``. Snapshots are built on a
  thread of their own (200k blocks take most of a second), never on the send thread
  that carries the live stream; at most ``snapshot_queue`` wait to be built and one per
  client: a request beyond that gets ``BUSY_MARKER`` (sequence -2) at once, and may ask
  again later. Anything else (more frames, another length) gets no reply.

A start older than the oldest kept batch replays from it. Every malformed request is
counted (``bad_requests``).

What a client can make the server hold (``limit_requests``, set before the socket binds):
a frame longer than any request (8 bytes) ends its connection before it is buffered, and
at most ``REQUESTS_WAITING`` of its requests wait to be read.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from tpcache.cache.events import KVEvent, KVEventBatch, encode_batch
from tpcache.events.block_index import BlockIndex
from tpcache.transport.netsec import limit_receive

SNAPSHOT_REQUEST = b"SNAPSHOT"
END_SEQ = -1
END_MARKER: tuple[bytes, bytes, bytes] = (b"", END_SEQ.to_bytes(8, "big", signed=True), b"")
BUSY_SEQ = -2
BUSY_MARKER: tuple[bytes, bytes, bytes] = (b"", BUSY_SEQ.to_bytes(8, "big", signed=True), b"")
BAD_SEQ = -3  # a malformed request in vLLM's framing (a REQ must get an answer)
# Every request is one frame of 8 bytes: a start sequence, or SNAPSHOT_REQUEST.
REQUEST_BYTES = 8
# A client asks and reads its reply (a whole replay) before it asks again: a few requests
# queued are plenty, and ZMQ stops reading a connection that has more waiting.
REQUESTS_WAITING = 4


def limit_requests(sock: zmq.Socket) -> None:
    """Before the replay socket binds: a peer that sends a frame longer than a request is
    disconnected before the frame is buffered (ZMQ's MAXMSGSIZE, which also has to let
    the handshake through), and at most ``REQUESTS_WAITING`` requests wait per
    connection, so one client cannot make the server hold more than a few kilobytes."""
    limit_receive(sock, REQUEST_BYTES, REQUESTS_WAITING)


def encode_seq(seq: int) -> bytes:
    """8 bytes, big-endian, signed (so the end marker -1 and real seqs share a format)."""
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    start_seq: int
    vllm: bool = False  # asked in vLLM's framing (the REQ envelope)


@dataclass(frozen=True, slots=True)
class SnapshotRequest:
    pass


@dataclass(frozen=True, slots=True)
class BadRequest:
    vllm: bool  # in vLLM's framing: answered ``BAD_SEQ``; else not answered


Request = ReplayRequest | SnapshotRequest | BadRequest


def parse_request(frames: list[bytes]) -> Request:
    """Parse the frames after the routing identity (see the module doc)."""
    if len(frames) == 2 and frames[0] == b"":
        if len(frames[1]) == 8:
            return ReplayRequest(int.from_bytes(frames[1], "big", signed=False), vllm=True)
        return BadRequest(vllm=True)
    if len(frames) != 1:
        return BadRequest(vllm=False)
    body = frames[0]
    if body == SNAPSHOT_REQUEST:
        return SnapshotRequest()
    if len(body) == 8:
        return ReplayRequest(int.from_bytes(body, "big", signed=False))
    return BadRequest(vllm=False)


class EventLog:
    """Sequence numbers, the last ``capacity`` encoded batches, and the block index.

    Every batch the publisher accepts is recorded here, whether or not the live send
    queue had room for it, so a subscriber that sees a gap can fill it by replay and a
    snapshot always matches the sequence it names. Thread-safe: ``record`` runs on
    publishing threads, the readers on the sender thread; one lock covers all three
    fields so a sequence number, its buffer entry and its index update appear together.
    """

    def __init__(self, capacity: int) -> None:
        self._lock = threading.Lock()
        # All three owned by this log, guarded by _lock.
        self._next_seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=capacity)
        self._index = BlockIndex()

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def record(self, payload: bytes, events: list[KVEvent]) -> int:
        """Assign the next sequence number to ``payload``, keep it, fold ``events``.

        ``events`` must already be validated KV events (a TypeError here would leave a
        sequence number without its index update).
        """
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            self._buffer.append((seq, payload))
            self._index.apply_all(events)
            return seq

    def since(self, start_seq: int) -> list[tuple[int, bytes]]:
        """Buffered ``(seq, payload)`` with ``seq >= start_seq``, oldest first."""
        with self._lock:
            if not self._buffer:
                return []
            skip = max(0, start_seq - self._buffer[0][0])
            if skip >= len(self._buffer):
                return []
            entries = list(self._buffer)
        return entries[skip:]

    def snapshot(self) -> tuple[int, BlockIndex]:
        """The last recorded sequence (-1 if none) and a copy of the index as of it."""
        with self._lock:
            return self._next_seq - 1, self._index.copy()


class ReplayServer:
    """Answers requests on a bound ROUTER socket. Runs on the sender thread only.

    Replies are sent without blocking. The socket's per-client send limit is set to
    hold one full replay; if a client still has not read enough of an earlier reply,
    or has gone, the reply is cut short (counted in ``failed``) and that client sees
    no end marker, so it must time out and ask again.
    """

    def __init__(
        self,
        socket: zmq.Socket,
        topic: bytes,
        log: EventLog,
        clock: Callable[[], float],
        data_parallel_rank: int | None,
        encoding: str = "map",
        *,
        snapshot_queue: int = 4,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        self._socket = socket
        self._encoding = encoding
        self._topic = topic
        self._log = log
        self._clock = clock
        self._dp_rank = data_parallel_rank
        # Counters, written by the sender thread only.
        self.replays = 0
        self.snapshots = 0
        self.bad_requests = 0
        self.failed = 0
        self.busy = 0  # snapshot requests turned away: the queue was full
        # Snapshots: identities waiting to be built (bounded), and built replies waiting
        # for the send thread. ``_waiting`` (owned by the send thread) keeps one request
        # per client in the queue.
        self._todo: queue.Queue[bytes | None] = queue.Queue(snapshot_queue)
        self._built: queue.Queue[tuple[bytes, int, bytes]] = queue.Queue()
        self._waiting: set[bytes] = set()
        self._wake = wake
        self._builder = threading.Thread(
            target=self._build_loop, name="kv-event-snapshots", daemon=True
        )
        self._builder.start()

    def serve_pending(self, limit: int = 64) -> None:
        """Answer up to ``limit`` waiting requests (bounded, so live sends keep going)."""
        for _ in range(limit):
            try:
                msg = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity, request = msg[0].bytes, parse_request([f.bytes for f in msg[1:]])
            match request:
                case ReplayRequest(start_seq=start, vllm=False):
                    self.replays += 1
                    self._reply(identity, self._log.since(start))
                case ReplayRequest(start_seq=start):
                    self.replays += 1
                    entries = self._log.since(start)
                    # A REQ reads one message a request (module doc): the first batch,
                    # or the end marker when there is none.
                    one = msg[-1].get("Socket-Type") == "REQ"
                    self._reply_vllm(identity, entries[:1] if one else entries, END_SEQ, one)
                case SnapshotRequest():
                    self.snapshots += 1
                    self._queue_snapshot(identity)
                case BadRequest(vllm=vllm):
                    self.bad_requests += 1
                    if vllm:
                        self._reply_vllm(identity, [], BAD_SEQ)

    def _queue_snapshot(self, identity: bytes) -> None:
        if identity not in self._waiting:
            try:
                self._todo.put_nowait(identity)
                self._waiting.add(identity)
                return
            except queue.Full:
                pass
        self.busy += 1
        try:
            self._socket.send_multipart([identity, *BUSY_MARKER], zmq.NOBLOCK)
        except zmq.ZMQError:
            self.failed += 1

    def send_built(self) -> None:
        """Send the snapshots built since the last call (send thread only)."""
        while True:
            try:
                identity, seq, payload = self._built.get_nowait()
            except queue.Empty:
                return
            self._waiting.discard(identity)
            self._reply(identity, [(seq, payload)])

    def close(self) -> None:
        """Stop the snapshot builder (after the send thread has stopped)."""
        try:
            self._todo.put(None, timeout=1.0)
        except queue.Full:
            return  # still building: a daemon thread, it ends with the process
        self._builder.join(timeout=5.0)

    def _build_loop(self) -> None:
        while (identity := self._todo.get()) is not None:
            seq, payload = self._snapshot_entry()
            self._built.put((identity, seq, payload))
            self._wake()

    def _snapshot_entry(self) -> tuple[int, bytes]:
        seq, index = self._log.snapshot()
        # The snapshot's events are built outside the log's lock: publishers only wait
        # for the index copy, not for this walk.
        events: list[KVEvent] = list(index.to_events())
        batch = KVEventBatch(ts=self._clock(), events=events, data_parallel_rank=self._dp_rank)
        return seq, encode_batch(batch, self._encoding)

    def _reply_vllm(
        self, identity: bytes, entries: list[tuple[int, bytes]], last: int, one: bool = False
    ) -> None:
        """``entries`` then the marker ``last``, in vLLM's framing for the encoding;
        ``one``: the marker only when there is no entry (a REQ reads one message)."""
        head = [identity, b""] if self._encoding == "array" else [identity, b"", self._topic]
        tail = [identity, b""] if self._encoding == "array" else [identity, b"", b""]
        try:
            for seq, payload in entries:
                self._socket.send_multipart([*head, encode_seq(seq), payload], zmq.NOBLOCK)
            if not (one and entries):
                self._socket.send_multipart([*tail, encode_seq(last), b""], zmq.NOBLOCK)
        except zmq.ZMQError:
            self.failed += 1  # as in ``_reply``

    def _reply(self, identity: bytes, entries: list[tuple[int, bytes]]) -> None:
        try:
            for seq, payload in entries:
                self._socket.send_multipart(
                    [identity, self._topic, encode_seq(seq), payload], zmq.NOBLOCK
                )
            self._socket.send_multipart([identity, *END_MARKER], zmq.NOBLOCK)
        except zmq.ZMQError:
            # zmq.Again (client's queue full) or EHOSTUNREACH (client gone), both
            # raised because ROUTER_MANDATORY is set on the socket.
            self.failed += 1
