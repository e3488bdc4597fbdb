"""The host tier: the host pool, the host tree, the moves between device and host, the
copy log and the waits on it, the tier's eviction, config and checks.

Imports only ``tpcache.cache`` modules and ``tpcache.errors``.
"""
