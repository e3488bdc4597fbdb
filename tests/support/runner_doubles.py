"""Test doubles of ``ModelRunner`` (built by name, ``runner_doubles:RecordingRunner``, in
the ranks of an in-process group: this directory is on ``sys.path`` under pytest)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpcache.model.batch import RunnerBatch
from tpcache.model.reference import ReferenceRunner
from tpcache.model.runner import KVLayout, KVShard, RankShard, RunnerInputError, RunnerOutput


@dataclass(frozen=True)
class Seen:
    """One request of one batch, as a runner got it (plain lists)."""

    rid: int | str
    tokens: list[int]
    start: int
    write_slots: list[int]
    read_slots: list[int]
    swa_start: int
    swa_slots: list[int] | None
    all_logits: bool


def seen(batch: RunnerBatch) -> tuple[int, list[Seen]]:
    return batch.after_step, [
        Seen(
            r.rid,
            r.tokens.tolist(),
            r.start,
            r.write_slots.tolist(),
            r.read_slots.tolist(),
            r.swa_start,
            None if r.swa_slots is None else r.swa_slots.tolist(),
            r.all_logits,
        )
        for r in batch.requests
    ]


class RecordingRunner:
    """Records every batch (``batches``: (after_step, [Seen])) and writes a known K and V
    (the token id, on every layer and head) at each request's write slots; returns as
    "sampled" token the last new token + 1 (mod ``vocab``). One all-reduce per batch, so
    it is collective as a real runner is. ``check_batch`` refuses ids >= ``vocab``."""

    def __init__(
        self,
        num_layers: int = 2,
        kv_heads: int = 4,
        head_dim: int = 4,
        dtype: str = "float32",
        swa_layers: tuple[int, ...] | list[int] = (),
        window: int | None = None,
        vocab: int = 50,
    ) -> None:
        self.layout = KVLayout(num_layers, kv_heads, head_dim, dtype, tuple(swa_layers), window)
        self.vocab = vocab
        self.shard: RankShard | None = None
        self.batches: list[tuple[int, list[Seen]]] = []
        self.all_reduced: list[float] = []

    def kv_layout(self) -> KVLayout:
        return self.layout

    def load(self, shard: RankShard) -> None:
        self.shard = shard

    def check_batch(self, batch: RunnerBatch) -> None:
        if int(batch.tokens.max()) >= self.vocab:
            raise ValueError(f"token id {int(batch.tokens.max())} >= vocab {self.vocab}")

    def run(self, batch: RunnerBatch, kv: KVShard, group) -> RunnerOutput:
        self.batches.append(seen(batch))
        for i, where in enumerate(kv.placement):
            kbuf, vbuf = kv.buffers(i)
            for r in batch.requests:
                _read, _lo, write = r.context(where.pool, where.window)
                val = r.tokens.to(kbuf.dtype)[:, None, None].expand(-1, *kbuf.shape[1:])
                kbuf.index_copy_(0, write, val)
                vbuf.index_copy_(0, write, -val)
        total = group.all_reduce_sum(torch.ones(1) * (group.rank + 1))
        self.all_reduced.append(float(total))
        last = torch.stack([r.tokens[-1] for r in batch.requests])
        return RunnerOutput(token_ids=(last + 1) % self.vocab)


class NotARunner:
    """Has a layout but no run: ``build_runner`` must refuse it."""

    def __init__(self) -> None:
        pass

    def kv_layout(self) -> KVLayout:
        return KVLayout(1, 1, 2)


REFUSED_ON_RANK_1 = 63


class OneRankRefuses(ReferenceRunner):
    """The reference model, refusing a batch that holds token ``REFUSED_ON_RANK_1`` on
    rank 1 only (as one rank's device may refuse what its peers accept)."""

    def load(self, shard: RankShard) -> None:
        super().load(shard)
        self.rank = shard.rank

    def check_batch(self, batch: RunnerBatch) -> None:
        super().check_batch(batch)
        if self.rank == 1 and bool((batch.tokens == REFUSED_ON_RANK_1).any()):
            raise RunnerInputError(f"token {REFUSED_ON_RANK_1} is refused on rank 1")


class SkewedOnRank1(ReferenceRunner):
    """The reference model whose rank 1 returns other logits than its peers, as a runner
    that skips the last all-reduce would: ``skew`` is added to every logit there
    (``"shift"``), or token 0's logit is raised above all others (``"argmax"``)."""

    def __init__(self, skew: str = "shift", dtype: str = "float32", **spec) -> None:
        super().__init__(dtype, **spec)
        self.skew = skew

    def load(self, shard: RankShard) -> None:
        super().load(shard)
        self.rank = shard.rank

    def run(self, batch: RunnerBatch, kv: KVShard, group) -> RunnerOutput:
        out = super().run(batch, kv, group)
        if self.rank != 1 or out.logits is None:
            return out
        logits = out.logits.clone()
        if self.skew == "shift":
            logits += 0.5 * logits.abs().max()
        else:
            logits[:, 0] = logits.max() + 1.0
        return RunnerOutput(logits=logits)
