"""The model a rank runs on its KV shard: the runner interface, batch records, attention,
the reference runner, the Llama family and its weight loading.

May import ``tpcache.kv``, ``tpcache.lockstep``, ``tpcache.cache`` and
``tpcache.errors``; never a rank or the driver.
"""
