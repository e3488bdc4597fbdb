"""The lines tpcache logs for an operator, through Python's ``logging`` (logger
``tpcache`` and its children: ``tpcache.coordinator``, ``tpcache.frontend``,
``tpcache.engine``).

What is logged is what an operator acts on, one line each: a rank that died or hung
(which rank, its Ray actor and node, what was seen), a recovery started, failed and
done (how long, which ranks were replaced), a divergence (the odd rank, the step), a
client the frontends refused. Steps, admits and hits are never logged: they are the
metrics' and ``stats()``'s.

Library code only gets loggers; it never adds handlers. Whoever runs tpcache decides
where lines go: the ``tpcache`` command calls ``configure`` (``--log-level``), and so
does the Ray actor that holds a served coordinator when the command asks it to, which
also keeps its lines in a ``LineBuffer`` for the command to print (``tpcache serve``).
A leaf: imports nothing of tpcache but ``errors``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TextIO

from tpcache.errors import TpcacheError

ROOT = "tpcache"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# A line carries at most this much of an error's text (Ray's own errors run to pages).
MAX_DETAIL = 400


class LogLevelError(TpcacheError, ValueError):
    """A log level that is not one of ``LEVELS``."""


def check_level(level: object) -> int:
    """The ``logging`` level named by ``level`` (any case). Raises ``LogLevelError``."""
    name = level.upper() if isinstance(level, str) else level
    if name not in LEVELS:
        raise LogLevelError(f"the log level must be one of {', '.join(LEVELS)}, got {level!r}")
    return int(getattr(logging, str(name)))


def one_line(text: object, limit: int = MAX_DETAIL) -> str:
    """``text`` on one line, at most ``limit`` characters: an error's message in a log line
    (a traceback or a multi-line Ray error would split the line an operator greps)."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


class StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at each line (a test's capture, a daemon's
    redirect), not the stream it was made with, which may be closed by then."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass  # always sys.stderr


class LineBuffer(logging.Handler):
    """Keeps the last ``limit`` lines, numbered from 0, for another process to fetch
    (``since``): how a served coordinator's lines reach the ``tpcache serve`` that
    started it without Ray's worker-log forwarding. ``id`` tells a fresh buffer (a
    restarted actor) from the one a reader had. Any thread may call."""

    def __init__(self, limit: int = 10_000) -> None:
        super().__init__()
        self.id = os.urandom(8).hex()
        self._lines: deque[str] = deque(maxlen=limit)  # under the handler's lock
        self._next = 0  # the number the next line gets (under the handler's lock)

    def emit(self, record: logging.LogRecord) -> None:  # called with the lock held
        try:
            self._lines.append(self.format(record))
            self._next += 1
        except Exception:
            self.handleError(record)

    def since(self, after: int) -> tuple[int, list[str], int]:
        """The lines numbered ``after`` and later: ``(the next number, lines, how many of
        those were dropped already)``. Changes nothing."""
        with self.lock:  # type: ignore[union-attr]  # made by Handler.__init__
            first = self._next - len(self._lines)
            start = max(after, first)
            lines = list(self._lines)[start - first :]
            return self._next, lines, max(0, first - after)


def configure(level: str | int, extra: logging.Handler | None = None) -> logging.Logger:
    """Send the ``tpcache`` logger's lines at ``level`` and above to stderr (and to
    ``extra``), replacing what an earlier call set up. For programs and the served
    actor, never for library code. Raises ``LogLevelError``."""
    number = check_level(level) if isinstance(level, str) else level
    logger = logging.getLogger(ROOT)
    for h in list(logger.handlers):
        if getattr(h, "tpcache_configured", False):
            logger.removeHandler(h)
    formatter = logging.Formatter(FORMAT)
    for h in (StderrHandler(), extra):
        if h is not None:
            h.setFormatter(formatter)
            h.tpcache_configured = True  # type: ignore[attr-defined]
            logger.addHandler(h)
    logger.setLevel(number)
    return logger


class Throttle:
    """At most one line per kind every ``every_s`` seconds; the lines held back are
    counted and told with the next line of their kind. For what a client can make
    happen as often as it likes (a refused request), so a misconfigured or hostile
    client cannot fill the log. Kinds are a few fixed words, so the table stays small.
    Thread-safe."""

    def __init__(
        self,
        logger: logging.Logger,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.every_s = every_s
        self.clock = clock
        self._lock = threading.Lock()
        self._next_at: dict[str, float] = {}  # kind -> when its next line may go
        self._held: dict[str, int] = {}  # kind -> lines held back since its last one

    def warning(self, kind: str, message: str) -> bool:
        """Log ``message`` as a warning unless a line of ``kind`` went out less than
        ``every_s`` ago (then count it). Returns whether it was logged."""
        if not self.logger.isEnabledFor(logging.WARNING):
            return False
        with self._lock:
            now = self.clock()
            if now < self._next_at.get(kind, float("-inf")):
                self._held[kind] = self._held.get(kind, 0) + 1
                return False
            self._next_at[kind] = now + self.every_s
            held = self._held.pop(kind, 0)
        if held:
            message += f" ({held} more like it since the last such line)"
        self.logger.warning(message)
        return True


__all__ = [
    "LEVELS",
    "ROOT",
    "LineBuffer",
    "LogLevelError",
    "StderrHandler",
    "Throttle",
    "check_level",
    "configure",
    "one_line",
]
