"""A comparison: the same trace replay through SGLang's radix cache and through
tpcache's, side by side in one run: interleaved rounds, each replay in a fresh process, medians.

SGLang is not a dependency of tpcache. Put it in a venv of its own (its import chain
needs these; none of them is imported by tpcache)::

    python3 -m venv /tmp/sgl
    /tmp/sgl/bin/pip install torch==2.13.0 numpy msgspec
    /tmp/sgl/bin/pip install --no-deps sglang==0.5.23
    /tmp/sgl/bin/pip install orjson psutil pybase64 requests triton packaging pillow \\
        starlette pydantic pyzmq tqdm ipython aiohttp transformers torchvision dill \\
        apache-tvm-ffi sentencepiece compressed-tensors gguf
    PYTHONPATH=. /tmp/sgl/bin/python scripts/bench_sglang.py [--limit N] [--rounds K]

Both sides do what a serving engine does per request, one request at a time in file
order, with the tokens made before the clock starts: match at most ``input_length - 1``
prompt tokens in whole pages, read the matched slots, lock, evict the shortfall,
allocate the rest of prompt + output, write the request's row; at the end cache prompt
+ output in whole pages, free the duplicates and the partial tail, unlock. On the
SGLang side that is ``RadixCache`` (LRU) with its own ``PagedTokenToKVPoolAllocator`` on
the CPU, called as its scheduler calls them (``match_prefix``, ``path_device_indices``,
``inc_lock_ref``, ``evict``, ``alloc``, ``insert``, ``free_segment``/``free``,
``dec_lock_ref``). On tpcache's side it is ``admit`` (with ``reserve``: the output's
slots in the same allocation, as SGLang's side allocates them) and ``finish``
(``tpcache.replay``), the prompt given as an immutable int32 buffer (kept without a
copy), as SGLang's side is given its ``RadixKey``s. Both hit rates are printed: equal matched tokens
mean they did the same work (eviction order may differ a little: both are LRU, but
SGLang evicts whole leaf nodes and breaks ties by its own rule).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from array import array
from typing import Any

from tpcache.replay import ReplayOptions, replay
from tpcache.trace import DEFAULT_TRACE as TRACE
from tpcache.trace import TraceRequest, load_trace, output_tokens, prompt_tokens


def sglang_replay(requests: list[TraceRequest], capacity: int, page_size: int) -> dict[str, Any]:
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    # One intra-op thread: the same wall time here as torch's default of one per core
    # (2.47/2.67 s against 2.39/2.77 s for the first 3,000 requests), and the process CPU
    # time is then the cache's own work, not a second thread's overhead.
    torch.set_num_threads(1)
    alloc = PagedTokenToKVPoolAllocator(capacity, page_size, torch.int64, "cpu", None, False)
    cache = RadixCache(CacheInitParams(False, None, alloc, page_size))
    clock, cpu = time.perf_counter, time.process_time
    ops_s = cpu_s = 0.0
    matched = prompt_total = 0
    for req in requests:
        prompt = prompt_tokens(req)
        full = array("q", prompt.tolist() + output_tokens(req).tolist())
        n_in, n_all = req.input_length, len(full)
        # Both keys are made before the clock, as tpcache's token arrays are.
        match_key = RadixKey(full[: n_in - 1])
        key = RadixKey(full).page_aligned(page_size)
        c0, t0 = cpu(), clock()
        m = cache.match_prefix(MatchPrefixParams(key=match_key))
        node, hit = m.last_device_node, m.device_prefix_len
        prefix = cache.path_device_indices(node)
        cache.inc_lock_ref(node)
        need = n_all - hit
        want = -(-need // page_size) * page_size
        short = want - alloc.available_size()
        if short > 0:
            cache.evict(EvictParams(num_tokens=short))
        new = alloc.alloc(want)
        if new is None:
            raise RuntimeError(f"request {req.index}: {want} tokens do not fit")
        row = torch.cat((prefix, new[:need]))  # the last page's rest stays with the row
        aligned = len(key)
        got = cache.insert(InsertParams(key=key, value=row[:aligned].clone()))
        alloc.free_segment(row[hit : got.prefix_len], start_pos=hit)
        alloc.free(row[aligned:])
        cache.dec_lock_ref(node)
        ops_s += clock() - t0
        cpu_s += cpu() - c0
        matched += hit
        prompt_total += n_in
    return _summary(ops_s, cpu_s, matched, prompt_total)


def tpcache_replay(requests: list[TraceRequest], capacity: int, page_size: int) -> dict[str, Any]:
    out = replay(requests, ReplayOptions(capacity=capacity, page_size=page_size))
    return _summary(
        out["cache_ops_s"], out["cache_ops_cpu_s"], out["matched_tokens"], out["prompt_tokens"]
    )


def _summary(ops_s: float, cpu_s: float, matched: int, prompt: int) -> dict[str, Any]:
    return {
        "cache_ops_s": ops_s,
        "cpu_s": cpu_s,
        "matched_tokens": matched,
        "prompt_tokens": prompt,
    }


SIDES = {"sglang": sglang_replay, "tpcache": tpcache_replay}


def run_side(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One replay of one side in a fresh interpreter (this one, so the same Python and
    numpy): neither side runs on a heap the other left behind."""
    cmd = [sys.executable, __file__, "--side", name, "--trace", args.trace]
    cmd += ["--capacity", str(args.capacity), "--page-size", str(args.page_size)]
    if args.limit is not None:
        cmd += ["--limit", str(args.limit)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{name} replay failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--trace",
        default=str(TRACE),
        help="Mooncake-format trace (default: the one in tpcache/data/)",
    )
    ap.add_argument("--limit", type=int, default=None, help="first N requests only")
    ap.add_argument("--capacity", type=int, default=3_000_000, help="tokens (default 3M)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--side", choices=sorted(SIDES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rounds < 1 or args.capacity < 1 or args.page_size < 1:
        ap.error("--rounds, --capacity and --page-size must be >= 1")
    try:
        import sglang  # noqa: F401
    except ImportError:
        print("sglang is not installed here: see this script's docstring", file=sys.stderr)
        return 2
    if args.side is not None:
        requests = load_trace(args.trace, args.limit)
        out = SIDES[args.side](requests, args.capacity, args.page_size)
        print(json.dumps(out))
        return 0
    from importlib.metadata import version

    print(
        f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} CPUs, "
        f"load {', '.join(f'{x:.1f}' for x in os.getloadavg())}, "
        f"Python {platform.python_version()}, sglang {version('sglang')}, "
        f"torch {version('torch')}"
    )
    print(
        f"trace {args.trace}, limit {args.limit}, capacity {args.capacity}, page {args.page_size}"
    )
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SIDES}
    ratios: dict[str, list[float]] = {"cache_ops_s": [], "cpu_s": []}
    for k in range(args.rounds):
        order = list(SIDES) if k % 2 == 0 else list(reversed(SIDES))
        got: dict[str, dict[str, Any]] = {}
        for name in order:
            got[name] = out = run_side(name, args)
            runs[name].append(out)
            print(
                f"round {k + 1} {name:8s} cache ops {out['cache_ops_s']:7.2f} s"
                f"  cpu {out['cpu_s']:7.2f} s",
                flush=True,
            )
        for field in ratios:
            ratios[field].append(got["sglang"][field] / got["tpcache"][field])
    for name in SIDES:
        last = runs[name][-1]
        hit, prompt = last["matched_tokens"], last["prompt_tokens"]
        print(
            f"{name:8s} matched {hit} of {prompt} prompt tokens ({hit / prompt:.4f}); median"
            f" cache ops {statistics.median(r['cache_ops_s'] for r in runs[name]):.2f} s,"
            f" cpu {statistics.median(r['cpu_s'] for r in runs[name]):.2f} s"
        )
    for field, label in (("cache_ops_s", "cache ops (wall)"), ("cpu_s", "process cpu")):
        described = ", ".join(f"{r:.2f}" for r in ratios[field])
        print(
            f"sglang / tpcache, {label}: median of per-round ratios "
            f"{statistics.median(ratios[field]):.2f}x ({described}; target 5x)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
