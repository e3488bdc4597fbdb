"""Cache namespaces: what besides the tokens keys cached KV (a LoRA adapter, a tenant's
cache salt), so equal tokens in different namespaces never share KV.

A namespace lives in the tree as a zero-page *anchor* node under the root, keyed by
``CacheNamespace.key``: bytes whose length is not a multiple of 4, so no page of token
ids (4 bytes a token) can ever equal it and a lookup from the root never lands on it.
Requests of the namespace match and insert below their anchor. The block-hash chain
below an anchor starts from the namespace's ``seed`` instead of the root state, so
block hashes differ across namespaces (as vLLM folds extra keys into its block hashes).
The default namespace (no adapter, no salt) is the root itself: ``None`` everywhere.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

from tpcache.cache.errors import InvalidNamespace

MAX_NAME_LEN = 256  # characters of a LoRA name or a cache salt
_MAX_ID = (1 << 63) - 1
_TAG = b"\xffNS1"  # first bytes of every anchor key (a version, should the layout change)


def _check_text(value: Any, what: str) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise InvalidNamespace(f"{what} must be a str or None, got {type(value).__name__}")
    if not 0 < len(value) <= MAX_NAME_LEN:
        raise InvalidNamespace(
            f"{what} must have 1 to {MAX_NAME_LEN} characters, got {len(value)}"
            + (" (use None for no value)" if not value else "")
        )


def _text_bytes(value: str | None) -> bytes:
    if value is None:
        return b"\x00"
    data = value.encode("utf-8", "surrogatepass")
    return b"\x01" + struct.pack(">H", len(data)) + data


@dataclass(frozen=True, slots=True)
class CacheNamespace:
    """What keys a request's KV besides its tokens. Immutable; validated on creation.

    ``lora_id``: the LoRA adapter's integer id (0 <= id < 2**63); ``lora_name``: its name
    (events carry both, as vLLM's ``BlockStored`` does); ``salt``: a tenant's cache salt,
    never announced, so one tenant cannot learn another's prompts through cache-hit
    timing. Raises ``InvalidNamespace`` for a wrong type, a negative or huge id, or an
    empty or over-long (``MAX_NAME_LEN``) name or salt.
    """

    lora_id: int | None = None
    lora_name: str | None = None
    salt: str | None = None

    def __post_init__(self) -> None:
        lid = self.lora_id
        if lid is not None:
            if not isinstance(lid, int) or isinstance(lid, bool):
                raise InvalidNamespace(f"lora_id must be an int or None, got {type(lid).__name__}")
            if not 0 <= lid <= _MAX_ID:
                raise InvalidNamespace(f"lora_id must be in [0, 2**63), got {lid}")
        _check_text(self.lora_name, "lora_name")
        _check_text(self.salt, "salt")

    @property
    def is_default(self) -> bool:
        """No adapter and no salt: the root's namespace."""
        return self.lora_id is None and self.lora_name is None and self.salt is None

    @property
    def key(self) -> bytes:
        """The anchor's key: injective in the fields, its length never a multiple of 4."""
        lid = b"\x00" if self.lora_id is None else b"\x01" + struct.pack(">Q", self.lora_id)
        body = _TAG + lid + _text_bytes(self.lora_name) + _text_bytes(self.salt)
        return body + b"\x00" if len(body) % 4 == 0 else body

    @property
    def seed(self) -> int:
        """The chain state the namespace's first blocks hash from (64 bits)."""
        digest = hashlib.blake2b(self.key, digest_size=8, person=b"tpcache-ns").digest()
        return int.from_bytes(digest, "little")


def as_namespace(value: Any) -> CacheNamespace | None:
    """A call's namespace: ``None`` for the default one (``None`` or a default
    ``CacheNamespace``), else the ``CacheNamespace``. Raises ``InvalidNamespace`` for
    anything else. Changes nothing."""
    if value is None:
        return None
    if not isinstance(value, CacheNamespace):
        raise InvalidNamespace(
            f"a namespace must be a CacheNamespace or None, got {type(value).__name__}"
        )
    return None if value.is_default else value


def make_namespace(
    lora_id: Any = None, lora_name: Any = None, salt: Any = None
) -> CacheNamespace | None:
    """``as_namespace(CacheNamespace(lora_id, lora_name, salt))``: the upper layers' way
    from a call's fields to the cache's argument. Raises ``InvalidNamespace``."""
    if lora_id is None and lora_name is None and salt is None:
        return None
    return CacheNamespace(lora_id, lora_name, salt)


def is_anchor(node: Any) -> bool:
    """Whether a tree node is a namespace's anchor (its key is no whole number of
    tokens; the root's is empty)."""
    return bool(len(node.kb) & 3)
