"""One TP rank: what it does per step (``protocol``), the model it hosts
(``model_host``), its lead rank's duties, its spec and the host copies' agreement,
calling ``lockstep``, ``group``, ``kv``, ``model`` and ``cache``.

Never imports ``tpcache.coordinator``.
"""
