"""``tpcache keys``: a CURVE key pair for the events sockets, the secret into a new file
(never one already there), the public key on stdout."""

from __future__ import annotations

import argparse
import os
import sys


def add_keys_parser(sub) -> None:
    p = sub.add_parser(
        "keys", help="make a CURVE key pair: the secret into a new file, the public on stdout"
    )
    p.add_argument("secret_file", help="file to create (mode 0600) for the secret key")
    p.set_defaults(func=cmd_keys)


def cmd_keys(args: argparse.Namespace) -> int:
    from tpcache.transport.netsec import new_keypair

    public, secret = new_keypair()
    path = args.secret_file
    try:
        # O_EXCL: a key already there may be in use; it is never written over.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        what = "a directory" if os.path.isdir(path) else "a secret key is never written over"
        return _keys_fail(f"{path} exists already ({what}): name a new file")
    except OSError as exc:  # no such directory, not allowed there, a read-only disk, ...
        where = os.path.dirname(path)
        if isinstance(exc, FileNotFoundError) and where and not os.path.isdir(where):
            return _keys_fail(f"no directory {where} to create {path} in")
        return _keys_fail(f"cannot create {path!r}: {exc.strerror or exc}")
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    print(public)
    return 0


def _keys_fail(message: str) -> int:
    print(f"tpcache keys: {message}", file=sys.stderr)
    return 2
