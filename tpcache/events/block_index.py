"""The set of blocks a KV-event stream says are stored, folded from its events.

Both ends of the stream keep one: the publisher, so it can hand a late joiner a
snapshot; a subscriber, so it can check the stream (a removal of a block never stored
is a bug somewhere upstream, or a gap it has not filled).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tpcache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from tpcache.errors import TpcacheError

# The same hash may be stored on the GPU and in the host tier at once; each copy is
# announced and removed on its own, so a block is known by (medium, hash).
BlockKey = tuple[str | None, int]


class NotAnEvent(TpcacheError, TypeError):
    """Something that is not a KV event was given to the block index."""


class IndexIntegrityError(TpcacheError, AssertionError):
    """``BlockIndex.check_integrity()`` found a broken invariant; the message names it."""


class ProblemKind(enum.Enum):
    UNKNOWN_REMOVAL = "unknown_removal"  # BlockRemoved for a (medium, hash) not stored
    DUPLICATE_STORE = "duplicate_store"  # BlockStored for a (medium, hash) already stored
    UNKNOWN_PARENT = "unknown_parent"  # parent hash not stored on any medium
    BAD_TOKEN_COUNT = "bad_token_count"  # len(token_ids) != len(block_hashes) * block_size


@dataclass(frozen=True, slots=True)
class IndexProblem:
    """One thing in the stream that does not fit the index; the event was still applied."""

    kind: ProblemKind
    block_hash: int | None
    medium: str | None
    detail: str


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """What the stream said about one stored block. Immutable, so copies share it."""

    parent_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    lora_name: str | None
    namespace: str | None = None


class BlockIndex:
    """Stored blocks keyed by (medium, hash), in the order they were first stored.

    ``apply`` never raises on a surprising event: it applies what it can (a store is
    recorded, a removal of an unknown block is a no-op) and returns the problems, so a
    caller decides whether a problem is fatal. Not thread-safe: one owner at a time.
    """

    def __init__(self) -> None:
        # Owned by this index; insertion order is first-store order, which makes
        # ``to_events`` deterministic.
        self._blocks: dict[BlockKey, StoredBlock] = {}
        # How many media store each hash. A parent may be on another medium than its
        # child: a host tier's copy of a block whose prefix is still on the GPU.
        self._media: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def get(self, block_hash: int, medium: str | None = "GPU") -> StoredBlock | None:
        return self._blocks.get((medium, block_hash))

    def keys(self) -> set[BlockKey]:
        """A copy of the stored (medium, hash) pairs."""
        return set(self._blocks)

    def copy(self) -> BlockIndex:
        """A shallow copy (records are immutable); O(n) at C speed."""
        other = BlockIndex()
        other._blocks = self._blocks.copy()
        other._media = self._media.copy()
        return other

    def clear(self) -> None:
        self._blocks.clear()
        self._media.clear()

    def apply(self, event: KVEvent) -> list[IndexProblem]:
        """Fold one event into the index; returns the problems it found (may be empty).

        Raises TypeError only for an object that is not a KV event at all.
        """
        match event:
            case BlockStored():
                return self._store(event)
            case BlockRemoved():
                return self._remove(event)
            case AllBlocksCleared():
                self.clear()
                return []
            case _:
                raise NotAnEvent(f"not a KV event: {type(event).__name__}")

    def apply_all(self, events: list[KVEvent]) -> list[IndexProblem]:
        problems: list[IndexProblem] = []
        for event in events:
            problems.extend(self.apply(event))
        return problems

    def _store(self, ev: BlockStored) -> list[IndexProblem]:
        problems: list[IndexProblem] = []
        size = ev.block_size
        if size < 1 or len(ev.token_ids) != len(ev.block_hashes) * size:
            problems.append(
                IndexProblem(
                    ProblemKind.BAD_TOKEN_COUNT,
                    ev.block_hashes[0] if ev.block_hashes else None,
                    ev.medium,
                    f"{len(ev.token_ids)} token ids for {len(ev.block_hashes)} blocks "
                    f"of size {size}",
                )
            )
        parent = ev.parent_block_hash
        if parent is not None and parent not in self._media:
            problems.append(
                IndexProblem(ProblemKind.UNKNOWN_PARENT, parent, ev.medium, "parent not stored")
            )
        step = max(size, 1)
        for i, block_hash in enumerate(ev.block_hashes):
            key = (ev.medium, block_hash)
            if key in self._blocks:
                problems.append(
                    IndexProblem(
                        ProblemKind.DUPLICATE_STORE, block_hash, ev.medium, "already stored"
                    )
                )
            else:
                self._media[block_hash] = self._media.get(block_hash, 0) + 1
            tokens = tuple(ev.token_ids[i * step : (i + 1) * step])
            self._blocks[key] = StoredBlock(
                parent, tokens, size, ev.lora_id, ev.lora_name, ev.namespace
            )
            parent = block_hash
        return problems

    def _remove(self, ev: BlockRemoved) -> list[IndexProblem]:
        problems: list[IndexProblem] = []
        for block_hash in ev.block_hashes:
            if self._blocks.pop((ev.medium, block_hash), None) is None:
                problems.append(
                    IndexProblem(ProblemKind.UNKNOWN_REMOVAL, block_hash, ev.medium, "not stored")
                )
            elif self._media[block_hash] == 1:
                del self._media[block_hash]
            else:
                self._media[block_hash] -= 1
        return problems

    def cached_prefix(
        self,
        tokens: list[int] | tuple[int, ...],
        medium: str | None = "GPU",
        namespace: str | None = None,
    ) -> int:
        """How many leading ``tokens`` the blocks stored on ``medium`` hold as one chain
        from a root block, in ``namespace`` (a ``BlockStored.namespace``; None: the
        default one): what a router predicts a request will find cached. Whole blocks
        only, and never the last token (an engine computes it). Reads only; O(blocks)."""
        child: dict[tuple[int | None, tuple[int, ...], int, str | None], int] = {}
        sizes: set[int] = set()
        for (m, block_hash), b in self._blocks.items():
            if m == medium:
                child[b.parent_hash, b.token_ids, b.block_size, b.namespace] = block_hash
                sizes.add(b.block_size)
        if len(sizes) != 1:  # nothing stored, or blocks of several sizes: no one chain
            return 0
        size = sizes.pop()
        parent: int | None = None
        hit = 0
        while hit + size < len(tokens):
            key = (parent, tuple(tokens[hit : hit + size]), size, namespace)
            if key not in child:
                break
            parent, hit = child[key], hit + size
        return hit

    def to_events(self) -> list[BlockStored]:
        """``BlockStored`` events that rebuild this index from empty, parents first.

        One event per chain run: a run extends while its last block has exactly one
        child with the same medium, block size, LoRA and namespace. A block whose parent is on
        another medium only comes after it (the parent on its own medium if stored there,
        else on the first medium that stored it). Applying the result to an empty
        ``BlockIndex`` gives an index equal to this one (no problems reported except
        UNKNOWN_PARENT for blocks whose parent is itself not stored).
        """
        first_key: dict[int, BlockKey] = {}
        for key in self._blocks:
            first_key.setdefault(key[1], key)
        children: dict[BlockKey, list[BlockKey]] = {}
        roots: list[BlockKey] = []
        for key, block in self._blocks.items():
            parent_key: BlockKey | None = (key[0], block.parent_hash)
            if parent_key not in self._blocks:
                parent_key = first_key.get(block.parent_hash)  # type: ignore[arg-type]
            if block.parent_hash is not None and parent_key is not None:
                children.setdefault(parent_key, []).append(key)
            else:
                roots.append(key)
        events: list[BlockStored] = []
        done: set[BlockKey] = set()
        # Keys left after the walk from roots sit on a parent cycle (only possible if
        # hashes collide); emitting them anyway keeps the snapshot complete.
        for start in [*roots, *self._blocks]:
            if start in done:
                continue
            stack = [start]
            while stack:
                key = stack.pop()
                if key in done:  # reached again only through a cycle
                    continue
                run = self._run_from(key, children, done)
                events.append(self._run_event(run))
                stack.extend(reversed(children.get(run[-1], [])))
        return events

    def _run_from(
        self, key: BlockKey, children: dict[BlockKey, list[BlockKey]], done: set[BlockKey]
    ) -> list[BlockKey]:
        run = [key]
        done.add(key)
        first = self._blocks[key]
        while True:
            kids = children.get(run[-1], [])
            if len(kids) != 1 or kids[0] in done or kids[0][0] != key[0]:
                return run
            kid = self._blocks[kids[0]]
            if (kid.block_size, kid.lora_id, kid.lora_name, kid.namespace) != (
                first.block_size,
                first.lora_id,
                first.lora_name,
                first.namespace,
            ):
                return run
            run.append(kids[0])
            done.add(kids[0])

    def _run_event(self, run: list[BlockKey]) -> BlockStored:
        first = self._blocks[run[0]]
        tokens: list[int] = []
        for key in run:
            tokens.extend(self._blocks[key].token_ids)
        return BlockStored(
            block_hashes=[key[1] for key in run],
            parent_block_hash=first.parent_hash,
            token_ids=tokens,
            block_size=first.block_size,
            lora_id=first.lora_id,
            medium=run[0][0],
            lora_name=first.lora_name,
            namespace=first.namespace,
        )

    def check_integrity(self) -> None:
        """Raise IndexIntegrityError if a block's tokens do not fill it, or parents loop."""
        for (medium, block_hash), block in self._blocks.items():
            if len(block.token_ids) != block.block_size:
                raise IndexIntegrityError(
                    f"block {block_hash} ({medium}): {len(block.token_ids)} tokens, "
                    f"block size {block.block_size}"
                )
        acyclic: set[BlockKey] = set()
        for key in self._blocks:
            path: list[BlockKey] = []
            on_path: set[BlockKey] = set()
            cur: BlockKey | None = key
            while cur is not None and cur in self._blocks and cur not in acyclic:
                if cur in on_path:
                    raise IndexIntegrityError(f"parent cycle through block {cur[1]} ({cur[0]})")
                path.append(cur)
                on_path.add(cur)
                parent = self._blocks[cur].parent_hash
                cur = None if parent is None else (cur[0], parent)
            acyclic.update(path)
