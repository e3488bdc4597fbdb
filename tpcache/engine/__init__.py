"""The serving engine: the loop that turns generate requests into steps of a TP group's
model (admission as KV allows, chunked prefill under a token budget, decode batches,
preemption, sampling, stop conditions), and the batched forward each step runs
(``forward.ModelEngine``).

Where things are: ``loop.Engine`` (the API: submit, cancel, close, stats),
``config.EngineConfig``, ``errors`` (its typed errors), ``requests`` (the records a
request and its answer travel as: no torch, no Ray), ``scheduler`` (who runs next),
``stepper`` (one step), ``sampling``, ``recovery`` (waiting for a failed group).
Nothing is imported here, so ``requests`` stays importable without torch.

May import ``tpcache.coordinator`` and what it may; never ``frontend``, ``cli`` or
``harness``.
"""
