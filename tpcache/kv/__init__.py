"""KV memory of one rank: the device pool shard and the host pool, and the copy engine
that moves pages between them.

May import ``tpcache.cache`` and ``tpcache.errors``; never a rank or the driver.
"""
