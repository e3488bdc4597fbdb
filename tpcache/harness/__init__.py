"""Checking harnesses, apart from the product: the model engine and its work items, the
model check, the soak and the demo.

May import ``tpcache.coordinator`` and what it may; the product never imports these
(only the CLI's ``demo`` and ``tpcache.torchrun check``, which run them).
"""
