"""Instructions (valgrind callgrind's Ir) that a slice of ``tpcache replay`` executes: a
count that the load of a shared machine does not change, for comparing two versions of
the cache (or the host tier against the single tier) where wall and CPU times are too
noisy. Requests ``--first`` .. ``--last`` of the trace are counted, after the earlier ones
ran uninstrumented (so the pools are full, as in the replay's steady state).

    .venv/bin/python scripts/ir_replay.py [--host-capacity 30000000] [--first 5000]
        [--last 7000] [--no-gc]

Needs valgrind (with its headers) and a C compiler; prints the Ir of the slice. Run a
version by putting its tree first: ``PYTHONPATH=/path/to/tree``. Python's hash seed is
fixed, so a version gives the same count every run; ``--no-gc`` leaves the cyclic GC's
collections out (where one falls in a short slice is luck). Instruction counts weigh
memory copies far above their cost (a ``rep movsb`` byte is an instruction): a guide
between versions, not a time.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import subprocess
import sys
import tempfile

_HELPER = """#include <valgrind/callgrind.h>
void start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void stop(void) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS; }
"""


def run_slice(args: argparse.Namespace) -> None:
    import ctypes

    from tpcache.cache.keys import frozen_tokens
    from tpcache.replay import ReplayOptions, make_cache
    from tpcache.trace import (
        DEFAULT_TRACE,
        load_trace,
        output_tokens,
        scaled_output_length,
        scaled_prompt_tokens,
    )

    lib = ctypes.CDLL(args.helper)
    requests = load_trace(args.trace or DEFAULT_TRACE, args.last)
    opts = ReplayOptions(args.capacity, args.page_size, host_capacity=args.host_capacity)
    cache, _ = make_cache(opts, args.capacity)
    if args.no_gc:
        gc.disable()
    # The tokens first: only the cache's calls are counted.
    items = [
        (
            r.index,
            frozen_tokens(scaled_prompt_tokens(r, 1)),
            output_tokens(r)[: scaled_output_length(r, 1)],
        )
        for r in requests
    ]
    for i, (rid, prompt, output) in enumerate(items):
        if i == args.first:
            lib.start()
        cache.admit(rid, prompt, reserve=output.size)
        cache.finish(rid, output)
    lib.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=None, help="default: the trace in tpcache/data/")
    ap.add_argument("--capacity", type=int, default=3_000_000)
    ap.add_argument("--host-capacity", type=int, default=None)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--first", type=int, default=5000)
    ap.add_argument("--last", type=int, default=7000)
    ap.add_argument("--no-gc", action="store_true")
    ap.add_argument("--helper", help=argparse.SUPPRESS)  # set for the run under valgrind
    args = ap.parse_args()
    if args.helper:
        run_slice(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = os.path.join(tmp, "cg.c"), os.path.join(tmp, "cg.so")
        with open(src, "w") as f:
            f.write(_HELPER)
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", lib, src], check=True)
        out = os.path.join(tmp, "callgrind.out")
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
               sys.executable, __file__, *sys.argv[1:], "--helper", lib]  # fmt: skip
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        found = re.search(r"Collected : (\d+)", done.stderr)
        if done.returncode or not found:
            raise SystemExit(done.stderr[-2000:])
        print(f"Ir {int(found.group(1)):,} (requests {args.first}..{args.last - 1})")


if __name__ == "__main__":
    main()
