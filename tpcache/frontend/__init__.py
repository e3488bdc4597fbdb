"""The API served to routers: its msgspec records (``api``, importable without torch or
Ray), the call handler, the network frontend, the Ray service and its Ray client. The
torch-free client is ``tpcache.client``.

May import ``tpcache.coordinator`` and what it may; ``api`` only ``tpcache.cache`` and
the driver's errors (``coordinator.errors``).
"""
