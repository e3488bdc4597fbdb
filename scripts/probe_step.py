"""Where a lockstep step's time goes: a timeline of one batch-1 step against the floor's
bare ping, at TP=2 on CPU ranks, on one clock (``time.perf_counter`` is system-wide on
Linux, so the ranks' stamps and the driver's compare).

    .venv/bin/python scripts/probe_step.py [--tp 2] [--steps 400]

It alternates a ping (every rank runs one bare one-element all-reduce, as
``bench_lockstep``'s floor) and a step (one admit + finish through the coordinator) for
``--steps`` rounds, and prints, as medians in ms from the moment the driver starts
sending (the step's mirror comes before that): when the Ray submit of every task
returns, when the task starts on each rank, when each rank enters the step's last
collective and when it leaves it, and when the driver has every result.

The ranks' methods are reached through ``__ray_call__`` wrappers that stamp the clock, for
both the ping and the step, so both pay the same extra; the absolute figures are a
little above ``bench_lockstep``'s. Not part of the package.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lockstep import group, machine, workload


def _stamp_collectives(worker: Any) -> bool:
    """On a rank: stamp the clock around every collective a step or a ping enters."""
    worker._stamps = []
    worker._now = []
    grp = worker._group()
    for name in ("digest_check", "agree_min"):
        fn = getattr(grp, name)

        def stamped(*args: Any, _fn: Any = fn) -> Any:
            worker._now.append(time.perf_counter())
            out = _fn(*args)
            worker._now.append(time.perf_counter())
            return out

        setattr(grp, name, stamped)
    return True


def _stamped(worker: Any, method: str, *args: Any) -> Any:
    """On a rank: run ``method`` and keep its stamps (start, collectives, end)."""
    worker._now = [time.perf_counter()]
    out = getattr(worker, method)(*args)
    worker._now.append(time.perf_counter())
    worker._stamps.append(worker._now)
    return out


def _take(worker: Any) -> list[list[float]]:
    out, worker._stamps = worker._stamps, []
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()
    if args.tp < 2 or args.steps < 1:
        ap.error("--tp must be >= 2 and --steps >= 1")
    where = machine()
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        _temp_dir=tempfile.mkdtemp(prefix="tpp", dir="/tmp"),
        log_to_driver=False,
    )
    cell, coord = group(args.tp, 1 << 18, transport="ray")
    actors = coord.ranks.actors
    ray.get([a.__ray_call__.remote(_stamp_collectives) for a in actors])
    submit_s: list[float] = []

    def send(steps: list[bytes]) -> tuple[bool, list[Any]]:
        t = time.perf_counter()
        refs = [a.__ray_call__.remote(_stamped, "apply", steps[0]) for a in actors]
        submit_s.append(time.perf_counter() - t)
        return False, refs

    coord.ranks.send = send  # type: ignore[method-assign]
    shared, tails = workload(1, args.steps, 0)
    rows: dict[str, list[tuple[float, float, float, float]]] = {"ping": [], "step": []}
    try:
        for s in range(args.steps):
            t0 = time.perf_counter()
            refs = [a.__ray_call__.remote(_stamped, "collective_ping") for a in actors]
            t1 = time.perf_counter()
            ray.get(refs)
            rows["ping"].append((t0, t0, t1 - t0, time.perf_counter()))
            t0 = time.perf_counter()
            with coord.batch():
                cell.calls(shared, tails[s])
                sent = time.perf_counter()
            coord.sync()
            rows["step"].append((t0, sent, submit_s[-1], time.perf_counter()))
        stamps = ray.get([a.__ray_call__.remote(_take) for a in actors])
    finally:
        coord.close()

    def ms(xs: list[float]) -> str:
        return f"{statistics.median(xs) * 1e3:6.3f}"

    print(f"step timeline on {where}; TP={args.tp}, {args.steps} pings and steps, alternating")
    print("ms from the driver's send, medians")
    for k, kind in enumerate(("ping", "step")):
        got = rows[kind]
        per_rank = [s[k::2] for s in stamps]
        print(f"{kind}:")
        print(f"  mirror, before the send     {ms([r[1] - r[0] for r in got])}")
        print(f"  Ray submit to every rank    {ms([r[2] for r in got])}")
        for rank, st in enumerate(per_rank):
            pairs = list(zip(got, st, strict=True))
            print(
                f"  rank {rank}: starts {ms([s[0] - r[1] for r, s in pairs])},"
                f" enters its last collective {ms([s[-3] - r[1] for r, s in pairs])},"
                f" leaves it {ms([s[-2] - r[1] for r, s in pairs])}"
            )
        print(f"  every result at the driver  {ms([r[3] - r[1] for r in got])}")


if __name__ == "__main__":
    main()
