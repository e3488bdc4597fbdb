"""Whether a ``tpcache generate`` run fits in this machine's memory, asked before any of
it is allocated (``generate.run_generate``): the reference model's size comes from
options (``--hidden``, ``--ffn``, ``--layers``) and the KV pool's from ``--capacity``, so
a mistyped one would otherwise end in an allocation of tens of gigabytes failing deep in
torch, or in the machine swapping.

What a run holds (float32): the model's weights, drawn whole on the host and kept there
(``model.reference.full_weights``), and each rank's shard of them, which is a copy where a
rank takes columns (Wq, Wk, Wv, up); so about twice the weights. The ranks' KV pools are
on the host too when there is no GPU.
"""

from __future__ import annotations

import os

from tpcache.harness.gen_wire import GenerateError

_FLOAT32 = 4


def weight_bytes(hidden: int, ffn: int, layers: int, vocab: int) -> int:
    """Bytes of the reference model's weights in float32: the embedding and the output
    head (vocab x hidden each), per layer Wq, Wk, Wv, Wo (hidden x hidden: its heads
    split the hidden size), up and down (hidden x ffn) and two norms, and the last norm."""
    per_layer = 4 * hidden * hidden + 2 * hidden * ffn + 2 * hidden
    return _FLOAT32 * (2 * vocab * hidden + layers * per_layer + hidden)


def available_bytes() -> int | None:
    """Memory this process may still take: the kernel's MemAvailable, or less where a
    cgroup (a container) sets a lower limit; the machine's physical memory where neither
    can be read, None where that cannot either."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            found.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    if not found:
        try:
            found.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError):
            return None
    return min(found)


def check_fits(
    hidden: int,
    ffn: int,
    layers: int,
    vocab: int,
    kv_bytes: int,
    kv_on_host: bool,
    available: int | None = None,
) -> None:
    """Raise ``GenerateError`` saying what the run needs if the weights (twice: whole and
    as the ranks' shards) and, with ``kv_on_host``, the KV pools (``kv_bytes``, every
    rank's together) need more than ``available`` bytes (this machine's
    ``available_bytes()`` when None; nothing is checked where that cannot be read).
    Allocates nothing."""
    if available is None:
        available = available_bytes()
    if available is None:
        return
    weights = weight_bytes(hidden, ffn, layers, vocab)
    kv = kv_bytes if kv_on_host else 0
    need = 2 * weights + kv
    if need <= available:
        return
    pool = f"KV pool {_size(kv_bytes)}" + ("" if kv_on_host else " on the GPUs, not counted")
    smaller = "model (hidden, ffn, layers)" if 2 * weights >= kv else "capacity or slice"
    raise GenerateError(
        f"the run needs about {_size(need)} of memory, more than the {_size(available)} "
        f"available here: weights {_size(weights)} (hidden {hidden:,}, ffn {ffn:,}, "
        f"{layers:,} layers, vocabulary {vocab:,}), held whole and as the ranks' shards; "
        f"{pool}; choose a smaller {smaller}"
    )


def _size(n: int) -> str:
    """``n`` bytes in the largest decimal unit that keeps the number under 1,000."""
    value = float(n)
    for unit in ("bytes", "kB", "MB", "GB", "TB", "PB"):
        if value < 1000:
            return f"{n:,} bytes" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:,.1f} EB"
