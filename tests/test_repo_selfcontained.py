"""The repository stands alone: a clone with nothing beside it runs its commands, scripts
and tests. No file reaches for a path outside it, the files the README names are in it,
and the default trace of the commands is the one it ships."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()
# The ways the trace and the design were reached outside the repository: an absolute
# path, a path from the checkout to the folder beside it, a Path built up to that folder.
OUTSIDE = re.compile(r'/work/shared|\.\./shared|/ "shared"')
SCANNED = ("README.md", "pyproject.toml", "docs", "scripts", "tests", "tpcache", "results")
# Text that is run or read as instructions. results/*.json are records of past runs (the
# path a run read its trace from), not something a user runs.
SUFFIXES = {".py", ".md", ".sh", ".toml", ".txt", ".cfg", ".ini", ".yaml", ".yml"}


def _text_files() -> list[Path]:
    files: list[Path] = []
    for name in SCANNED:
        root = REPO / name
        for path in [root] if root.is_file() else root.rglob("*"):
            if path.suffix in SUFFIXES and "__pycache__" not in path.parts and path != THIS:
                files.append(path)
    return sorted(files)


def test_the_pattern_catches_each_old_way_out() -> None:
    for old in (
        # Joined here so that this file holds no absolute path of one machine itself.
        'Path("/' + 'work/shared/traces/mooncake_conversation.jsonl")',
        "tpcache replay ../shared/traces/mooncake_conversation.jsonl",
        'Path(__file__).resolve().parents[2] / "shared" / "traces"',
    ):
        assert OUTSIDE.search(old), old
    assert not OUTSIDE.search(
        "shared prefix; shared_memory; tpcache/data/mooncake_conversation.jsonl.gz"
    )


def test_no_file_reaches_outside_the_repository() -> None:
    files = _text_files()
    # not vacuous: the files that used to reach out are among those read
    for name in ("README.md", "tpcache/cli/replay.py", "scripts/sweep.py", "tests/test_trace.py"):
        assert REPO / name in files
    hits = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in files
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if OUTSIDE.search(line)
    ]
    assert hits == []


def test_the_files_the_readme_names_are_in_the_repository() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    named = set(
        re.findall(r"(?<![\w./-])((?:data|docs|results|scripts|tests|tpcache)/[\w./-]*\.\w+)", text)
    )
    assert "docs/DESIGN.md" in named
    assert sorted(name for name in named if not (REPO / name).is_file()) == []


def test_the_design_document_is_in_the_repository() -> None:
    text = (REPO / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    for part in ("## Layout", "## The cache state machine", "## Lockstep across ranks"):
        assert any(h.startswith(part) for h in headings), part
    assert "## KV events (`events/`)" in headings


def test_the_trace_ships_with_its_source_and_license() -> None:
    readme = (REPO / "tpcache" / "data" / "README.md").read_text(encoding="utf-8")
    notice = (REPO / "tpcache" / "data" / "LICENSE-mooncake-trace").read_text(encoding="utf-8")
    assert "kvcache-ai/Mooncake" in readme and "FAST25-release/traces/" in readme
    assert "Apache-2.0" in readme
    assert "Apache License, Version 2.0" in notice and "the Mooncake authors" in notice
    assert "https://www.apache.org/licenses/LICENSE-2.0" in notice


@pytest.mark.skipif(
    shutil.which("git") is None or not (REPO / ".git").exists(), reason="not a git checkout"
)
def test_git_tracks_the_data_and_the_docs() -> None:
    # An ignore rule over tpcache/data/ would keep the trace out of every clone.
    for name in (
        "tpcache/data/mooncake_conversation.jsonl.gz",
        "tpcache/data/README.md",
        "docs/DESIGN.md",
    ):
        done = subprocess.run(
            ["git", "ls-files", "--error-unmatch", name], cwd=REPO, capture_output=True
        )
        assert done.returncode == 0, f"{name} is not tracked: {done.stderr.decode()}"


def test_replay_with_no_trace_argument_replays_the_shipped_trace(tmp_path: Path) -> None:
    # From another folder, so nothing depends on the working directory. Stderr is a pipe,
    # not a terminal, and the run is short: no progress lines, and stdout is the JSON alone.
    done = subprocess.run(
        [sys.executable, "-m", "tpcache", "replay", "--limit", "50", "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stderr) == (0, "")
    out = json.loads(done.stdout)
    # the first 50 requests of the conversation trace, at infinite capacity, page 16
    assert (out["requests"], out["prompt_tokens"], out["matched_tokens"]) == (50, 601_420, 25_088)
