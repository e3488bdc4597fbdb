"""Lockstep cost: per-step latency and steps/s at TP=2 and TP=4 on CPU ranks, for
batches of 1, 8 and 64 requests (admit + finish each), unpipelined and pipelined (up to
4 messages in flight), the latter with and without coalescing (up to the default
``CoordinatorConfig().coalesce`` steps per message while every slot is taken;
``coalesce=1``: one step per message), on the step channel (``transport="channel"``,
the default) and on Ray actor calls (``transport="ray"``), both in the same run with
their rounds alternating, each against its own floor measured in the same rounds: the
same bytes as a step sent to every rank over the same path, where every rank does one
bare all-reduce of one element and answers (what a step cannot avoid).

    .venv/bin/python scripts/bench_lockstep.py [--tp 2 4] [--transport channel ray]
        [--steps 60] [--piped-steps 300] [--rounds 3] [--json]

``vs_ray`` is, for each channel row, the Ray row's unpipelined step latency over the
channel's (the median of the per-round ratios).

Honesty rules it keeps: the floor is sampled inside every round, next to the steps it is
compared with (the machine is shared: load moves within a minute), and once more in a
paired pass that times each unpipelined step right after its own floor ping (``xflr_p``:
the two see the same machine); every figure is a
median (latency over steps, rates and CPU over rounds); the unpipelined and pipelined
runs of a cell alternate within each round (their order rotates from round to round).
A cell also reports what the step's own cache work costs (the coordinator's mirror, and
the slowest rank's ops and digest before its collective), how many collectives each rank
entered per step, and the CPU the driver and the ranks burnt per step next to how busy
the whole machine was: when the machine is saturated, pipelining cannot add steps/s, and
these columns show it. The ``evict`` rows
run the batch-8 workload in a cache so small that every admit evicts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import ray

from tpcache.coordinator.core import Coordinator, CoordinatorConfig
from tpcache.frontend.service import GroupConfig, start_group
from tpcache.lockstep.ops import Admit, Finish, Step, encode, pack_tokens
from tpcache.workers.rank import CacheSpec

_TCK = os.sysconf("SC_CLK_TCK")
COALESCE = CoordinatorConfig().coalesce  # the default the pipelined runs use


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TCK


def machine_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine so far (idle and iowait are not busy)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4], sum(v)


@dataclass
class Sample:
    """What one timed run of ``steps`` steps measured."""

    lat_s: list[float]  # per step, from the first call of its batch to its last result
    mirror_s: list[float]  # per step, the coordinator's calls (its mirror) before sending
    rate: float  # steps/s over the whole run, the final sync included
    steps_per_message: float
    cpu_ms: float  # driver + ranks CPU per step
    busy: float  # machine-wide busy fraction during the run
    collectives: float  # collectives per step per rank
    rank_ops_ms: float  # median, slowest rank's ops + digest before the step's collective
    evicted_pages: int  # by the run's admits (0 in a "large" cell: checked)


class Cell:
    def __init__(self, coord: Coordinator, pids: list[int]) -> None:
        self.coord = coord
        self.pids = pids
        self.rid = 0

    def collectives(self) -> int:
        return sum(i.get("collectives", 0) for i in self.coord.ranks.call("info"))

    def run(
        self, batch: int, steps: int, pipelined: bool, seed: int, coalesce: int = COALESCE
    ) -> Sample:
        coord = self.coord
        coord.config = CoordinatorConfig(max_inflight=4 if pipelined else 1, coalesce=coalesce)
        shared, tails = workload(batch, steps, seed)
        c0 = self.collectives()
        ev0 = coord.mirror.stats().evicted_pages[0]
        msg0 = coord.counters.messages
        coord.counters.rank_ops_s.clear()
        lat, mir = [], []
        cpu0 = sum(proc_cpu_s(p) for p in self.pids)
        m0 = machine_ticks()
        t0 = time.perf_counter()
        for s in range(steps):
            t = time.perf_counter()
            with coord.batch():
                self.calls(shared, tails[s])
                mir.append(time.perf_counter() - t)
            if not pipelined:
                coord.sync()
            lat.append(time.perf_counter() - t)
        coord.sync()
        elapsed = time.perf_counter() - t0
        m1 = machine_ticks()
        cpu1 = sum(proc_cpu_s(p) for p in self.pids)
        per_rank = (self.collectives() - c0) / len(self.pids[1:]) / steps
        ops = list(coord.counters.rank_ops_s)
        evicted = coord.mirror.stats().evicted_pages[0] - ev0
        return Sample(
            lat,
            mir,
            steps / elapsed,
            steps / max(1, coord.counters.messages - msg0),
            (cpu1 - cpu0) / steps * 1e3,
            (m1[0] - m0[0]) / max(1, m1[1] - m0[1]),
            per_rank,
            statistics.median(ops) * 1e3 if ops else float("nan"),
            evicted,
        )

    def calls(self, shared: np.ndarray, tails: np.ndarray) -> None:
        """One step's calls: an admit and a finish per request."""
        for tail in tails:
            self.coord.admit(self.rid, np.concatenate((shared, tail)))
            self.coord.finish(self.rid, tail[:4])
            self.rid += 1

    def paired(self, batch: int, steps: int, seed: int) -> tuple[list[float], list[float]]:
        """``steps`` times: one floor ping, then one unpipelined step, so that each step is
        compared with a floor taken a moment before it on a machine whose speed drifts.
        Returns (ping seconds, step seconds)."""
        coord = self.coord
        coord.config = CoordinatorConfig(max_inflight=1, coalesce=1)
        shared, tails = workload(batch, steps, seed)
        pings: list[float] = []
        lat: list[float] = []
        payload = step_bytes(batch)
        for s in range(steps):
            pings += floor_samples(coord, 1, payload)
            t = time.perf_counter()
            with coord.batch():
                self.calls(shared, tails[s])
            coord.sync()
            lat.append(time.perf_counter() - t)
        return pings, lat


