"""``scripts/policy_bounds.py``: the class-lifetime bound on hand-made gaps, the features
on a hand-made trace, and its oracle simulations against ``pagesim`` on a real slice."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

from tpcache.trace import DEFAULT_TRACE, TraceRequest, load_trace

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
from page_replay import build_replay, next_uses  # noqa: E402
from pagesim import simulate  # noqa: E402
from policy_bounds import features, hull_bound, simulate_admitted  # noqa: E402


def test_hull_bound_takes_a_share_of_a_lifetime_that_does_not_fit_whole() -> None:
    # One page reused after 10 ticks, one never: keeping both 16 ticks (the shortest
    # lifetime over 10) hits once for 10 + 16 = 26 page-ticks.
    gaps = np.array([10.0, math.inf])
    one = np.zeros(2, dtype=np.int64)
    assert hull_bound(gaps, one, 26 / 100, 100) == pytest.approx(1.0)
    assert hull_bound(gaps, one, 13 / 100, 100) == pytest.approx(0.5, abs=1e-6)
    assert hull_bound(gaps, one, 0.0, 100) == pytest.approx(0.0, abs=1e-6)
    # Split the two into classes: the never-reused one gets no lifetime, so 10 fit.
    assert hull_bound(gaps, np.array([1, 0]), 10 / 100, 100) == pytest.approx(1.0)


def test_features_of_a_hand_made_trace() -> None:
    # Page 512: one block per page. Request 1 extends request 0 by two new blocks;
    # request 2 repeats request 0's prefix only.
    reqs = [
        TraceRequest(0, 0, 1024, 0, (7, 8)),
        TraceRequest(1, 0, 2048, 0, (7, 8, 9, 10)),
        TraceRequest(2, 0, 1024, 0, (7, 8)),
    ]
    f = features(build_replay(reqs, 512))
    assert f["prior"].tolist() == [0, 0, 1, 1, 0, 0, 2, 2]
    assert f["offset"].tolist() == [0, 1, -1, -1, 0, 1, -1, -1]
    assert f["runlen"].tolist() == [2, 2, 2, 2, 2, 2, 0, 0]
    # Clock: pages written before each request (0, 2, 6). Only the first
    # (input_length - 1) // 512 pages can be hit: 3 in request 1, 1 in request 2.
    assert f["prev"].tolist() == [-1, -1, 2, 2, -1, -1, 4, 4]
    assert f["gap"].tolist() == [2, 2, 4, math.inf, math.inf, math.inf, math.inf, math.inf]


def test_oracle_simulations_agree_with_pagesim_and_order_sensibly() -> None:
    rep = build_replay(load_trace(DEFAULT_TRACE, limit=400), 16)
    nxt = next_uses(rep)
    cap = 400_000
    every = np.ones(len(rep.pages), dtype=bool)
    assert simulate_admitted(rep, cap, every, None) == simulate(rep, "lru", cap).hit_rate
    belady = simulate_admitted(rep, cap, every, nxt)
    assert belady == simulate(rep, "belady", cap, next_use=nxt).hit_rate
    f = features(rep)
    second = simulate_admitted(rep, cap, f["prior"] >= 1, nxt)
    assert 0 < second < belady
