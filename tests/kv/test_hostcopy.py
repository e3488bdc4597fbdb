"""A rank's copies between its device pool and its host pool (``kv/host_copy.py``):
exact bytes both ways on every layer, done in id order (a prefix), slow and failing jobs,
and bad jobs refused before anything is queued. CPU pools (CUDA paths are GPU-only)."""

from __future__ import annotations

import random
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from tpcache.kv.host_copy import (
    TO_DEVICE,
    TO_HOST,
    CopyEngine,
    CopyEngineClosed,
    CopyJob,
    host_pool,
)
from tpcache.kv.pool import KVPool, PoolSpec

SPEC = PoolSpec(num_layers=3, kv_heads=4, head_dim=8, tp=2, dtype="float32")


def filled(slots: int, seed: int) -> KVPool:
    pool = KVPool(SPEC, slots, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    for layer in range(SPEC.num_layers):
        k, v = pool.layer_buffers(layer)
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    return pool


def ids(xs) -> np.ndarray:
    return np.asarray(xs, dtype=np.int64)


def test_copies_both_ways_are_exact_and_done_in_order() -> None:
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    dev = filled(64, seed)
    host = host_pool(dev, 40)
    eng = CopyEngine(dev, host)
    try:
        out_src = rng.choice(64, size=20, replace=False)
        out_dst = rng.choice(40, size=20, replace=False)
        eng.submit(CopyJob(0, TO_HOST, out_src, out_dst))
        back_dst = rng.choice(64, size=20, replace=False)
        eng.submit(CopyJob(1, TO_DEVICE, out_dst, back_dst))
        assert eng.wait(2, 10.0) and eng.done() == 2 and not eng.failed
        for layer in range(SPEC.num_layers):
            for d_buf, h_buf in zip(
                dev.layer_buffers(layer), host.layer_buffers(layer), strict=True
            ):
                assert torch.equal(
                    h_buf[torch.as_tensor(out_dst)], d_buf[torch.as_tensor(back_dst)]
                )
        assert eng.copied_bytes == 40 * SPEC.bytes_per_slot
    finally:
        eng.close()


def test_a_slow_engine_is_a_prefix_and_a_failure_is_counted_done() -> None:
    dev = filled(16, 1)
    host = host_pool(dev, 16)
    eng = CopyEngine(dev, host, delay_s=0.05, fail=frozenset({1}))
    try:
        for i in range(4):
            eng.submit(CopyJob(i, TO_HOST, ids([i]), ids([i])))
        seen = []
        deadline = time.monotonic() + 10
        while eng.done() < 4 and time.monotonic() < deadline:
            seen.append(eng.done())
            time.sleep(0.005)
        assert seen == sorted(seen) and seen[0] < 4  # it was slow, and only grew
        assert eng.done() == 4 and eng.failed == {1}
        k_host, _ = host.layer_buffers(0)
        k_dev, _ = dev.layer_buffers(0)
        assert torch.equal(k_host[0], k_dev[0]) and not torch.equal(k_host[1], k_dev[1])
    finally:
        eng.close()


def test_bad_jobs_are_refused_before_they_are_queued() -> None:
    dev = filled(8, 2)
    eng = CopyEngine(dev, host_pool(dev, 8))
    try:
        with pytest.raises(ValueError, match="expected 0"):
            eng.submit(CopyJob(3, TO_HOST, ids([0]), ids([0])))
        with pytest.raises(ValueError, match="copy kind"):
            CopyJob(0, "sideways", ids([0]), ids([0]))
        with pytest.raises(ValueError, match="source slots"):
            CopyJob(0, TO_HOST, ids([0, 1]), ids([0]))
        with pytest.raises(ValueError, match="spec"):
            CopyEngine(dev, KVPool(PoolSpec(1, 4, 8, 2), 8, torch.device("cpu")))
        assert eng.done() == 0
        eng.submit(CopyJob(0, TO_HOST, ids([7]), ids([0])))  # the next id still fits
        assert eng.wait(1, 10.0)
    finally:
        eng.close()


def test_close_drops_the_queued_jobs_at_once() -> None:
    """A rank closes its engine when its cache is rebuilt (a recovery's ``setup``): the
    queued copies' results are no longer wanted, so close must not wait for a slow engine
    to drain them (it did, up to 30 s). Jobs not started are dropped and never run; the
    engine's thread is gone when close returns; a new engine on the same pools works."""
    dev = filled(32, 3)
    host = host_pool(dev, 32)
    threads = set(threading.enumerate())
    eng = CopyEngine(dev, host, delay_s=0.3)
    for i in range(20):  # about 6 s of copies, one after another
        eng.submit(CopyJob(i, TO_HOST, ids([i]), ids([i])))
    assert eng.wait(1, 10.0)
    before = eng.done()
    start = time.monotonic()
    eng.close()
    took = time.monotonic() - start
    assert took < 1.0, f"close took {took:.2f}s"
    assert set(threading.enumerate()) == threads
    done = eng.done()
    assert done in (before, before + 1) and done < 20 and not eng.failed  # one may finish
    time.sleep(0.6)  # two jobs' time: a job still running would show below
    assert eng.done() == done and eng.copied_bytes == done * SPEC.bytes_per_slot
    for layer in range(SPEC.num_layers):
        for d_buf, h_buf in zip(dev.layer_buffers(layer), host.layer_buffers(layer), strict=True):
            assert torch.equal(h_buf[:done], d_buf[:done])
            assert not h_buf[done:].any()  # the dropped jobs' targets were never written
    gone = weakref.ref(eng)
    del eng
    assert gone() is None  # nothing (no thread, no cycle) keeps the engine or its pools
    fresh = CopyEngine(dev, host)
    try:
        fresh.submit(CopyJob(0, TO_HOST, ids([25, 24]), ids([30, 31])))
        assert fresh.wait(1, 10.0) and fresh.done_ok() == 1
        k_dev, v_dev = dev.layer_buffers(2)
        k_host, v_host = host.layer_buffers(2)
        assert torch.equal(k_host[30:32], k_dev[[25, 24]])
        assert torch.equal(v_host[30:32], v_dev[[25, 24]])
    finally:
        fresh.close()


def test_a_closed_engine_refuses_jobs_and_has_no_count() -> None:
    """After close its dropped jobs never finish: a job is refused, nothing is queued, a
    wait for them ends at once, and its count reads -1 (never one the group may agree)."""
    dev = filled(8, 4)
    eng = CopyEngine(dev, host_pool(dev, 8))
    eng.submit(CopyJob(0, TO_HOST, ids([3]), ids([0])))
    assert eng.wait(1, 10.0) and eng.done_ok() == 1
    assert eng.close() is True
    with pytest.raises(CopyEngineClosed, match="copy job 1 submitted to a closed engine"):
        eng.submit(CopyJob(1, TO_HOST, ids([4]), ids([1])))
    start = time.monotonic()
    assert eng.wait(1, 30.0) is True and eng.wait(2, 30.0) is False
    assert time.monotonic() - start < 1.0
    assert eng.done() == 1 and eng.done_ok() == -1 and not eng.failed
    assert eng.close() is True  # again: nothing left to stop
    with pytest.raises(CopyEngineClosed):
        eng.submit(CopyJob(1, TO_HOST, ids([4]), ids([1])))


def sequential(dev: KVPool, host: KVPool, jobs: list[CopyJob]) -> list[torch.Tensor]:
    """What ``jobs`` leave in every buffer when run one by one, in id order (clones)."""
    d = [b.clone() for layer in range(SPEC.num_layers) for b in dev.layer_buffers(layer)]
    h = [b.clone() for layer in range(SPEC.num_layers) for b in host.layer_buffers(layer)]
    for job in jobs:
        src, dst = (d, h) if job.kind == TO_HOST else (h, d)
        for s_buf, d_buf in zip(src, dst, strict=True):
            d_buf[torch.as_tensor(job.dst)] = s_buf[torch.as_tensor(job.src)]
    return d + h


def test_queued_jobs_run_together_as_if_one_by_one() -> None:
    """Jobs waiting in the queue run as one copy per run of one kind; targets written
    twice (a host page freed and written again, a device page loaded twice) must end
    as the later job left them, and sources read after an earlier job of the other kind
    wrote them must see that write."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    dev = filled(48, seed)
    host = host_pool(dev, 24)
    jobs = []
    for i in range(400):
        kind = TO_HOST if rng.random() < 0.6 else TO_DEVICE
        n = int(rng.integers(1, 5))
        src = rng.choice(48 if kind == TO_HOST else 24, size=n, replace=False)
        dst = rng.choice(24 if kind == TO_HOST else 48, size=n, replace=False)
        jobs.append(CopyJob(i, kind, src, dst))
    want = sequential(dev, host, jobs)
    eng = CopyEngine(dev, host)
    try:
        for job in jobs:  # faster than the engine takes them: most run in groups
            eng.submit(job)
        assert eng.wait(len(jobs), 30.0) and not eng.failed
        got = [b for layer in range(SPEC.num_layers) for b in dev.layer_buffers(layer)]
        got += [b for layer in range(SPEC.num_layers) for b in host.layer_buffers(layer)]
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
        assert eng.copied_bytes == sum(j.src.size for j in jobs) * SPEC.bytes_per_slot
    finally:
        eng.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copies_both_ways_are_exact() -> None:
    """On CUDA a device-to-host copy lands in a pinned buffer the copy stream fills
    later: the host pool must get the bytes only once they are there (the first CUDA
    path wrote them from the CPU at once, before the stream had run). Large jobs, so
    that the copy takes long enough to be seen unfinished."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    spec = PoolSpec(num_layers=2, kv_heads=8, head_dim=128, tp=1, dtype="float16")
    dev = KVPool(spec, 1 << 15, torch.device("cuda:0"))
    host = host_pool(dev, 1 << 14)
    back = KVPool(spec, 1 << 14, torch.device("cuda:0"))
    eng = CopyEngine(dev, host)
    eng_back = CopyEngine(back, host)
    try:
        for it in range(4):
            for layer in range(spec.num_layers):
                for buf in dev.layer_buffers(layer):
                    buf.normal_()
            torch.cuda.synchronize()
            src = rng.permutation(1 << 15)[: 1 << 13].astype(np.int64)
            dst = rng.permutation(1 << 14)[: 1 << 13].astype(np.int64)
            eng.submit(CopyJob(it, TO_HOST, src, dst))
            assert eng.wait(it + 1, 60) and not eng.failed
            eng_back.submit(CopyJob(it, TO_DEVICE, dst, dst))
            assert eng_back.wait(it + 1, 60) and not eng_back.failed
            d_src = torch.as_tensor(src, device="cuda:0")
            h_dst = torch.as_tensor(dst)
            for layer in range(spec.num_layers):
                bufs = zip(
                    dev.layer_buffers(layer),
                    host.layer_buffers(layer),
                    back.layer_buffers(layer),
                    strict=True,
                )
                for d_buf, h_buf, b_buf in bufs:
                    want = d_buf[d_src].cpu()
                    assert torch.equal(h_buf[h_dst], want)
                    assert torch.equal(b_buf[h_dst.to("cuda:0")].cpu(), want)
    finally:
        eng.close()
        eng_back.close()
