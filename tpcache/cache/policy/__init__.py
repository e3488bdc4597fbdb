"""Eviction policies: the policy keys, the eviction order kept over them, ghost lists,
page lifetimes and the re-sighting policy.

Imports only ``tpcache.cache`` modules and ``tpcache.errors``.
"""
