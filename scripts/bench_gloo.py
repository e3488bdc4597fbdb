"""What a gloo all-reduce costs by its element count: why a lockstep step's collectives
carry as few int64 as they can (``tpcache.group.tp_group``).

    .venv/bin/python scripts/bench_gloo.py [--ranks 2 4] [--sizes 1 2 3 6] [--calls 1000]
        [--rounds 3] [--ops min band]

For each group size, spawned processes on 127.0.0.1 form one gloo group and run, in
interleaved rounds, ``--calls`` back-to-back all-reduces of an int64 tensor of each size
with each reduction (``min``: what ``agree_min`` and the checked lists use; ``band``: the
bitwise AND of ``digest_check``). Printed per cell: the CPU one call costs a rank (the
process, gloo's own threads included; median over rounds of the mean over ranks) and
the wall time of one call.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tpcache.group.spec import free_port

OPS = {"min": dist.ReduceOp.MIN, "band": dist.ReduceOp.BAND}


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: mp.Queue) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    cells = [(op, n) for op in args.ops for n in args.sizes]
    tensors = {n: torch.full((n,), -1, dtype=torch.int64) for n in args.sizes}
    for op, n in cells:  # warm up every cell's buffers
        for _ in range(20):
            dist.all_reduce(tensors[n], op=OPS[op])
    rows = []
    for rnd in range(args.rounds):
        order = cells[rnd % len(cells) :] + cells[: rnd % len(cells)]
        for op, n in order:
            t = tensors[n]
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(args.calls):
                dist.all_reduce(t, op=OPS[op])
            cpu = (time.process_time() - c0) / args.calls
            rows.append((rnd, (op, n), cpu, (time.perf_counter() - w0) / args.calls))
    dist.destroy_process_group()
    out.put((rank, rows))


def measure(world: int, args: argparse.Namespace) -> dict[tuple[str, int], tuple[float, float]]:
    """(op, size) -> (CPU ms per call per rank, wall ms per call), medians over rounds."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=rank_main, args=(r, world, port, args, out), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    reports = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=10)
    by_round: dict[tuple[int, tuple[str, int]], list[tuple[float, float]]] = {}
    for _, rows in reports:
        for rnd, cell, cpu, wall in rows:
            by_round.setdefault((rnd, cell), []).append((cpu, wall))
    result = {}
    for cell in [(op, n) for op in args.ops for n in args.sizes]:
        cpus = [statistics.mean(c for c, _ in by_round[(r, cell)]) for r in range(args.rounds)]
        walls = [statistics.mean(w for _, w in by_round[(r, cell)]) for r in range(args.rounds)]
        result[cell] = (statistics.median(cpus) * 1e3, statistics.median(walls) * 1e3)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3, 6])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ops", nargs="+", choices=sorted(OPS), default=["min", "band"])
    args = ap.parse_args()
    if any(n < 1 for n in args.sizes) or args.calls < 1 or args.rounds < 1:
        ap.error("--sizes, --calls and --rounds must be >= 1")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"gloo all-reduce of int64, torch {torch.__version__}, on {platform.node()}: "
        f"{os.cpu_count()} cpus, load avg {load}; {args.calls} calls x {args.rounds} rounds"
    )
    print("ranks   op elements  cpu ms/call/rank  wall ms/call")
    for world in args.ranks:
        for (op, n), (cpu, wall) in measure(world, args).items():
            print(f"{world:>5} {op:>4} {n:>8} {cpu:>17.3f} {wall:>13.3f}")


if __name__ == "__main__":
    main()
