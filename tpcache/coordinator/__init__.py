"""Admission, the op log, driving the ranks, lockstep checks, the frontend API, KV events
and metrics. May import ``tpcache.workers`` and ``tpcache.cache``."""