def workload(batch: int, steps: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A shared 48-token prefix, and per step ``batch`` 16-token tails (seeded)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, 30_000, size=48, dtype=np.int32)
    return shared, rng.integers(1, 30_000, size=(steps, batch, 16), dtype=np.int32)


def step_bytes(batch: int) -> bytes:
    """An encoded step of ``batch`` admits and finishes like the workload's: what the
    floor sends, so that it moves as many bytes as a step does."""
    shared, tails = workload(batch, 1, 0)
    ops = []
    for i, tail in enumerate(tails[0]):
        ops.append(Admit(i, pack_tokens(np.concatenate((shared, tail)))))
        ops.append(Finish(i, pack_tokens(tail[:4])))
    return encode(Step(0, ops))


def floor_samples(
    coord: Coordinator, n: int, payload: bytes = b"", collective: bool = True
) -> list[float]:
    """``n`` timings of ``payload`` sent to every rank over the group's step path, each
    rank doing one bare all-reduce of one element (unless not ``collective``) and
    answering."""
    ranks = coord.ranks
    out = []
    for _ in range(n):
        t = time.perf_counter()
        if ranks.transport == "ray":
            ray.get([a.collective_ping.remote(payload, collective) for a in ranks.actors])
        else:
            ranks.call("collective_ping", payload, collective)
        out.append(time.perf_counter() - t)
    return out


def med(xs: list[float]) -> float:
    return statistics.median(xs)


@dataclass
class Acc:
    """What one cell measured over its rounds so far."""

    floor: list[float]
    unp: list[Sample]
    pip: list[Sample]
    pip1: list[Sample]  # pipelined, one step per message
    pair_floor: list[float]
    pair_step: list[float]
    round_lat: list[float]  # per round, the median unpipelined step latency
    ping: list[float]  # the floor's round trip without its all-reduce

    @classmethod
    def new(cls) -> Acc:
        return cls([], [], [], [], [], [], [], [])


