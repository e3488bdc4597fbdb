"""KVPool on the CPU, and TPGroup over real gloo ranks (spawned processes on 127.0.0.1)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
from typing import Any

import numpy as np
import pytest
import torch

from tpcache.group.spec import (
    GroupError,
    GroupInputError,
    GroupSpec,
    free_port,
    i64_to_u64,
    u64_to_i64,
)
from tpcache.group.tp_group import TPGroup
from tpcache.kv.pool import (
    KVPool,
    PoolConfigError,
    PoolError,
    PoolSpec,
    device_budget_bytes,
    slots_that_fit,
)

CPU = torch.device("cpu")
SPEC = PoolSpec(num_layers=3, kv_heads=8, head_dim=4, tp=2)


def _kv(n: int, seed: int, spec: PoolSpec = SPEC) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (n, spec.heads_per_rank, spec.head_dim)
    k = torch.randn(shape, generator=g).to(spec.torch_dtype)
    return k, torch.randn(shape, generator=g).to(spec.torch_dtype)


def _snapshot(pool: KVPool) -> list[torch.Tensor]:
    return [t.clone() for layer in range(pool.spec.num_layers) for t in pool.layer_buffers(layer)]


# --- KVPool -------------------------------------------------------------------------------


def test_pool_spec_derived_values() -> None:
    spec = PoolSpec(num_layers=2, kv_heads=8, head_dim=16, tp=4, dtype="bfloat16")
    assert spec.heads_per_rank == 2
    assert spec.torch_dtype is torch.bfloat16
    assert spec.bytes_per_slot == 2 * 2 * 2 * 16 * 2  # K+V, layers, heads, dim, 2 bytes


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_heads": 6, "tp": 4}, "kv_heads=6 is not divisible by tp=4"),
        ({"num_layers": 0}, "num_layers must be a positive int"),
        ({"head_dim": True}, "head_dim must be a positive int"),
        ({"dtype": "int8"}, "dtype='int8' is not one of"),
    ],
)
def test_pool_spec_rejects(kwargs: dict[str, Any], message: str) -> None:
    base: dict[str, Any] = {"num_layers": 2, "kv_heads": 8, "head_dim": 4, "tp": 2}
    with pytest.raises(PoolConfigError, match=message):
        PoolSpec(**{**base, **kwargs})


def test_slots_that_fit_arithmetic() -> None:
    spec = PoolSpec(num_layers=4, kv_heads=8, head_dim=128, tp=2, dtype="float16")
    per_slot = 2 * 4 * 4 * 128 * 2
    assert spec.bytes_per_slot == per_slot == 8192
    assert slots_that_fit(spec, 0) == 0
    assert slots_that_fit(spec, per_slot - 1) == 0
    assert slots_that_fit(spec, per_slot) == 1
    assert slots_that_fit(spec, 1000 * per_slot + per_slot - 1) == 1000
    with pytest.raises(PoolConfigError, match="-1"):
        slots_that_fit(spec, -1)
    # On the CPU the budget is the configured one, not a fraction of free memory.
    assert device_budget_bytes(CPU, 0.5, cpu_bytes=3 * per_slot) == 3 * per_slot
    with pytest.raises(PoolConfigError, match="fraction must be in"):
        device_budget_bytes(CPU, 0.0, cpu_bytes=1)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_pool_round_trip_per_layer(dtype: str) -> None:
    spec = PoolSpec(num_layers=3, kv_heads=8, head_dim=4, tp=2, dtype=dtype)
    pool = KVPool(spec, num_slots=16, device=CPU)
    slots = [7, 2, 11, 0]
    written = {}
    for layer in range(3):
        k, v = _kv(len(slots), seed=layer, spec=spec)
        pool.write(layer, np.array(slots, dtype=np.int64), k, v)
        written[layer] = (k, v)
    for layer in range(3):
        k, v = pool.read(layer, torch.tensor(slots))
        assert torch.equal(k, written[layer][0]) and torch.equal(v, written[layer][1])
        # A permuted read returns the same rows permuted.
        k2, _ = pool.read(layer, [0, 11])
        assert torch.equal(k2, written[layer][0][[3, 2]])
    # Slots never written stay zero, in every layer.
    others = [s for s in range(16) if s not in slots]
    for layer in range(3):
        k, v = pool.read(layer, others)
        assert not k.any() and not v.any()


def test_pool_write_leaves_other_slots_and_layers_unchanged() -> None:
    pool = KVPool(SPEC, num_slots=8, device=CPU)
    pool.write(0, [1, 2], *_kv(2, seed=1))
    pool.write(1, [1, 2], *_kv(2, seed=2))
    before = _snapshot(pool)
    k, v = _kv(1, seed=3)
    pool.write(0, [5], k, v)
    after = _snapshot(pool)
    expected_k0 = before[0].clone()
    expected_k0[5] = k[0]
    assert torch.equal(after[0], expected_k0)
    assert all(torch.equal(a, b) for a, b in zip(before[2:], after[2:], strict=True))
    pool.clear()
    assert not any(t.any() for t in _snapshot(pool))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p, k, v: p.write(0, [0, 8], k, v), r"slot ids span \[0, 8\], outside \[0, 8\)"),
        (lambda p, k, v: p.write(0, [-1, 3], k, v), r"span \[-1, 3\]"),
        (lambda p, k, v: p.write(0, [3, 3], k, v), "repeat"),
        (lambda p, k, v: p.write(0, [0.0, 1.0], k, v), "must be integers"),
        (lambda p, k, v: p.write(0, [[0, 1]], k, v), "must be 1-D"),
        (lambda p, k, v: p.write(3, [0, 1], k, v), r"layer=3 is out of range \[0, 3\)"),
        (lambda p, k, v: p.write(0, [0, 1, 2], k, v), r"k has shape \(2, 4, 4\), expected \(3"),
        (lambda p, k, v: p.write(0, [0, 1], k, v[:, :2]), r"v has shape \(2, 2, 4\)"),
        (lambda p, k, v: p.write(0, [0, 1], k, v.half()), "v has dtype torch.float16"),
        (lambda p, k, v: p.read(-1, [0]), r"layer=-1 is out of range"),
        (lambda p, k, v: p.read(0, torch.tensor([9])), r"span \[9, 9\]"),
    ],
)
def test_pool_rejects_bad_input_and_changes_nothing(call: Any, message: str) -> None:
    pool = KVPool(SPEC, num_slots=8, device=CPU)
    pool.write(0, [4, 5], *_kv(2, seed=9))
    before = _snapshot(pool)
    k, v = _kv(2, seed=10)
    with pytest.raises(PoolError, match=message):
        call(pool, k, v)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(pool), strict=True))


def test_pool_empty_write_and_read() -> None:
    pool = KVPool(SPEC, num_slots=4, device=CPU)
    k, v = _kv(0, seed=0)
    pool.write(0, [], k, v)
    rk, rv = pool.read(0, np.array([], dtype=np.int64))
    assert rk.shape == (0, 4, 4) and rv.shape == (0, 4, 4)


# --- TPGroup over real gloo ranks ---------------------------------------------------------

DIGEST = 0xDEADBEEF_CAFEF00D  # high bit set: negative as int64
PAYLOAD = bytes(range(256)) * 16  # 4 KiB
FLIP_BITS = (0, 30, 31, 32, 61, 62, 63)  # each field of the 31-bit fold, and its edges


def _rank_main(rank: int, groups: list[tuple[int, int]], out: Any) -> None:
    """One process: for each (world, port) that includes it, join, run every collective in
    the same order as its peers, report, and leave (reusing processes saves start-ups)."""
    for world, port in groups:
        if rank < world:
            out.put(_one_group(rank, world, port))


def _one_group(rank: int, world: int, port: int) -> dict[str, Any]:
    try:
        spec = GroupSpec(rank, world, "127.0.0.1", port, backend="gloo", timeout_s=20.0)
        group = TPGroup.init(spec, CPU)
        res: dict[str, Any] = {"rank": rank, "world": world}
        res["min"] = group.all_min([rank, 10 - rank, -rank])
        res["max"] = group.all_max([rank, 10 - rank, -rank])
        res["min_max"] = group.min_max([rank * 3, -(2**63), 2**63 - 1 - rank])
        res["gather"] = group.all_gather_ints([rank, rank * rank])
        res["agree"] = group.agree_min([10 - rank, -rank])
        res["range_same"] = group.digest_range(u64_to_i64(DIGEST))
        res["range_differ"] = group.digest_range(u64_to_i64(DIGEST if rank != 1 else DIGEST ^ 1))
        # The extremes of int64 are digests too: only a failure is None.
        res["range_edge"] = group.digest_range(-(2**63) if rank == 0 else -(2**63) + 1)
        res["range_failed"] = group.digest_range(None if rank == world - 1 else u64_to_i64(DIGEST))
        # The documented ambiguity: healthy digests spanning all of int64 read as a failure.
        res["range_span"] = group.digest_range(-(2**63) if rank == 0 else 2**63 - 1)
        # digest_check under gloo: one element; rank 1 flips one bit of the digest.
        res["check_same"] = group.digest_check(u64_to_i64(DIGEST))
        res["check_flips"] = [
            group.digest_check(u64_to_i64(DIGEST ^ (1 << bit) if rank == 1 else DIGEST))
            for bit in FLIP_BITS
        ]
        res["check_failed"] = group.digest_check(None if rank == world - 1 else u64_to_i64(DIGEST))
        # A failure and a divergence in one step: the failure is what every rank sees.
        res["check_failed_differ"] = group.digest_check(
            None if rank == world - 1 else u64_to_i64(DIGEST ^ rank)
        )
        res["check_extremes"] = group.digest_check(-(2**63) if rank == 0 else 2**63 - 1)
        res["check_min"] = group.digest_check(-(2**63))
        res["bytes"] = group.broadcast_bytes(PAYLOAD if rank == 0 else None, src=0)
        res["bytes_last"] = group.broadcast_bytes(
            b"from-last" if rank == world - 1 else None, world - 1
        )
        res["empty"] = group.broadcast_bytes(b"" if rank == 0 else None)
        digest = DIGEST if rank != 1 else DIGEST ^ 1  # rank 1 diverges in the low bit
        same = group.min_max([u64_to_i64(DIGEST)])
        differ = group.min_max([u64_to_i64(digest)])
        res["same"] = ([i64_to_u64(x) for x in same[0]], [i64_to_u64(x) for x in same[1]])
        res["differ"] = ([i64_to_u64(x) for x in differ[0]], [i64_to_u64(x) for x in differ[1]])
        try:
            group.broadcast_bytes(None, src=0)  # src has nothing: every rank must raise
        except GroupError as exc:
            res["sentinel"] = str(exc)
        group.barrier()
        group.destroy()
        group.destroy()
        return res
    except BaseException as exc:
        return {"rank": rank, "world": world, "error": repr(exc)}


Ranks = tuple[list[Any], Any]


def _start(target: Any, args: list[tuple[Any, ...]]) -> Ranks:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, out), daemon=True) for a in args]
    for p in procs:
        p.start()
    return procs, out


def _collect(ranks: Ranks, wait_s: float, reports: int = 0) -> list[dict[str, Any]]:
    """``reports`` (default: one per process) within ``wait_s``; reaps the processes."""
    procs, out = ranks
    results: list[dict[str, Any]] = []
    deadline = time.monotonic() + wait_s
    try:
        for _ in range(reports or len(procs)):
            results.append(out.get(timeout=max(0.1, deadline - time.monotonic())))
    except queue.Empty:
        pytest.fail(f"only {len(results)} reports from {len(procs)} processes in {wait_s}s")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return sorted(results, key=lambda r: (r.get("world", 0), r["rank"]))


def test_gloo_collectives_exact_2_and_4_ranks() -> None:
    groups = [(4, free_port()), (2, free_port())]
    results = _collect(_start(_rank_main, [(r, groups) for r in range(4)]), 60, reports=6)
    for res in results:
        assert "error" not in res, res
    assert [(r["world"], r["rank"]) for r in results] == [(2, 0), (2, 1)] + [
        (4, r) for r in range(4)
    ]
    for res in results:
        world = res["world"]
        assert res["min"] == [0, 10 - (world - 1), -(world - 1)]
        assert res["max"] == [world - 1, 10, 0]
        assert res["min_max"] == (
            [0, -(2**63), 2**63 - 1 - (world - 1)],
            [3 * (world - 1), -(2**63), 2**63 - 1],
        )
        assert res["gather"] == [[r, r * r] for r in range(world)]
        assert res["agree"] == [10 - (world - 1), -(world - 1)]
        d = u64_to_i64(DIGEST)
        assert res["range_same"] == (d, d)
        assert res["range_differ"] == tuple(sorted((d, u64_to_i64(DIGEST ^ 1))))
        assert res["range_edge"] == (-(2**63), -(2**63) + 1)
        assert res["range_failed"] is None  # the last rank failed: every rank learns it
        assert res["range_span"] is None
        same = res["check_same"]
        assert same is not None and same[0] == same[1], same
        for bit, got in zip(FLIP_BITS, res["check_flips"], strict=True):
            assert got is not None and got[0] != got[1], (bit, got)  # every rank sees it
        assert res["check_failed"] is None
        assert res["check_failed_differ"] is None
        extremes = res["check_extremes"]
        assert extremes is not None and extremes[0] != extremes[1]  # healthy, not a failure
        check_min = res["check_min"]
        assert check_min is not None and check_min[0] == check_min[1]
        assert res["bytes"] == PAYLOAD
        assert res["bytes_last"] == b"from-last"
        assert res["empty"] == b""
        assert res["same"] == ([DIGEST], [DIGEST])
        assert res["differ"] == ([DIGEST ^ 1], [DIGEST])  # MIN != MAX: some rank differs
        assert "rank 0 had no bytes payload" in res["sentinel"]


def _hang_main(rank: int, port: int, out: Any) -> None:
    """Both ranks join; rank 1 never enters the collective that rank 0 waits in."""
    spec = GroupSpec(rank, 2, "127.0.0.1", port, backend="gloo", timeout_s=3.0)
    group = TPGroup.init(spec, CPU)
    if rank == 1:
        time.sleep(6)  # longer than rank 0's timeout
        out.put({"rank": rank})
        return
    res: dict[str, Any] = {"rank": rank}
    for attempt in ("first", "again"):
        start = time.monotonic()
        try:
            group.all_min([1])
            res[attempt] = "no error"
        except GroupError as exc:
            res[attempt] = str(exc)
        res[f"{attempt}_s"] = time.monotonic() - start
    group.destroy()
    out.put(res)


def _init_alone(rank: int) -> tuple[str, float]:
    spec = GroupSpec(
        rank, 2, "127.0.0.1", free_port(), backend="gloo", timeout_s=1.0, join_timeout_s=3.0
    )
    start = time.monotonic()
    with pytest.raises(GroupError) as info:
        TPGroup.init(spec, CPU)
    return str(info.value), time.monotonic() - start


def test_missing_rank_fails_within_bound() -> None:
    # The hang pair runs in the background while the lonely inits run here, in turn
    # (a failed init leaves no process group behind, so this process stays clean).
    hang = _start(_hang_main, [(0, port := free_port()), (1, port)])
    for rank in (0, 1):  # rank 0 alone: no client comes; rank 1 alone: no master
        message, seconds = _init_alone(rank)
        assert f"init of gloo group failed for rank {rank}/2 at 127.0.0.1:" in message
        assert "join timeout 3s" in message  # the join timeout bounds init, not timeout_s
        assert seconds > 2.5, (rank, seconds, message)
        assert seconds < 15.0, (rank, seconds, message)
    res = _collect(hang, wait_s=40)[0]
    assert "all_min failed for rank 0/2 at 127.0.0.1:" in res["first"], res
    assert 2.5 < res["first_s"] < 15.0, res
    # Once broken, the group says so at once instead of waiting out another timeout.
    assert "group is unusable" in res["again"] and res["again_s"] < 1.0, res


LATE_S = 6.0  # 3x timeout_s, and past the ~2.5x a non-master rank retries connecting


def _late_main(rank: int, port: int, late_rank: int, out: Any) -> None:
    """``late_rank`` arrives LATE_S after its peer; both then meet in a collective, and
    then rank 1 stays out of the next one (a hang) while rank 0 waits in it."""
    spec = GroupSpec(rank, 2, "127.0.0.1", port, backend="gloo", timeout_s=2.0, join_timeout_s=60.0)
    res: dict[str, Any] = {"rank": rank, "late_rank": late_rank}
    if rank == late_rank:
        time.sleep(LATE_S)
    start = time.monotonic()
    try:
        group = TPGroup.init(spec, CPU)
    except GroupError as exc:
        res["error"] = str(exc)
        out.put(res)
        return
    res["join_s"] = time.monotonic() - start
    res["min"] = group.all_min([rank + 1])
    if rank == 1:
        time.sleep(8.0)  # past rank 0's timeout_s, and its check of hang_s below
    else:
        start = time.monotonic()
        try:
            group.all_min([1])
            res["hang"] = "no error"
        except GroupError as exc:
            res["hang"] = str(exc)
        res["hang_s"] = time.monotonic() - start
    group.destroy()
    out.put(res)


def test_late_rank_joins_and_a_hang_is_still_found_after_timeout_s() -> None:
    # Before join_timeout_s, timeout_s bounded init too: a rank this late failed the group.
    # Two pairs at once: a late client (the master waits in its store) and a late master
    # (the client retries connecting).
    args = [(r, port, late) for late in (1, 0) for port in [free_port()] for r in (0, 1)]
    results = _collect(_start(_late_main, args), wait_s=90)
    for late in (1, 0):
        pair = {r["rank"]: r for r in results if r["late_rank"] == late}
        for res in pair.values():
            assert "error" not in res, res
            assert res["min"] == [1], res
        on_time = pair[1 - late]
        # It waited well past timeout_s for its peer and still formed the group.
        assert on_time["join_s"] > 3.0, pair
        hang = pair[0]
        assert "all_min failed for rank 0/2 at 127.0.0.1:" in hang["hang"], hang
        assert "timeout 2s" in hang["hang"], hang
        # timeout_s (2 s), not join_timeout_s (60 s), nor the sleeper's exit at 8 s.
        assert 1.5 < hang["hang_s"] < 6.0, hang
        print(
            f"late rank {late}: on-time rank joined in {on_time['join_s']:.2f}s, "
            f"hang found in {hang['hang_s']:.2f}s"
        )


def test_group_spec_validation() -> None:
    with pytest.raises(GroupInputError, match=r"rank=2 is outside \[0, 2\)"):
        GroupSpec(2, 2, "127.0.0.1", 1234)
    with pytest.raises(GroupInputError, match="master_port=0"):
        GroupSpec(0, 1, "127.0.0.1", 0)
    with pytest.raises(GroupInputError, match="backend='mpi'"):
        GroupSpec(0, 1, "127.0.0.1", 1234, backend="mpi")
    with pytest.raises(GroupInputError, match="timeout_s=0"):
        GroupSpec(0, 1, "127.0.0.1", 1234, timeout_s=0)
    for bad in (True, "60", None, float("nan"), float("inf"), 0, -1.0):
        for name in ("timeout_s", "join_timeout_s"):
            with pytest.raises(GroupInputError, match=f"^{name}="):
                GroupSpec(0, 1, "127.0.0.1", 1234, **{name: bad})
    spec = GroupSpec(0, 1, "127.0.0.1", 1234, timeout_s=2, join_timeout_s=0.5)
    assert (spec.timeout_s, spec.join_timeout_s) == (2, 0.5)
    assert GroupSpec(0, 1, "127.0.0.1", 1234).join_timeout_s == 120.0
    assert GroupSpec(0, 1, "::1", 1234).init_method == "tcp://[::1]:1234"


def test_u64_carry_round_trips() -> None:
    for value in (0, 1, 2**63 - 1, 2**63, DIGEST, 2**64 - 1):
        assert i64_to_u64(u64_to_i64(value)) == value
    assert u64_to_i64(2**64 - 1) == -1
    with pytest.raises(ValueError):
        u64_to_i64(2**64)


# --- GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nccl_tp1_group_and_cuda_pool() -> None:
    device = torch.device("cuda", 0)
    spec = GroupSpec(0, 1, "127.0.0.1", free_port(), backend="auto", timeout_s=30.0)
    group = TPGroup.init(spec, device)
    try:
        assert group.backend == "nccl" and group.device == device
        assert group.min_max([u64_to_i64(DIGEST), 5]) == ([u64_to_i64(DIGEST), 5],) * 2
        assert group.digest_range(u64_to_i64(DIGEST)) == (u64_to_i64(DIGEST),) * 2
        # NCCL has no bitwise reduction: the check is the 64-bit MIN and MAX.
        assert group.digest_check(u64_to_i64(DIGEST)) == (u64_to_i64(DIGEST),) * 2
        assert group.digest_check(None) is None
        assert group.agree_min([3, -1]) == [3, -1]
        assert group.broadcast_bytes(PAYLOAD) == PAYLOAD
        assert group.all_gather_ints([7]) == [[7]]
        group.barrier()
        pool = KVPool(PoolSpec(2, 8, 64, tp=1, dtype="bfloat16"), 1024, device)
        k, v = (t.to(device) for t in _kv(3, seed=5, spec=pool.spec))
        pool.write(1, torch.tensor([9, 1000, 3], device=device), k, v)
        rk, rv = pool.read(1, [9, 1000, 3])
        assert torch.equal(rk, k) and torch.equal(rv, v)
        with pytest.raises(PoolError, match="is on cpu"):
            pool.write(0, [0, 1, 2], k.cpu(), v)
    finally:
        group.destroy()


def test_gloo_single_rank_in_process() -> None:
    spec = GroupSpec(0, 1, "127.0.0.1", free_port(), backend="auto", timeout_s=5.0)
    group = TPGroup.init(spec, CPU)
    try:
        assert (group.backend, group.device) == ("gloo", CPU)
        with pytest.raises(GroupError, match="already has a process group"):
            TPGroup.init(GroupSpec(0, 1, "127.0.0.1", free_port(), backend="gloo"), CPU)
        assert group.min_max([-(2**63), 2**63 - 1]) == ([-(2**63), 2**63 - 1],) * 2
        assert group.all_gather_ints([4, 5]) == [[4, 5]]
        with pytest.raises(GroupInputError, match="empty list"):
            group.all_min([])
        with pytest.raises(GroupInputError, match=r"2\*\*64|does not fit in int64"):
            group.all_max([2**64 - 1])
        with pytest.raises(GroupInputError, match="does not fit in int64"):
            group.digest_range(2**63)  # a u64 digest not carried by u64_to_i64
        with pytest.raises(GroupInputError, match="is not an int"):
            group.digest_range(True)  # type: ignore[arg-type]
        with pytest.raises(GroupInputError, match="empty list"):
            group.agree_min([])
        with pytest.raises(GroupInputError, match="is not an int"):
            group.agree_min([1.5])  # type: ignore[list-item]
        assert group.digest_range(-(2**63)) == (-(2**63), -(2**63))
        assert group.digest_range(None) is None
        with pytest.raises(GroupInputError, match="does not fit in int64"):
            group.digest_check(2**63)
        with pytest.raises(GroupInputError, match="is not an int"):
            group.digest_check(1.0)  # type: ignore[arg-type]
        assert group.digest_check(None) is None
        pair = group.digest_check(u64_to_i64(DIGEST))
        assert pair is not None and pair[0] == pair[1]
        assert group.agree_min([7, -3]) == [7, -3]
        with pytest.raises(GroupInputError, match=r"src=1 is outside \[0, 1\)"):
            group.broadcast_bytes(b"x", src=1)
        assert group.broken is None  # bad arguments never reach the group
    finally:
        group.destroy()
    group.destroy()
    with pytest.raises(GroupError, match="unusable"):
        group.all_min([1])


def test_taken_port_fails_init() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        spec = GroupSpec(0, 1, "127.0.0.1", port, backend="gloo", timeout_s=3.0)
        start = time.monotonic()
        with pytest.raises(GroupError, match=f"rank 0/1 at 127.0.0.1:{port}"):
            TPGroup.init(spec, CPU)
        assert time.monotonic() - start < 15.0
