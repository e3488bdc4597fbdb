"""How far can an online policy go on a trace? Offline bounds that split the LRU->Belady
gap into what knowing *which* pages come back is worth and what knowing *when* is.

    python scripts/policy_bounds.py [TRACE] --capacity 1M,3M,10M [--page-size 16]
        [--limit N] [--out results/policy_bounds]

TRACE defaults to the conversation trace in the repository, tpcache/data/mooncake_conversation.jsonl.gz.

Two kinds of figures, both on the page-level replay of ``pagesim`` (plain page mode):

- Simulations with an oracle: Belady over all pages; Belady over only the pages an
  admit-on-second-sighting filter lets in (an ideal ghost: every earlier sighting is
  remembered), i.e. perfect timing but no foresight about first sightings; LRU over
  only the pages that will be used again (perfect selection, no timing); and LRU over
  second sightings (the filter alone).
- Class-lifetime bounds: pages fall into classes by features an online policy can see
  (sightings so far, the gap since the last sighting, the size of the run of new
  pages in the request that uses it, and a new page's offset in that run); each class keeps its pages a fixed time
  ``T_c`` after each use. Given the true reuse gaps of every class (measured on the
  whole trace: in-sample, so an upper bound for any policy that must learn them), the
  best hits within ``capacity x time`` page-ticks is a knapsack over classes; its
  concave hull (reachable by keeping a share of one class's pages longer) is solved by
  a Lagrange multiplier. The clock is pages written. A policy of this family (such as
  ``resight``) cannot beat its features' bound by more than the model's error.

Not part of the package. Prints ratios, not verdicts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

# scripts/ is not a package: import the simulator by path, as belady.py does.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from belady import parse_capacities  # noqa: E402
from page_replay import PagedReplay, build_replay, next_uses  # noqa: E402
from pagesim import _PageCache  # noqa: E402

from tpcache.trace import DEFAULT_TRACE as TRACE  # noqa: E402
from tpcache.trace import load_trace  # noqa: E402

GRID = 240  # lifetimes tried per class, log-spaced


def features(rep: PagedReplay) -> dict[str, np.ndarray]:
    """Per page occurrence (aligned with ``rep.pages``): sightings before it, the gap
    since the last one and to the next use (pages written; -1 / inf for none), and the
    length of its request's run of never-seen pages and its offset there (-1 outside)."""
    n = rep.num_requests
    lengths = np.diff(rep.offsets)
    clock = np.concatenate([[0], np.cumsum(lengths)])
    req = np.repeat(np.arange(n), lengths)
    prior = np.zeros(len(rep.pages), dtype=np.int64)
    prev = np.full(len(rep.pages), -1, dtype=np.int64)
    count = np.zeros(rep.num_ids, dtype=np.int64)
    last = np.full(rep.num_ids, -1, dtype=np.int64)
    for r in range(n):
        lo, hi = rep.offsets[r], rep.offsets[r + 1]
        p = rep.pages[lo:hi]
        prior[lo:hi] = count[p]
        prev[lo:hi] = np.where(last[p] >= 0, clock[r] - last[p], -1)
        count[p] += 1
        last[p] = clock[r]
    nxt = next_uses(rep)
    gap = np.where(nxt < n, clock[np.minimum(nxt, n - 1)] - clock[req], np.inf)
    fresh = prior == 0
    idx = np.flatnonzero(fresh)
    first = np.full(n, len(rep.pages), dtype=np.int64)  # each request's first fresh page
    np.minimum.at(first, req[idx], idx)
    runlen = np.bincount(req[fresh], minlength=n)
    offset = np.where(fresh, np.arange(len(rep.pages)) - first[req], -1)
    return {
        "prior": prior,
        "prev": prev,
        "gap": gap,
        "offset": offset,
        "runlen": runlen[req],
        "ticks": np.array(clock[-1]),
    }


