"""Per-call CPU cost of the cache on the step path: admit + finish of a small request.

The workload of ``bench_lockstep``'s batch-8 step: a shared 48-token prefix and, per
request, a 16-token random tail; each request is admitted with the whole prompt and
finished with the first 4 tail tokens as its output. Three callers of the same calls:

- ``cache``: ``RadixCache.admit`` / ``finish`` directly (a rank's cache,
  ``CacheSpec(page_size=16).build(1 << 20, rank=True)``);
- ``apply``: what a rank runs, ``lockstep.apply_op`` on ops decoded from an encoded
  step (decoding not timed: the transport's);
- ``step``: a rank's whole step, ``lockstep.apply_step`` (8 pairs' ops, then the digest
  with the hashing of the step's new leaves), per pair;
- ``mirror``: what the coordinator runs per call (``oplog.logged_admit``, and its
  finish: the checked output cut to the row's slots, ``mirror.finish``, the op);

and ``digest``: one ``cache.digest()`` after each step of 8 pairs (a rank's per-step
check). The garbage collector runs as usual, but what exists before the timed calls is
frozen first (``gc.freeze``). Figures are CPU microseconds (``time.process_time``) per admit + finish pair
(per digest for ``digest``), the median over rounds; each round uses fresh caches.

    .venv/bin/python scripts/bench_calls.py [--pairs 4000] [--rounds 7] [--json]
    .venv/bin/python scripts/bench_calls.py --vs /tmp/old_tree [--rounds 7]

``--vs DIR`` runs each round in two subprocesses, one with ``DIR`` (another checkout of
the repository) first on ``PYTHONPATH`` and one with this one, alternating which goes
first (A B B A ...), and prints both medians and their ratio (old / new, the median of
the per-round ratios). Not part of the package.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tpcache.cache.keys import as_tokens
from tpcache.lockstep import oplog
from tpcache.lockstep.ops import Admit, Finish, Step, decode_step, encode, pack_tokens
from tpcache.workers.protocol import apply_op, apply_step, local_evict
from tpcache.workers.spec import CacheSpec

BATCH = 8
MODES = ("cache", "apply", "step", "mirror", "digest")


def machine() -> str:
    return (
        f"{platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()},"
        f" numpy {np.__version__}"
    )


def workload(pairs: int, seed: int) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """The shared prefix, each request's prompt and each request's output."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, 30_000, size=48, dtype=np.int32)
    tails = rng.integers(1, 30_000, size=(pairs, 16), dtype=np.int32)
    return shared, [np.concatenate((shared, t)) for t in tails], [t[:4] for t in tails]


def fresh_cache(shared: np.ndarray):
    cache = CacheSpec(page_size=16).build(1 << 20, rank=True)
    cache.admit(-1, shared)  # the shared prefix is cached before the timed calls
    cache.finish(-1)
    # What exists now is frozen, as a long-running server would after start-up: a rare full
    # collection over unrelated objects (tens of ms) would otherwise decide a round.
    gc.collect()
    gc.freeze()
    return cache


def run_cache(pairs: int, seed: int) -> float:
    shared, prompts, outs = workload(pairs, seed)
    cache = fresh_cache(shared)
    admit, finish = cache.admit, cache.finish
    t0 = time.process_time()
    for i in range(pairs):
        admit(i, prompts[i])
        finish(i, outs[i])
    return time.process_time() - t0


def run_apply(pairs: int, seed: int) -> float:
    shared, prompts, outs = workload(pairs, seed)
    cache = fresh_cache(shared)
    evict_fn = local_evict(cache)
    ops = []
    for s in range(0, pairs, BATCH):
        step = []
        for i in range(s, min(s + BATCH, pairs)):
            step += [Admit(i, pack_tokens(prompts[i])), Finish(i, pack_tokens(outs[i]))]
        ops += decode_step(encode(Step(s, step, peer_check=False))).ops
    t0 = time.process_time()
    for op in ops:
        apply_op(cache, op, evict_fn)
    return time.process_time() - t0


