"""Run the README's command blocks as written, in order, and say which passed.

    .venv/bin/python scripts/check_readme.py                   # in a fresh clone of HEAD
    .venv/bin/python scripts/check_readme.py --quick --dir .   # quick blocks, this tree

Which blocks run: ```sh and ```bash blocks, under `bash -e -o pipefail` (a failing line
fails the block), and ```python blocks, under the run directory's `.venv/bin/python`
reading the block on stdin (so the directory is on `sys.path`). Every block runs from
the root of the run directory. ```console and ```text blocks show output: not run.

A block's first lines may be comments that mark it (they are part of the README, so a
reader sees them too):

- `# needs a GPU`, `# needs several machines`: never run here; reported as skipped.
- `# takes minutes ...`: skipped by `--quick`.
- `# runs until Ctrl-C; ready once it prints "TEXT"`: started in the background; the
  next block runs once its output holds TEXT. At the end of its section (the next `## `
  heading) it gets Ctrl-C (SIGINT to its process group, as a terminal sends) and must
  end within 60 s.
- `# file: NAME` (python): written to NAME in the run directory, not run.

`--skip TEXT` skips the blocks that hold TEXT (e.g. the test suite on a shared
machine). The run directory is a fresh `git clone` of this repository (what is committed), or,
with `--quick --dir DIR`, a scratch directory of links to DIR's files, so files the
blocks write stay out of DIR. Ray's files go under the scratch directory (RAY_TMPDIR),
and RAY_ADDRESS and PYTHONPATH are dropped, as in a new shell. Exit status: 0 when no
block failed, 1 when one did, 2 for a README or options it cannot use.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

RUN = ("sh", "bash", "python")
SHOWN = ("console", "text", "")
SKIP_MARKS = {"# needs a GPU": "needs a GPU", "# needs several machines": "needs several machines"}
SLOW_MARK = "# takes minutes"
SERVICE = re.compile(r'^# runs until Ctrl-C; ready once it prints "([^"]+)"')
FILE = re.compile(r"^# file: ([\w./-]+)$")
FENCE = re.compile(r"^```([\w-]*)\s*$")
STOP_WAIT_S = 60.0


class ReadmeError(Exception):
    """A README block this script cannot run as marked (the message says where)."""


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    section: str  # the `## ` heading it is under
    skip: str | None = None  # why it never runs here
    slow: bool = False
    ready: str | None = None  # a background block: the text that says it is up
    file: str | None = None  # a file to write instead of running

    @property
    def kind(self) -> str:
        if self.skip:
            return f"skip ({self.skip})"
        if self.file:
            return f"file {self.file}"
        return ("background" if self.ready else "run") + (", takes minutes" if self.slow else "")


def parse(text: str) -> list[Block]:
    """The README's runnable blocks, in order. Raises ReadmeError for an unclosed fence
    or a marker that does not fit its block."""
    blocks: list[Block] = []
    section, fence, body = "", None, []
    for n, line in enumerate(text.splitlines(), start=1):
        if fence is None:
            if line.startswith("## "):
                section = line[3:].strip()
            elif m := FENCE.match(line):
                fence, body = (n, m.group(1)), []
            continue
        if line.rstrip() != "```":
            body.append(line)
            continue
        start, lang = fence
        fence = None
        if lang in RUN:
            blocks.append(_block(start, "sh" if lang == "bash" else lang, body, section))
        elif lang not in SHOWN:
            raise ReadmeError(f"README.md:{start}: a ```{lang} block: say sh, python or console")
    if fence is not None:
        raise ReadmeError(f"README.md:{fence[0]}: a block that is never closed")
    return blocks


def _block(line: int, lang: str, body: list[str], section: str) -> Block:
    code = "\n".join(body) + "\n"
    head = [
        ln.strip()
        for ln in body[: next((i for i, b in enumerate(body) if not b.startswith("#")), len(body))]
    ]
    skip = next((why for mark, why in SKIP_MARKS.items() for h in head if h.startswith(mark)), None)
    slow = any(h.startswith(SLOW_MARK) for h in head)
    ready = next((m.group(1) for h in head if (m := SERVICE.match(h))), None)
    file = next((m.group(1) for h in head if (m := FILE.match(h))), None)
    if any(h.startswith("# runs until Ctrl-C") for h in head) and ready is None:
        raise ReadmeError(
            f'README.md:{line}: say what it prints when ready: ready once it prints "..."'
        )
    if file is not None and (lang != "python" or ready or slow):
        raise ReadmeError(f"README.md:{line}: '# file:' marks a python block that only is a file")
    if file is not None and (file.startswith("/") or ".." in file.split("/")):
        raise ReadmeError(f"README.md:{line}: '# file: {file}' must stay in the run directory")
    return Block(line, lang, code, section, skip, slow, ready, file)


class Runner:
    """Runs blocks in ``root`` one after another; owns the background processes."""

    def __init__(
        self, root: Path, scratch: Path, timeout_s: float, quick: bool, skip: list[str]
    ) -> None:
        self.root, self.timeout_s, self.quick, self.skip = root, timeout_s, quick, skip
        self.env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
        self.env["RAY_TMPDIR"] = str(scratch / "ray")
        self.env["PYTHONUNBUFFERED"] = "1"
        self.logs = scratch / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.background: list[tuple[Block, subprocess.Popen, Path]] = []
        self.results: list[tuple[Block, str]] = []  # (block, "passed" | "failed" | "skipped")
        self.started = time.monotonic()

    def _argv(self, b: Block) -> list[str]:
        if b.lang == "python":
            return [str(self.root / ".venv" / "bin" / "python"), "-"]
        return ["bash", "-e", "-o", "pipefail", "-c", b.code]

    def _start(self, b: Block, log: Path) -> subprocess.Popen:
        with open(log, "wb") as out:
            return subprocess.Popen(
                self._argv(b),
                cwd=self.root,
                env=self.env,
                start_new_session=True,
                stdin=subprocess.PIPE if b.lang == "python" else subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def run(self, b: Block) -> bool:
        self._end_background(keep=b.section)
        where = f"README.md:{b.line} [{b.lang}] {b.section}"
        asked = next((text for text in self.skip if text in b.code), None)
        if b.skip or (self.quick and b.slow) or asked is not None:
            why = b.skip or ("takes minutes (--quick)" if asked is None else f"--skip {asked!r}")
            self.results.append((b, "skipped"))
            print(f"{where}: skipped, {why}", flush=True)
            return True
        if b.file:
            (self.root / b.file).write_text(b.code)
            self.results.append((b, "passed"))
            print(f"{where}: wrote {b.file}", flush=True)
            return True
        log = self.logs / f"block-{b.line}.log"
        t0 = time.monotonic()
        proc = self._start(b, log)
        if proc.stdin is not None:
            proc.stdin.write(b.code.encode())
            proc.stdin.close()
        limit = self.timeout_s * (6 if b.slow else 1)
        ok, why = self._wait_ready(b, proc, log, limit) if b.ready else self._wait_end(proc, limit)
        took = time.monotonic() - t0
        self.results.append((b, "passed" if ok else "failed"))
        print(f"{where}: {'ok' if ok else 'FAILED: ' + why} ({took:.1f} s)", flush=True)
        if not ok:
            tail = log.read_text(errors="replace").splitlines()[-40:]
            print("\n".join("    " + ln for ln in tail), flush=True)
            _kill(proc)
        elif b.ready:
            self.background.append((b, proc, log))
        return ok

    @staticmethod
    def _wait_end(proc: subprocess.Popen, limit: float) -> tuple[bool, str]:
        try:
            rc = proc.wait(limit)
        except subprocess.TimeoutExpired:
            return False, f"still running after {limit:.0f} s"
        finally:
            _kill(proc)  # anything it left in its process group
        return rc == 0, f"exit status {rc}"

    @staticmethod
    def _wait_ready(b: Block, proc: subprocess.Popen, log: Path, limit: float) -> tuple[bool, str]:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if b.ready in log.read_text(errors="replace"):  # type: ignore[operator]
                return True, ""
            if proc.poll() is not None:
                return False, f"ended (exit status {proc.returncode}) before printing {b.ready!r}"
            time.sleep(0.2)
        return False, f"did not print {b.ready!r} within {limit:.0f} s"

    def _end_background(self, keep: str | None) -> None:
        """Ctrl-C to every background block not of section ``keep``, newest first."""
        for b, proc, log in reversed([x for x in self.background if x[0].section != keep]):
            self.background.remove((b, proc, log))
            where = f"README.md:{b.line} [{b.lang}] {b.section}"
            if proc.poll() is not None:
                ok, how = proc.returncode == 0, f"had ended already (exit status {proc.returncode})"
            else:
                t0 = time.monotonic()
                with _quiet():
                    os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(STOP_WAIT_S)
                    ok, how = True, f"ended on Ctrl-C ({time.monotonic() - t0:.1f} s)"
                except subprocess.TimeoutExpired:
                    ok, how = False, f"did not end within {STOP_WAIT_S:.0f} s of Ctrl-C"
            _kill(proc)
            print(f"{where}: {how}", flush=True)
            if not ok:
                print(
                    "\n".join(
                        "    " + ln for ln in log.read_text(errors="replace").splitlines()[-40:]
                    )
                )
                self.results.append((b, "failed"))

    def finish(self) -> int:
        self._end_background(keep=None)
        counts = {s: sum(r == s for _, r in self.results) for s in ("passed", "failed", "skipped")}
        print(
            f"check_readme: {len(self.results)} results: {counts['passed']} passed, "
            f"{counts['failed']} failed, {counts['skipped']} skipped "
            f"({time.monotonic() - self.started:.1f} s)",
            flush=True,
        )
        return 1 if counts["failed"] else 0


def _quiet() -> contextlib.suppress:
    """Ignore a process (group) that is gone already."""
    return contextlib.suppress(ProcessLookupError, PermissionError)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL what is left in the block's process group (it is the group's leader)."""
    with _quiet():
        os.killpg(proc.pid, signal.SIGKILL)
    with _quiet():
        proc.wait(10)