def hull_bound(gap: np.ndarray, cls: np.ndarray, capacity_pages: float, ticks: int) -> float:
    """Most page hits of fixed per-class lifetimes within ``capacity_pages * ticks``
    page-ticks, on the concave hull (see the module docstring). Pure."""
    k = int(cls.max()) + 1
    grid = np.concatenate([[0.0], np.geomspace(16, ticks, GRID)])
    hits = np.zeros((k, grid.size))
    room = np.zeros((k, grid.size))
    for c in range(k):
        g = gap[cls == c]
        seen = np.sort(g[np.isfinite(g)])
        sums = np.concatenate([[0.0], np.cumsum(seen)])
        j = np.searchsorted(seen, grid, side="left")  # reused below T: hit
        hits[c] = j
        room[c] = sums[j] + (g.size - j) * grid
    budget = capacity_pages * ticks

    def best(lam: float) -> tuple[float, float]:
        j = np.argmax(hits - lam * room, axis=1)
        rows = np.arange(k)
        return float(room[rows, j].sum()), float(hits[rows, j].sum())

    lo, hi = 0.0, 1.0  # hits per page-tick: a page is hit at most once per tick
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if best(mid)[0] > budget else (lo, mid)
    r_lo, h_lo = best(lo)  # over budget
    r_hi, h_hi = best(hi)  # within it
    share = (budget - r_hi) / (r_lo - r_hi) if r_lo > r_hi else 0.0
    return h_hi + min(max(share, 0.0), 1.0) * (h_lo - h_hi)


def simulate_admitted(
    rep: PagedReplay, capacity: float, admit: np.ndarray, next_use: np.ndarray | None
) -> float:
    """Hit rate of a page cache that caches a page only where ``admit`` (per occurrence)
    or when it is cached already; LRU order, or Belady's when ``next_use`` is given."""
    cache = _PageCache(rep, capacity // rep.page_size, tree=False)
    hits = 0
    for r in range(rep.num_requests):
        lo, hi = int(rep.offsets[r]), int(rep.offsets[r + 1])
        pages = rep.pages[lo:hi]
        hits += cache.match(pages, int(rep.reuse_limit[r]))
        keep = admit[lo:hi] | cache.cached[pages]
        prio = None if next_use is None else -next_use[lo:hi][keep]
        cache.access(r, pages[keep], prio)
        cache.evict(r)
    return hits * rep.page_size / rep.prompt_tokens


def _classes(f: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Feature sets to bound, each as one class id per occurrence."""
    sight = np.minimum(f["prior"], 3)
    prev = np.digitize(f["prev"], [1, 10**4, 10**5, 3 * 10**5, 10**6])
    size = np.digitize(f["runlen"], [1, 32, 128, 512])
    offset = np.digitize(f["offset"], [0, 32, 256])

    def joint(*parts: np.ndarray) -> np.ndarray:
        code = np.zeros_like(parts[0])
        for part in parts:
            code = code * (int(part.max()) + 1) + part
        return np.unique(code, return_inverse=True)[1]

    return {
        "one class (LRU-like)": np.zeros_like(sight),
        "sightings 0 / 1+": np.minimum(f["prior"], 1),
        "sightings 0 / 1 / 2+": np.minimum(f["prior"], 2),
        "sightings 0 / 1 / 2 / 3+": sight,
        "sightings x previous gap": joint(sight, prev),
        "sightings x new-run size": joint(sight, size),
        "sightings x offset in new run": joint(sight, offset),
        "all of the above": joint(sight, prev, size, offset),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", default=str(TRACE))
    ap.add_argument("--capacity", type=parse_capacities, default=[1e6, 3e6, 10e6])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="also write OUT.md")
    args = ap.parse_args(argv)
    caps = [int(c) for c in args.capacity]
    rep = build_replay(load_trace(args.trace, args.limit), args.page_size)
    f = features(rep)
    nxt = next_uses(rep)
    second = f["prior"] >= 1
    reused = np.isfinite(f["gap"])
    everything = np.ones_like(second)
    sims = [  # (name, pages admitted at a sighting, Belady's order or None for LRU)
        ("LRU", everything, None),
        ("LRU, admit on 2nd sighting", second, None),
        ("LRU, admit only pages used again", reused, None),
        ("Belady, admit on 2nd sighting", second, nxt),
        ("Belady", everything, nxt),
    ]
    rows = [(f"sim: {n}", [simulate_admitted(rep, c, a, o) for c in caps]) for n, a, o in sims]
    ticks = int(f["ticks"])
    for name, cls in _classes(f).items():
        per_cap = [hull_bound(f["gap"], cls, c / rep.page_size, ticks) for c in caps]
        rate = [h * rep.page_size / rep.prompt_tokens for h in per_cap]
        rows.append((f"bound: lifetimes by {name} ({int(cls.max()) + 1} classes)", rate))
    head = "| figure | " + " | ".join(f"{c / 1e6:g}M" for c in caps) + " |"
    lines = [
        f"Offline bounds, page {args.page_size}, {args.trace}"
        + (f" (first {args.limit})" if args.limit else ""),
        "",
        head,
        "|" + "---|" * (len(caps) + 1),
        *(f"| {n} | " + " | ".join(f"{v:.4f}" for v in vals) + " |" for n, vals in rows),
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