def measure_round(
    cell: Cell, acc: Acc, batch: int, steps: tuple[int, int], r: int, tag: str
) -> None:
    """One round of (floor, unpipelined, pipelined, paired) for one cell; ``steps``:
    (unpipelined, pipelined) steps a run. A pipelined run is longer: at ~1,000 steps/s,
    60 steps last 60 ms, of which filling and draining 4 messages in flight is a tenth;
    an engine runs the pipeline for as long as it serves."""
    steps, piped_steps = steps
    acc.floor += floor_samples(cell.coord, steps, step_bytes(batch))
    acc.ping += floor_samples(cell.coord, steps, step_bytes(batch), collective=False)
    order: list[tuple[bool, int, list[Sample]]] = [
        (False, 1, acc.unp),
        (True, COALESCE, acc.pip),
        (True, 1, acc.pip1),
    ]
    k = r % len(order)
    for pipelined, coalesce, into in order[k:] + order[:k]:
        n = piped_steps if pipelined else steps
        into.append(cell.run(batch, n, pipelined, 1000 * r + batch, coalesce))
        if tag != "evict" and into[-1].evicted_pages:
            # Evicting ops each enter an all-reduce: such a run measures another workload.
            raise SystemExit(
                f"a '{tag}' run evicted {into[-1].evicted_pages} pages: the cache is too small"
            )
        if tag != "evict":
            cell.coord.reset()
            cell.coord.sync()
    acc.round_lat.append(med(acc.unp[-1].lat_s))
    pings, lat = cell.paired(batch, steps, 1000 * r + batch + 500)
    acc.pair_floor += pings
    acc.pair_step += lat
    if tag != "evict":
        cell.coord.reset()
        cell.coord.sync()


def summarize(cell: Cell, acc: Acc, batch: int, tag: str) -> dict:
    """Medians over every round of a cell."""
    floor, unp, pip, pip1 = acc.floor, acc.unp, acc.pip, acc.pip1
    pair_floor, pair_step = acc.pair_floor, acc.pair_step
    lat = med([x for s in unp for x in s.lat_s])
    fl = med(floor)
    mirror = med([x for s in unp for x in s.mirror_s])
    rank_ops = med([s.rank_ops_ms for s in unp]) * 1e-3

    def over(samples: list[Sample], get: Callable[[Sample], float]) -> float:
        return med([get(s) for s in samples])

    return {
        "tp": cell.coord.ranks.world_size,
        "transport": cell.coord.ranks.transport,
        "batch": batch,
        "cache": tag,
        "floor_ms": round(fl * 1e3, 3),
        "step_ms_unpipelined": round(lat * 1e3, 3),
        "overhead_vs_floor": round(lat / fl, 2),
        # Against the round trip alone: a step that agrees nothing makes no collective.
        "ping_ms": round(med(acc.ping) * 1e3, 3),
        "overhead_vs_ping": round(lat / med(acc.ping), 2),
        # The same from the paired pass: each step right after its own floor ping.
        "floor_paired_ms": round(med(pair_floor) * 1e3, 3),
        "step_paired_ms": round(med(pair_step) * 1e3, 3),
        "overhead_vs_floor_paired": round(med(pair_step) / med(pair_floor), 2),
        # The same without the step's own cache work (the mirror's calls before the send,
        # the slowest rank's ops and digest): what lockstep adds around the work.
        "overhead_beyond_work_vs_floor": round((lat - mirror - rank_ops) / fl, 2),
        "mirror_ms": round(mirror * 1e3, 3),
        "rank_ops_ms": round(rank_ops * 1e3, 3),
        "collectives_per_step": round(over(unp, lambda s: s.collectives), 2),
        "steps_s_unpipelined": round(over(unp, lambda s: s.rate), 1),
        "steps_s_pipelined": round(over(pip, lambda s: s.rate), 1),
        "pipelining_gain": round(over(pip, lambda s: s.rate) / over(unp, lambda s: s.rate), 2),
        "steps_per_message_pipelined": round(over(pip, lambda s: s.steps_per_message), 2),
        "steps_s_pipelined_uncoalesced": round(over(pip1, lambda s: s.rate), 1),
        "pipelining_gain_uncoalesced": round(
            over(pip1, lambda s: s.rate) / over(unp, lambda s: s.rate), 2
        ),
        "cpu_ms_per_step_unpipelined": round(over(unp, lambda s: s.cpu_ms), 2),
        "cpu_ms_per_step_pipelined": round(over(pip, lambda s: s.cpu_ms), 2),
        # The most pipelining could give if this run owned every core: steps/s can reach
        # at most cores / (CPU per step), against 1 / latency unpipelined.
        "gain_bound_all_cores": round(
            (os.cpu_count() or 1) * lat * 1e3 / over(unp, lambda s: s.cpu_ms), 2
        ),
        "machine_busy_unpipelined": round(over(unp, lambda s: s.busy), 2),
        "machine_busy_pipelined": round(over(pip, lambda s: s.busy), 2),
    }


