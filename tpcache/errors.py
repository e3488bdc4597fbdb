"""``TpcacheError``: the root of every exception tpcache raises, so a caller can catch
"any tpcache error" in one clause.

A leaf: it imports nothing, so every package (``cache`` included, which imports nothing
else of tpcache) and the torch-free client may import it. Each subclass keeps the
builtin base its callers already catch (``UnknownRequest`` is a ``KeyError`` too, an
invalid input a ``ValueError``).
"""


class TpcacheError(Exception):
    """Any error raised by tpcache."""