def _run_dir(args: argparse.Namespace, scratch: Path) -> Path:
    if args.dir is not None:  # links to the tree's files; what blocks write stays here
        root = scratch / "tree"
        root.mkdir()
        for entry in Path(args.dir).resolve().iterdir():
            if entry.name != ".git":
                (root / entry.name).symlink_to(entry)
        return root
    source = Path(__file__).resolve().parents[1]
    root = scratch / "clone"
    subprocess.run(["git", "clone", "-q", str(source), str(root)], check=True)
    return root


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="skip the blocks marked '# takes minutes'")
    p.add_argument("--dir", type=Path, help="with --quick: run against this tree, not a clone")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per block (x6 if slow)")
    p.add_argument(
        "--skip", action="append", default=[], metavar="TEXT", help="skip blocks holding TEXT"
    )
    p.add_argument("--list", action="store_true", help="list the blocks and what each is; run none")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = p.parse_args(argv)
    # A process started in the background of a script inherits SIGINT ignored, and so
    # would every block (an ignored signal stays ignored across exec): then Ctrl-C would
    # not reach them. A handler is reset to the default across exec, so blocks get it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.dir is not None and not args.quick:
        p.error("--dir needs --quick: a full run (setup included) goes in a fresh clone")
    if args.dir is not None and not (args.dir / "README.md").is_file():
        p.error(f"--dir {args.dir}: no README.md there")
    scratch = Path(tempfile.mkdtemp(prefix="rdme", dir="/tmp"))  # short: socket paths
    try:
        root = _run_dir(args, scratch)
        try:
            blocks = parse((root / "README.md").read_text(encoding="utf-8"))
        except ReadmeError as exc:
            print(f"check_readme: {exc}", file=sys.stderr)
            return 2
        if args.list:
            for b in blocks:
                print(f"README.md:{b.line} [{b.lang}] {b.section}: {b.kind}")
            return 0
        print(f"check_readme: {len(blocks)} blocks, in {root}", flush=True)
        runner = Runner(root, scratch, args.timeout, args.quick, args.skip)
        try:
            for b in blocks:
                runner.run(b)
        finally:
            status = runner.finish()
        return status
    finally:
        if args.keep:
            print(f"check_readme: kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
