"""``Closing``: the ``with`` statement for every class that has a ``close()``.

A leaf, like ``errors.py``: it imports nothing of tpcache, so any package may use it.
"""

from __future__ import annotations

from typing import Self


class Closing:
    """A base for a class whose ``close()`` releases what it holds: ``with obj:`` gives
    ``obj`` and calls ``obj.close()`` on the way out, whether or not the block raised
    (and lets what it raised through)."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
