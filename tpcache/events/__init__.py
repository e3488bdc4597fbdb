"""KV events and metrics: the publisher, its replay server and block index, the
subscriber (``tpcache events``), the event config and the Prometheus metrics.

May import ``tpcache.transport`` (``netsec``) and ``tpcache.cache``; never the driver
(``coordinator``): the metrics read it through a protocol (``metrics.Observed``).
"""
