"""``TpcacheError``: the root of every exception tpcache raises, so a caller can catch
"any tpcache error" in one clause.

A leaf: it imports nothing, so every package (``cache`` included, which imports nothing
else of tpcache) and the torch-free client may import it. Each subclass keeps the
builtin base its callers already catch (``UnknownRequest`` is a ``KeyError`` too, an
invalid input a ``ValueError``).
"""

from __future__ import annotations

from typing import Any


class TpcacheError(Exception):
    """Any error raised by tpcache.

    Pickles whole (through Ray, the step channel, a process pool): as its class, its
    ``args`` and its attributes, without calling the constructor again. Python's own
    way calls ``cls(*args)``, which fails for a subclass whose constructor takes other
    arguments than the message it passes on (``RankCallError(rank, cause)``): such an
    error used to arrive as a pickling failure instead of itself."""

    def __reduce__(self) -> tuple[Any, ...]:
        custom = (c for c in type(self).__mro__ if issubclass(c, TpcacheError))
        if not any("__init__" in vars(c) for c in custom):
            # The builtin way works (and a builtin base such as OSError must make the
            # object itself: ``_rebuild``'s ``__new__`` would not be allowed there).
            return super().__reduce__()
        return _rebuild, (type(self), self.args, dict(self.__dict__))


def _rebuild(cls: type[TpcacheError], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc
