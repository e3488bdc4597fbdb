"""The driver: admission, the op log, driving the ranks (Ray, threads, torchrun),
lockstep checks, recovery, and building a group from its config.

May import ``tpcache.events``, ``tpcache.workers`` and the packages below it; never
``tpcache.frontend`` or ``tpcache.harness``, which are built on it.
"""
