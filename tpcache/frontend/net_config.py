"""Where the network frontend (``netfront``) listens and who may use it: its config,
checked on construction, and what a request's token says about its sender."""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

from tpcache.errors import TpcacheError
from tpcache.transport.netsec import NetSecError, check_key, endpoint_is_local


class FrontendConfigError(TpcacheError, ValueError):
    """A field of ``FrontendConfig`` is invalid; the message names it."""


@dataclass(frozen=True)
class FrontendConfig:
    """Where the network frontend listens and who may use it (validated here)."""

    endpoint: str = "tcp://127.0.0.1:5560"
    curve_secret_key: str | None = None
    curve_client_keys: tuple[str, ...] = ()
    token: str | None = None  # a shared secret every request carries
    insecure: bool = False  # a network address without CURVE or a token, on purpose
    max_queue: int = 4096  # calls waiting; more get a Busy reply
    # Tenants by name, each with a token of its own (instead of, or beside, ``token``): a
    # tenant's cache salts key KV that only it can match, and it sees its own figures.
    tenants: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise FrontendConfigError(
                f"endpoint must be 'transport://address', got {self.endpoint!r}"
            )
        try:
            if self.curve_secret_key is not None:
                check_key("curve_secret_key", self.curve_secret_key)
            for key in self.curve_client_keys:
                check_key("a key of curve_client_keys", key)
        except NetSecError as exc:
            raise FrontendConfigError(str(exc)) from None
        if self.curve_client_keys and self.curve_secret_key is None:
            raise FrontendConfigError("curve_client_keys need curve_secret_key")
        if self.token is not None and (not isinstance(self.token, str) or len(self.token) < 16):
            raise FrontendConfigError("token must be a str of at least 16 characters")
        self._check_tenants()
        if (
            isinstance(self.max_queue, bool)
            or not isinstance(self.max_queue, int)
            or self.max_queue < 1
        ):
            raise FrontendConfigError(f"max_queue must be an int >= 1, got {self.max_queue!r}")
        guarded = self.curve_secret_key is not None or self.token is not None or self.tenants
        if not (endpoint_is_local(self.endpoint) or guarded or self.insecure):
            raise FrontendConfigError(
                f"{self.endpoint!r} is reachable from the network and the API carries prompts "
                "and changes the cache: give curve_secret_key, token or tenants, or insecure=True"
            )

    def _check_tenants(self) -> None:
        if not isinstance(self.tenants, dict):
            raise FrontendConfigError(
                f"tenants must be a dict of name -> token, got {type(self.tenants).__name__}"
            )
        seen = {self.token}
        for name, token in self.tenants.items():
            if not isinstance(name, str) or not 0 < len(name) <= 64:
                raise FrontendConfigError(f"a tenant's name must be 1 to 64 characters: {name!r}")
            if not isinstance(token, str) or len(token) < 16:
                raise FrontendConfigError(
                    f"tenant {name!r}: its token must be a str of at least 16 characters"
                )
            if token in seen:
                raise FrontendConfigError(f"tenant {name!r}: its token is another's too")
            seen.add(token)

    def credential(self, token: bytes) -> str | None:
        """Who a request's ``token`` says it is: a tenant's name (``tenant:NAME``), "" for
        the shared token or where none is needed, None for a token that is not valid."""
        for name, want in self.tenants.items():
            if hmac.compare_digest(token, want.encode()):
                return f"tenant:{name}"
        if self.token is not None:
            return "" if hmac.compare_digest(token, self.token.encode()) else None
        return None if self.tenants else ""


__all__ = ["FrontendConfig", "FrontendConfigError"]
