"""``--log-level`` and ``--worker-logs``: where the lines an operator acts on go (a rank
that died or hung, a recovery, a divergence, a refused client; ``tpcache.logs``).

The commands that run a group print those lines on stderr, at ``--log-level`` and above.
Where the coordinator runs in this process (``demo``, ``generate``) that is this
process's logging; where it runs in a Ray actor (``serve``), the actor logs at the same
level and ``serve`` fetches its lines and prints them here (``relay_lines``), unless
``--worker-logs`` has Ray forward every worker's output, the actor's lines with it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tpcache.logs import LEVELS, LogLevelError, check_level, configure

DEFAULT_LEVEL = "INFO"


def add_log_options(p: argparse.ArgumentParser, *, served: bool = False, ray: bool = True) -> None:
    """The log options of a command that runs a group: ``served``, in a Ray actor (its
    lines are fetched from it); ``ray``, its ranks are Ray workers (``--worker-logs``)."""
    g = p.add_argument_group("logs (on stderr)")
    where = (
        "; the coordinator's actor logs at this level too and this command prints its "
        "lines (a detached one's stay in its Ray worker log)"
        if served
        else ""
    )
    g.add_argument(
        "--log-level",
        default=DEFAULT_LEVEL,
        metavar="LEVEL",
        help=f"the least level of tpcache's lines printed: {', '.join(LEVELS)} (default "
        f"{DEFAULT_LEVEL}: ranks dead or hung, recoveries, divergences, refused clients; "
        f"DEBUG adds where each rank runs){where}",
    )
    if ray:
        g.add_argument(
            "--worker-logs",
            action="store_true",
            help="print the output of the Ray workers (the ranks"
            + (", and the coordinator's actor, whose lines then come this way" if served else "")
            + ") here, as Ray forwards it, each line marked with its worker; off by default",
        )


def configure_logs(args: argparse.Namespace) -> str | None:
    """Set up this process's logging from the options (a command without them: nothing).
    Returns what is wrong with ``--log-level``, or None."""
    level = getattr(args, "log_level", None)
    if level is None:
        return None
    try:
        configure(check_level(level))
    except LogLevelError as exc:
        return f"--log-level: {exc}"
    return None


class LineRelay:
    """Prints a served coordinator's log lines here, fetched from its actor
    (``CoordinatorService.log_lines``). A restarted actor has a new buffer: its lines are
    read from the start. Owned by the command's wait loop."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.buffer = ""  # the id of the actor's buffer read so far
        self.next = 0  # the number of the next line to fetch from it

    def __call__(self, timeout_s: float = 5.0) -> None:
        """Print the lines logged since the last call (none when the actor does not
        answer in time: the wait loop says what became of it)."""
        import ray

        try:
            buffer, nxt, lines, missed = ray.get(
                self.actor.log_lines.remote(self.buffer, self.next), timeout=timeout_s
            )
        except Exception:  # gone or restarting: the next call asks again
            return
        if missed:
            lines = [f"({missed} log lines of the coordinator were dropped before they were read)", *lines]  # fmt: skip
        for line in lines:
            print(line, file=sys.stderr)
        sys.stderr.flush()
        self.buffer, self.next = buffer, nxt
