"""The serving engine: the loop that turns generate requests into steps of a TP group's
model (admission as KV allows, chunked prefill under a token budget, decode batches,
preemption, sampling, stop conditions), and the batched forward each step runs
(``forward.ModelEngine``).

May import ``tpcache.coordinator`` and what it may; never ``frontend``, ``cli`` or
``harness``.
"""
