"""The first N requests of the conversation trace (the one in tpcache/data/) through one cache,
for instruction counts that machine load does not move (valgrind's callgrind counts
instructions).

    valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.none \
        .venv/bin/python scripts/replay_slice.py 3000 none
    valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.lru \
        .venv/bin/python scripts/replay_slice.py 3000 lru

``none`` loads the trace and synthesises the tokens only: subtract its total from the
others' to get the cache's own instructions. Modes: a policy name (the base cache at 3M
tokens, page 16) or ``hybrid`` (3M full / 1M SWA tokens, window 4096). Prints the CPU
seconds of the cache calls.
"""

from __future__ import annotations

import sys
import time

from tpcache.cache.keys import frozen_tokens
from tpcache.cache.radix import CacheConfig, RadixCache
from tpcache.cache.swa.cache import HybridCache
from tpcache.cache.swa.config import HybridConfig
from tpcache.trace import DEFAULT_TRACE, load_trace, output_tokens, prompt_tokens


def main() -> int:
    limit, mode = int(sys.argv[1]), sys.argv[2]
    data = [
        (r, frozen_tokens(prompt_tokens(r)), output_tokens(r))
        for r in load_trace(DEFAULT_TRACE, limit)
    ]
    if mode == "none":
        return 0
    if mode == "hybrid":
        cache: RadixCache | HybridCache = HybridCache(
            HybridConfig(3_000_000, 1_000_000, 4096, 16, "lru")
        )
    else:
        cache = RadixCache(CacheConfig(3_000_000, 16, mode))
    started = time.thread_time()
    for req, prompt, output in data:
        cache.admit(req.index, prompt, reserve=output.size)
        cache.finish(req.index, output)
    print(f"cache calls: {time.thread_time() - started:.3f} s CPU ({len(data)} requests)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
