"""Errors the driver raises to its callers. Here, not with the API records
(``frontend/api.py``, which names them on the wire), so the driver never imports the
frontend that is built on it."""

from tpcache.errors import TpcacheError


class CoordinatorUnavailable(TpcacheError, RuntimeError):
    """The coordinator cannot take work now (ranks failed, recovering); retry later."""

    retryable = True


class CoordinatorConfigError(TpcacheError, ValueError):
    """A field of ``CoordinatorConfig`` (or a value it is derived from) is invalid; the
    message names it. Raised before anything starts."""


class GroupConfigError(TpcacheError, ValueError):
    """A field of ``GroupConfig`` (or a rank number given to a group) is invalid; the
    message names it. Raised before anything starts."""


class PlacementError(TpcacheError, RuntimeError):
    """Ray could not place the group's ranks (a strategy or resources the cluster cannot
    meet) within the start-up timeout."""


class RequestLost(TpcacheError, RuntimeError):
    """The request was running when the group failed or the coordinator restarted; its
    KV is gone. Retry it as a new request."""

    retryable = True
