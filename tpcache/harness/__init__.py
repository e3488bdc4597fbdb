"""Checking harnesses, apart from the product: the model engine and its work items, the
model check, the soak, the demo, and ``tpcache generate``'s loop and clients.

May import ``tpcache.coordinator`` and what it may, and ``tpcache.trace`` and
``tpcache.replay``; the product never imports these
(only the CLI's ``demo`` and ``generate`` and ``tpcache.torchrun check``, which run them).
"""
