"""A stand-in rank for the step channel's own tests: it runs the real channel loop
(``tpcache.transport.channel.serve``) around a worker whose "steps" are plain bytes, so the
tests can see exactly what arrived, in which order, and make a rank slow or kill it."""

from __future__ import annotations

import hashlib
import threading
import time

from tpcache.transport.channel import Attach, RankLoop, serve


class EchoWorker:
    """Answers a step with its length and digest; ``slow_s`` before each step."""

    def __init__(self, rank: int, slow_s: float = 0.0) -> None:
        self.rank = rank
        self.slow_s = slow_s
        self.seen: list[int] = []  # lengths of the steps applied, in order

    def apply(self, data: bytes) -> bytes:
        if self.slow_s:
            time.sleep(self.slow_s)
        if data == b"fail":
            raise ValueError(f"rank {self.rank} refused the step")
        self.seen.append(len(data))
        return len(data).to_bytes(8, "big") + hashlib.sha256(data).digest()[:8]

    def apply_steps(self, steps: list[bytes]) -> list[bytes]:
        return [self.apply(data) for data in steps]

    def echo(self, x: object) -> object:
        return (self.rank, x)


def run_rank(
    rank: int, attach: Attach, slow_s: float = 0.0, worker: EchoWorker | None = None
) -> tuple[threading.Thread, RankLoop]:
    """A rank's channel loop on a thread of this process (around ``worker`` if given)."""
    loop = RankLoop()
    worker = worker or EchoWorker(rank, slow_s)
    t = threading.Thread(target=serve, args=(worker, rank, attach, loop, 0.02), daemon=True)
    t.start()
    return t, loop


def rank_process(rank: int, attach: Attach) -> None:
    """A rank's channel loop as a whole process (to be killed)."""
    serve(EchoWorker(rank), rank, attach, RankLoop(), 0.02)


def expected(data: bytes) -> bytes:
    return len(data).to_bytes(8, "big") + hashlib.sha256(data).digest()[:8]
