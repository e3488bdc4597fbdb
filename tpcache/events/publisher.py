"""Publishes the cache's KV events on ZMQ, in the stream format vLLM's subscribers read.

Each live message is three frames: topic (utf-8), sequence (8 bytes big-endian, from 0,
one per batch), msgpack ``KVEventBatch``. Replay and snapshot requests are answered on
an optional ROUTER socket (see ``replay_server`` for that wire format).

Sequence numbers of dropped batches: ``publish`` assigns the next sequence number to
every batch it accepts, before it knows whether the live send queue has room. A batch
dropped because the queue is full keeps its number, so a subscriber sees the gap in the
live stream; the batch is still in the replay buffer and folded into the snapshot
index, so the gap can be filled by a replay and a snapshot never misses a batch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from tpcache.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    encode_batch,
)
from tpcache.closing import Closing
from tpcache.errors import TpcacheError
from tpcache.events.event_config import EventConfig, EventConfigError
from tpcache.events.replay_server import EventLog, ReplayServer, encode_seq, limit_requests
from tpcache.transport.netsec import (
    allow_clients,
    limit_subscriptions,
    make_server,
    release_clients,
)

__all__ = [
    "EventConfig",
    "EventConfigError",
    "EventPublisher",
    "EventPublisherError",
    "InvalidEventError",
    "PublisherStats",
]

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 5.0


class EventPublisherError(TpcacheError, RuntimeError):
    """The publisher cannot start (bind/connect failed), is closed, or its sender died."""


class InvalidEventError(EventPublisherError, ValueError):
    """``publish`` got something that is not a well-formed KV event; nothing was sent."""


@dataclass(frozen=True, slots=True)
class PublisherStats:
    """Counters at one moment. ``published + dropped`` batches == sequence numbers used."""

    published_batches: int  # accepted and queued for the live stream
    published_events: int
    dropped_batches: int  # the send queue was full: not sent live, still replayable
    dropped_events: int
    sent_batches: int  # handed to the PUB socket by the send thread
    replay_requests: int
    snapshot_requests: int
    bad_requests: int  # malformed replay-socket requests (answered only in vLLM's framing)
    failed_replies: int  # replies cut short: client gone or not reading


def _check_events(events: list[KVEvent]) -> None:
    for i, ev in enumerate(events):
        match ev:
            case BlockStored(block_hashes=hashes, token_ids=tokens, block_size=size):
                if not hashes or size < 1 or len(tokens) != len(hashes) * size:
                    raise InvalidEventError(
                        f"event {i}: BlockStored with {len(hashes)} hashes, "
                        f"{len(tokens)} token ids, block size {size}"
                    )
                if min(hashes) < 0 or max(hashes) >= 1 << 64:
                    raise InvalidEventError(f"event {i}: hash outside unsigned 64 bits")
            case BlockRemoved() | AllBlocksCleared():
                pass
            case _:
                raise InvalidEventError(f"event {i}: not a KV event: {type(ev).__name__}")


class EventPublisher(Closing):
    """A ZMQ PUB (and optional replay ROUTER) fed by a bounded queue and one thread.

    ``publish`` runs on the caller's thread and never waits for the network: it
    encodes the batch, records it (sequence number, replay buffer, block index) and
    puts it on the queue; when the queue is full the batch is dropped from the live
    stream and counted. All socket I/O happens on the one send thread, woken by a pipe
    (a ZMQ socket must not be shared across threads; a pipe write is thread-safe).
    """

    def __init__(
        self,
        config: EventConfig,
        *,
        context: zmq.Context | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Bind/connect now; raises EventPublisherError (nothing left open) on failure."""
        self.config = config
        self._clock = clock
        self._topic = config.topic.encode("utf-8")
        self._ctx = context if context is not None else zmq.Context()
        self._own_ctx = context is None
        self._zap = False  # a ZAP handler limits CURVE clients (curve_client_keys)
        self._pub, self._router = self._open_sockets()
        self.endpoint: str = self._pub.get(zmq.LAST_ENDPOINT).decode()
        self.replay_endpoint: str | None = (
            self._router.get(zmq.LAST_ENDPOINT).decode() if self._router else None
        )
        self._log = EventLog(config.buffer_steps)
        self._queue: queue.Queue[tuple[int, bytes]] = queue.Queue(config.queue_size)
        self._replay = (
            ReplayServer(
                self._router,
                self._topic,
                self._log,
                clock,
                config.data_parallel_rank,
                config.encoding,
                snapshot_queue=config.snapshot_queue,
                wake=self._wake_unlocked,
            )
            if self._router is not None
            else None
        )
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # Guards the fields below, and keeps queue order == sequence order.
        self._lock = threading.Lock()
        self._published = [0, 0]  # [batches, events]
        self._dropped = [0, 0]
        self._closed = False
        # Written by the send thread only.
        self._sent = 0
        self._sender_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def _open_sockets(self) -> tuple[zmq.Socket, zmq.Socket | None]:
        cfg = self.config
        sockets: list[zmq.Socket] = []
        field, endpoint = "endpoint", cfg.endpoint
        try:
            if cfg.curve_client_keys:
                allow_clients(self._ctx, cfg.curve_client_keys)
                self._zap = True
            pub = self._ctx.socket(zmq.PUB)
            sockets.append(pub)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, cfg.queue_size)
            limit_subscriptions(pub, self._topic)
            if cfg.curve_secret_key is not None:
                make_server(pub, cfg.curve_secret_key)
            if cfg.binds:
                pub.bind(endpoint)
            else:
                pub.connect(endpoint)
            if cfg.replay_endpoint is None:
                return pub, None
            field, endpoint = "replay_endpoint", cfg.replay_endpoint
            router = self._ctx.socket(zmq.ROUTER)
            sockets.append(router)
            router.setsockopt(zmq.LINGER, 0)
            if cfg.curve_secret_key is not None:
                make_server(router, cfg.curve_secret_key)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # Room for one whole replay (buffer, end marker) per client.
            router.setsockopt(zmq.SNDHWM, cfg.buffer_steps + 2)
            limit_requests(router)
            router.bind(endpoint)
            return pub, router
        except zmq.ZMQError as exc:
            for sock in sockets:
                sock.close(linger=0)
            self._release_zap()
            if self._own_ctx:
                self._ctx.term()
            raise EventPublisherError(f"cannot open {field} {endpoint!r}: {exc}") from exc

    def _release_zap(self) -> None:
        if self._zap:
            release_clients(self._ctx)
            self._zap = False

    def publish(self, events: list[KVEvent]) -> int:
        """Queue one batch; returns its sequence number. Never waits for the network.

        Raises InvalidEventError (before a sequence number is used) for a malformed
        event, EventPublisherError if closed or if the send thread has died.
        """
        events = list(events)
        _check_events(events)
        batch = KVEventBatch(
            ts=self._clock(), events=events, data_parallel_rank=self.config.data_parallel_rank
        )
        payload = encode_batch(batch, self.config.encoding)
        with self._lock:
            if self._closed:
                raise EventPublisherError("publish on a closed EventPublisher")
            if self._sender_error is not None:
                raise EventPublisherError(
                    f"send thread died: {self._sender_error!r}"
                ) from self._sender_error
            seq = self._log.record(payload, events)
            try:
                self._queue.put_nowait((seq, payload))
            except queue.Full:
                self._dropped[0] += 1
                self._dropped[1] += len(events)
                return seq
            self._published[0] += 1
            self._published[1] += len(events)
            self._wake()
        return seq

    def _wake(self) -> None:
        # Called with _lock held so close() cannot close the pipe under us.
        # A full pipe already holds wake-ups enough: the thread will run.
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"\0")

    def _wake_unlocked(self) -> None:
        """Wake the send thread from the snapshot builder (a snapshot is ready)."""
        with self._lock:
            if not self._closed:
                self._wake()

    def stats(self) -> PublisherStats:
        replay = self._replay
        with self._lock:
            return PublisherStats(
                published_batches=self._published[0],
                published_events=self._published[1],
                dropped_batches=self._dropped[0],
                dropped_events=self._dropped[1],
                sent_batches=self._sent,
                replay_requests=replay.replays if replay else 0,
                snapshot_requests=replay.snapshots if replay else 0,
                bad_requests=replay.bad_requests if replay else 0,
                failed_replies=replay.failed if replay else 0,
            )

    @property
    def next_seq(self) -> int:
        """The sequence number the next accepted batch will get."""
        return self._log.next_seq

    def close(self) -> None:
        """Stop the send thread and close the sockets (linger 0: unsent data is lost).

        Safe to call more than once. Batches already queued are handed to the PUB
        socket first, but with linger 0 a subscriber may not get them.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake()
        self._thread.join(_JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            logger.error("KV event send thread did not stop; leaving its sockets open")
            return
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self._replay is not None:
            self._replay.close()
        self._release_zap()
        if self._own_ctx:
            self._ctx.term()

    # --- send thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            logger.exception("KV event send thread died")
            self._sender_error = exc
        finally:
            self._pub.close(linger=0)
            if self._router is not None:
                self._router.close(linger=0)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._wake_r in ready:
                self._drain_wake_pipe()
            self._send_queued()
            if self._replay is not None:
                if self._router in ready:
                    self._replay.serve_pending()
                self._replay.send_built()
            if self._closed:
                self._send_queued()
                return

    def _drain_wake_pipe(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass

    def _send_queued(self) -> None:
        while True:
            try:
                seq, payload = self._queue.get_nowait()
            except queue.Empty:
                return
            # PUB never blocks: at its high-water mark it drops for that subscriber.
            self._pub.send_multipart([self._topic, encode_seq(seq), payload], zmq.NOBLOCK)
            self._sent += 1
