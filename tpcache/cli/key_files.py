"""Reading secrets the command line names by path (CURVE keys, tokens), so they never
appear in a process's arguments."""

from __future__ import annotations


def read_key(path: str | None) -> str | None:
    """A CURVE key or a token kept in a file (its first line)."""
    if path is None:
        return None
    with open(path) as f:
        return f.readline().strip()


def read_keys(path: str | None) -> tuple[str, ...]:
    """CURVE public keys, one per line (blank lines and # comments skipped)."""
    if path is None:
        return ()
    with open(path) as f:
        lines = (line.split("#", 1)[0].strip() for line in f)
        return tuple(line for line in lines if line)