def group(tp: int, capacity: int, transport: str = "channel") -> tuple[Cell, Coordinator]:
    cfg = GroupConfig(
        tp=tp,
        capacity_tokens=capacity,
        cache=CacheSpec(page_size=16),
        kv_heads=tp,
        num_layers=1,
        head_dim=4,
        cpu_budget_bytes=1 << 26,
        transport=transport,
    )
    coord = start_group(cfg)
    # This process is the coordinator: its objects so far leave the collector's scans,
    # as a served coordinator's do (CoordinatorService) and the ranks' (serve_steps).
    gc.freeze()
    pids = [os.getpid(), *coord.ranks.call("pid")]
    cell = Cell(coord, pids)
    cell.run(8, 10, True, 0)  # warm-up
    coord.reset()
    coord.sync()
    return cell, coord


def compare(
    tp: int, transports: list[str], capacity: int, batches: list[int], args, tag: str
) -> list[dict]:
    """Rows for every (transport, batch), the transports' rounds alternating."""
    cells = {t: group(tp, capacity, t) for t in transports}
    rows = []
    try:
        for batch in batches:
            accs = {t: Acc.new() for t in transports}
            for r in range(args.rounds):
                k = r % len(transports)
                for t in transports[k:] + transports[:k]:
                    steps = (args.steps, args.piped_steps)
                    measure_round(cells[t][0], accs[t], batch, steps, r, tag)
            got = {t: summarize(cells[t][0], accs[t], batch, tag) for t in transports}
            if "ray" in got and "channel" in got:
                ratios = [
                    x / y
                    for x, y in zip(accs["ray"].round_lat, accs["channel"].round_lat, strict=True)
                ]
                got["channel"]["vs_ray"] = round(med(ratios), 2)
            rows += got.values()
    finally:
        for _, coord in cells.values():
            coord.close()
    return rows


