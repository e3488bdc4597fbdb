"""Shared helpers of the namespace tests (not a test module)."""

from __future__ import annotations

from typing import Any

from tpcache.cache.namespace import is_anchor


def ns_view(cache: Any) -> list[tuple]:
    """Every node, parents first, children in key order: an anchor as ``("anchor",
    lora_id, lora_name, salt, lock)``, any other node as (tokens, pages, lock)."""
    out: list[tuple] = []
    for n in cache.tree.walk():
        if is_anchor(n):
            space = cache.tree.spaces[n.kb][0]
            out.append(("anchor", space.lora_id, space.lora_name, space.salt, n.lock))
        else:
            out.append((n.key.tolist(), n.pages.tolist(), n.lock))
    return out


def run_in(cache: Any, rid: object, tokens: list[int], space: Any = None) -> int:
    """Admit and finish ``rid`` in ``space``; returns the admit's prefix length."""
    got = cache.admit(rid, tokens, namespace=space)
    cache.finish(rid)
    return got.prefix_len
