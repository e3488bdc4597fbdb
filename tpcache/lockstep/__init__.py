"""The lockstep records both sides share: the op records of a step, the op log (what the
coordinator's mirror and every rank log for each call), and the lockstep errors.

May import ``tpcache.cache`` and ``tpcache.errors``; no torch, no Ray.
"""