def run_step(pairs: int, seed: int) -> float:
    """A rank's whole step (``apply_step``: its ops, then its digest) per batch of 8 pairs;
    the step channel's kind (no peer check), so no collective is entered."""
    shared, prompts, outs = workload(pairs, seed)
    cache = fresh_cache(shared)
    steps = []
    for s in range(0, pairs, BATCH):
        ops = []
        for i in range(s, min(s + BATCH, pairs)):
            ops += [Admit(i, pack_tokens(prompts[i])), Finish(i, pack_tokens(outs[i]))]
        steps.append(decode_step(encode(Step(s, ops, peer_check=False))))
    t0 = time.process_time()
    for step in steps:
        apply_step(cache, None, 0, step)  # type: ignore[arg-type]
    return time.process_time() - t0


def mirror_finish(mirror, rid: int, output: np.ndarray) -> tuple[int, Finish]:
    """What ``Coordinator.finish`` runs on its mirror (its own helper if it has one)."""
    logged = getattr(oplog, "logged_finish", None)
    if logged is not None:
        n, op, _ = logged(mirror, rid, output)
        return n, op
    out = as_tokens(output, allow_empty=True)
    row = mirror.request_row(rid)
    out = out[: max(0, row.num_tokens - row.tokens.size)]
    n = mirror.finish(rid, out)
    return n, Finish(rid, pack_tokens(out))


def run_mirror(pairs: int, seed: int) -> float:
    shared, prompts, outs = workload(pairs, seed)
    mirror = fresh_cache(shared)
    logged_admit = oplog.logged_admit
    t0 = time.process_time()
    for i in range(pairs):
        logged_admit(mirror, i, prompts[i], 0, 0, None)
        mirror_finish(mirror, i, outs[i])
    return time.process_time() - t0


def run_digest(pairs: int, seed: int) -> float:
    """CPU seconds of the digests alone: a step loop with them minus one without."""
    shared, prompts, outs = workload(pairs, seed)
    spent = 0.0
    for with_digest in (True, False):
        cache = fresh_cache(shared)
        t0 = time.process_time()
        for s in range(0, pairs, BATCH):
            for i in range(s, min(s + BATCH, pairs)):
                cache.admit(i, prompts[i])
                cache.finish(i, outs[i])
            if with_digest:
                cache.digest()
        spent += (time.process_time() - t0) * (1 if with_digest else -1)
    return spent


def one_round(pairs: int, seed: int) -> dict[str, float]:
    """Microseconds per pair (per step's digest for ``digest``) of each mode, once."""
    out = {}
    for mode in MODES:
        spent = globals()[f"run_{mode}"](pairs, seed)
        per = pairs if mode != "digest" else -(-pairs // BATCH)
        out[mode] = spent / per * 1e6
    return out


def child_round(path: str, pairs: int, seed: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=path)
    cmd = [sys.executable, __file__, "--pairs", str(pairs), "--rounds", "1", "--seed", str(seed)]
    done = subprocess.run([*cmd, "--json"], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)["rounds"][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vs", help="another checkout: A/B against it, interleaved")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.vs is None:
        rounds = [one_round(args.pairs, args.seed + r) for r in range(args.rounds)]
        med = {m: statistics.median(r[m] for r in rounds) for m in MODES}
        if args.json:
            print(json.dumps({"machine": machine(), "median_us": med, "rounds": rounds}))
            return
        print(machine())
        print(f"{args.pairs} pairs x {args.rounds} rounds; CPU us per pair (digest: per step)")
        for m in MODES:
            print(f"  {m:7s} {med[m]:8.2f}")
        return
    here = str(Path(__file__).resolve().parent.parent)
    old, new = [], []
    for r in range(args.rounds):
        order = ((args.vs, old), (here, new)) if r % 2 == 0 else ((here, new), (args.vs, old))
        for path, into in order:
            into.append(child_round(path, args.pairs, args.seed + r))
    print(machine())
    print(f"{args.pairs} pairs x {args.rounds} rounds, A/B interleaved; CPU us per pair")
    print(f"  {'mode':7s} {'old':>8s} {'new':>8s} {'old/new':>8s}")
    for m in MODES:
        a = statistics.median(o[m] for o in old)
        b = statistics.median(n[m] for n in new)
        ratio = statistics.median(o[m] / n[m] for o, n in zip(old, new, strict=True))
        print(f"  {m:7s} {a:8.2f} {b:8.2f} {ratio:8.2f}x")


if __name__ == "__main__":
    main()
