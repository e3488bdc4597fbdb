"""TP group membership and collectives: joining a group (rendezvous, timeouts), the MIN
agreement and digest check over it, and the wire of those collectives.

May import ``tpcache.transport`` (private directories) and ``tpcache.errors``.
"""