def machine() -> str:
    model = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{platform.node()}: {os.cpu_count()} cpus ({model}), load avg {load}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--piped-steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-evict", action="store_true", help="skip the evicting-cache rows")
    ap.add_argument(
        "--transport", nargs="+", default=["channel", "ray"], choices=["channel", "ray"]
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    where = machine()
    tmp = tempfile.mkdtemp(prefix="tpb", dir="/tmp")
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=tmp, log_to_driver=False)
    rows = []
    # Room for every request of the longest run without eviction (each caches one page of
    # its own beyond the shared prefix), twice over.
    large = 2 * 16 * (max(args.steps, args.piped_steps) * max(args.batch) + 16)
    for tp in args.tp:
        rows += compare(tp, args.transport, large, args.batch, args, "large")
        if not args.no_evict:
            # 64 pages: the shared prefix stays, each admit evicts an older request's page.
            rows += compare(tp, args.transport, 64 * 16, [8], args, "evict")
    if args.json:
        print(
            json.dumps(
                {
                    "machine": where,
                    "steps": args.steps,
                    "piped_steps": args.piped_steps,
                    "rounds": args.rounds,
                    "rows": rows,
                }
            )
        )
        return
    print(f"lockstep benchmark on {where}")
    print(
        f"{args.steps} steps ({args.piped_steps} pipelined) x {args.rounds} rounds per cell; "
        "medians; floor sampled each round"
    )
    head = (
        f"{'tp':>2} {'path':>7} {'batch':>5} {'cache':>5} {'floor':>6} {'step':>6} {'xflr':>5} "
        f"{'xflr_p':>6} {'ping':>5} {'xping':>5} {'vs_ray':>6} "
        f"{'xflr_w':>6} "
        f"{'mirror':>6} "
        f"{'rkops':>6} {'coll':>4} {'steps/s':>7} {'piped/s':>7} {'gain':>5} {'st/msg':>6} "
        f"{'pip1/s':>7} {'gain1':>5} "
        f"{'cpu/st':>6} {'cpu/st_p':>8} {'gmax':>4} {'busy':>4} {'busy_p':>6}"
    )
    print(head)
    for r in rows:
        vs = f"{r['vs_ray']:>6.2f}" if "vs_ray" in r else f"{'':>6}"
        print(
            f"{r['tp']:>2} {r['transport']:>7} {r['batch']:>5} {r['cache']:>5} {r['floor_ms']:>6.2f} "
            f"{r['step_ms_unpipelined']:>6.2f} {r['overhead_vs_floor']:>5.2f} "
            f"{r['overhead_vs_floor_paired']:>6.2f} {r['ping_ms']:>5.2f} "
            f"{r['overhead_vs_ping']:>5.2f} {vs} "
            f"{r['overhead_beyond_work_vs_floor']:>6.2f} {r['mirror_ms']:>6.2f} "
            f"{r['rank_ops_ms']:>6.2f} {r['collectives_per_step']:>4.1f} "
            f"{r['steps_s_unpipelined']:>7.1f} {r['steps_s_pipelined']:>7.1f} {r['pipelining_gain']:>5.2f} "
            f"{r['steps_per_message_pipelined']:>6.2f} {r['steps_s_pipelined_uncoalesced']:>7.1f} "
            f"{r['pipelining_gain_uncoalesced']:>5.2f} "
            f"{r['cpu_ms_per_step_unpipelined']:>6.2f} {r['cpu_ms_per_step_pipelined']:>8.2f} "
            f"{r['gain_bound_all_cores']:>4.2f} {r['machine_busy_unpipelined']:>4.2f} {r['machine_busy_pipelined']:>6.2f}"
        )
    print(
        "path: the step path (channel: the step channel, Unix sockets on one node; ray: an actor call per rank); "
        "vs_ray: the Ray path's unpipelined step latency over the channel's (median of "
        "per-round ratios); ms columns: floor, step (unpipelined latency), mirror (coordinator's calls before the "
        "send), rkops (slowest rank's ops + digest); xflr: step / floor; xflr_p: the same "
        "from a pass that times each step right after its own floor ping; ping: the same "
        "bytes and answers without the all-reduce; xping: step / ping; xflr_w: (step - "
        "mirror - rkops) / floor, what lockstep adds beyond the step's own cache work; "
        "coll: collectives per rank per step; "
        "piped/s, gain, st/msg: pipelined with coalescing (steps per message); pip1/s, gain1: "
        "pipelined, one step per message; cpu/st_p, busy_p: the coalescing run; "
        "cpu/st: driver + ranks CPU ms per step; gmax: cpus * step / cpu/st, the most "
        "pipelining could gain with every core free; busy: whole-machine busy fraction"
    )


if __name__ == "__main__":
    main()
