"""The sliding-window part: the hybrid cache's paired pools, its tree with tombstones,
the window's eviction and inserts, its config and its checks.

Imports only ``tpcache.cache`` modules and ``tpcache.errors``.
"""
