"""The radix tree every cache kind is built on: its nodes and match records, insert,
eviction, namespace anchors, block hashes, the handles it gives out, and its checks.

Imports only ``tpcache.cache`` modules and ``tpcache.errors``.
"""
