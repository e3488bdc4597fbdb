"""Typed errors of the cache state machine.

Every error is raised before any state changes, so a caller that catches one can go on.
"""

from tpcache.errors import TpcacheError


class CacheError(TpcacheError):
    """Base of every error the cache state machine raises on bad input or misuse."""


class InvalidTokens(CacheError, ValueError):
    """Token ids that are empty, negative, non-integer, too large or badly shaped."""


class InvalidSlots(CacheError, ValueError):
    """Slot ids whose length or page layout does not fit the tokens they go with."""


class AllocatorError(CacheError):
    """Misuse of the allocator: double free, freeing an unowned page, ids out of range."""


class OutOfCapacity(CacheError):
    """Not enough free slots even after eviction; nothing was allocated."""


class UnknownHandle(CacheError, KeyError):
    """A handle that this cache did not give out for the node it names (another cache's,
    from before a reset, built or altered by hand), one naming a namespace anchor, or
    one whose node is gone."""

    def __str__(self) -> str:  # KeyError's would repr-quote the message
        return Exception.__str__(self)


class LockError(CacheError):
    """Unlocking what is not locked."""


class StaleBoundary(LockError):
    """An SWA lock boundary that no longer names a node on the handle's path."""


class NoSwaPool(CacheError, ValueError):
    """SWA tokens to evict (``evict``'s ``swa_tokens``) from a cache without an SWA pool."""


class UnknownRequest(CacheError, KeyError):
    """A request id the cache does not hold."""

    def __str__(self) -> str:  # KeyError's would repr-quote the message
        return Exception.__str__(self)


class DuplicateRequest(CacheError, ValueError):
    """A request id that is already running."""


class IntegrityError(CacheError, AssertionError):
    """``check_integrity()`` found a broken invariant; the message has the numbers."""


class HostTierError(CacheError, ValueError):
    """A host (CPU) tier that cannot be built: a host pool smaller than one page, a write
    policy it does not know, or a cache kind or eviction policy that has no host tier."""


class SwaHostTierError(HostTierError):
    """A cache asked for both a sliding window (an SWA pool) and a host tier: no cache
    kind has both (``factory.py`` says why)."""


class InvalidNamespace(CacheError, ValueError):
    """A cache namespace (LoRA adapter id or name, tenant cache salt) of a wrong type or
    out of range, or one a cache kind cannot key (the host tier)."""


class UnknownName(CacheError, ValueError):
    """A name (an eviction policy, an event encoding) that is not one of the known ones;
    the message lists them."""
