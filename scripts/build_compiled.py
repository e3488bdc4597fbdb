"""A copy of the repository with the cache (and, with ``--step-path``, the step path's
hot modules) compiled by Cython, for measuring what compiling would buy. Not part of
the package, and nothing imports it: the project runs as plain Python.

The modules are compiled as they are, with Python's semantics (``annotation_typing``
off: an annotation does not change what a function accepts), so the copy must pass the
same tests. It is built out of the tree, in ``OUT`` (``OUT/tpcache``, ``OUT/scripts``,
``OUT/tests``, ``OUT/data``), and run by putting ``OUT`` first on ``PYTHONPATH``; Ray
workers started from there inherit it.

    .venv/bin/pip install cython setuptools
    .venv/bin/python scripts/build_compiled.py /tmp/tpcache-compiled [--step-path]
    cd /tmp/tpcache-compiled && PYTHONPATH=$PWD /work/main/.venv/bin/python \
        scripts/bench_lockstep.py --tp 2 --batch 8 --no-evict --rounds 1

About two minutes on 2 cores for the cache (42 modules), one more with ``--step-path``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Modules the step path runs per step outside the cache (no Ray actor class among them:
# Ray pickles an actor's class, which a compiled module's functions complicate).
STEP_PATH = [
    "tpcache/" + m + ".py"
    for m in (
        "workers/protocol",
        "workers/copysync",
        "lockstep/oplog",
        "lockstep/ops",
        "transport/channel_loop",
        "transport/unix_link",
        "transport/frames",
        "transport/channel",
    )
] + [
    "tpcache/coordinator/" + m + ".py"
    for m in ("steps", "core", "step_path", "step_check", "step_types", "lost")
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path, help="where the compiled copy goes (replaced)")
    ap.add_argument("--step-path", action="store_true", help="compile the step path too")
    args = ap.parse_args()
    try:
        from Cython.Build import cythonize
        from setuptools import setup
    except ImportError:
        sys.exit("needs Cython and setuptools: .venv/bin/pip install cython setuptools")
    out: Path = args.out.resolve()
    if out == REPO or REPO in out.parents:
        sys.exit(f"{out} is inside the repository: build the copy elsewhere")
    if out.exists():
        shutil.rmtree(out)
    for part in ("tpcache", "scripts", "tests"):
        shutil.copytree(REPO / part, out / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", out / "pyproject.toml")
    modules = sorted(
        str(p.relative_to(out))
        for p in (out / "tpcache" / "cache").glob("*.py")
        if p.name != "__init__.py"
    )
    if args.step_path:
        modules += STEP_PATH
    directives = {"language_level": 3, "binding": True, "annotation_typing": False}
    # In the copy: build_ext --inplace puts each module next to its source, from the cwd.
    os.chdir(out)
    setup(
        name="tpcache-compiled",
        ext_modules=cythonize(modules, compiler_directives=directives, nthreads=2, quiet=True),
        script_args=["build_ext", "--inplace", "--build-temp", ".build"],
    )
    print(f"compiled {len(modules)} modules into {out}")


if __name__ == "__main__":
    main()
