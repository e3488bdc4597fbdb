"""The API served to routers: its msgspec records (``api``, importable without torch or
Ray), the call handler, the network frontend, the Ray service and its client
(``ray_client.RayClient``), and generate over them (``netgen``, ``ray_gen``,
``serving``: a served model's engine and endpoints). The torch-free client is
``tpcache.client.NetworkClient``; both clients' calls are written once (``calls``) and
return the same ``api`` reply records.

May import ``tpcache.coordinator``, ``tpcache.engine`` and what they may; ``api`` only
``tpcache.cache``, the driver's errors (``coordinator.errors``) and the engine's
torch-free records and errors (``engine.requests``, ``engine.errors``).
"""
