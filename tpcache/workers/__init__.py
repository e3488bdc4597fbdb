"""One TP rank: its KV-pool shard, its cache mirror, its collectives.

May import ``tpcache.cache``; never ``tpcache.coordinator``.
"""
