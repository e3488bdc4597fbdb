"""The README's command blocks run as written (scripts/check_readme.py): how the script
reads blocks and their markers, what it does with a block that fails, hangs or runs in
the background, and the README's own quick blocks against this tree."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "check_readme.py"


def _load():
    spec = importlib.util.spec_from_file_location("check_readme", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_readme"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


cr = _load()


def check(
    *args: str, timeout: float = 120, ignore_sigint: bool = False
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        # as a script's background job starts it: SIGINT ignored, inherited across exec
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        if ignore_sigint
        else None,
    )


SAMPLE = """# title

```sh
echo before any section
```

## One

```sh
# takes minutes: a long setup
sleep 1
```

```python
# file: mod.py
X = 1
```

```console
$ not run
```

## Two

```sh
# runs until Ctrl-C; ready once it prints "up"
echo up
```

```bash
# needs a GPU
nvidia-smi
```

```python
import mod
```
"""


def test_blocks_their_sections_and_markers_are_read_in_order() -> None:
    got = [(b.line, b.lang, b.section, b.kind) for b in cr.parse(SAMPLE)]
    assert got == [
        (3, "sh", "", "run"),
        (9, "sh", "One", "run, takes minutes"),
        (14, "python", "One", "file mod.py"),
        (25, "sh", "Two", "background"),
        (30, "sh", "Two", "skip (needs a GPU)"),
        (35, "python", "Two", "run"),
    ]
    blocks = cr.parse(SAMPLE)
    assert blocks[3].ready == "up" and blocks[2].code == "# file: mod.py\nX = 1\n"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("## A\n\n```sh\necho never closed\n", "README.md:3: a block that is never closed"),
        ("```js\nx\n```\n", "README.md:1: a ```js block: say sh, python or console"),
        ("```sh\n# runs until Ctrl-C\nserve\n```\n", "README.md:1: say what it prints when ready"),
        ("```sh\n# file: a.sh\necho\n```\n", "README.md:1: '# file:' marks a python block"),
        ("```python\n# file: ../a.py\n```\n", "'# file: ../a.py' must stay in the run directory"),
        ("```python\n# file: /tmp/a.py\n```\n", "'# file: /tmp/a.py' must stay in the run"),
    ],
)
def test_a_block_it_cannot_run_as_marked_is_refused_by_line(text: str, says: str) -> None:
    with pytest.raises(cr.ReadmeError) as err:
        cr.parse(text)
    assert says in str(err.value)


def test_options_it_cannot_use_are_one_line_errors(tmp_path: Path) -> None:
    got = check("--dir", str(REPO))
    assert got.returncode == 2
    assert (
        got.stderr.strip()
        .splitlines()[-1]
        .endswith("--dir needs --quick: a full run (setup included) goes in a fresh clone")
    )
    got = check("--quick", "--dir", str(tmp_path))
    assert got.returncode == 2
    assert got.stderr.strip().splitlines()[-1].endswith(f"--dir {tmp_path}: no README.md there")
    (tmp_path / "README.md").write_text("```sh\nnever closed\n")
    got = check("--quick", "--dir", str(tmp_path))
    assert (got.returncode, got.stderr) == (
        2,
        "check_readme: README.md:1: a block that is never closed\n",
    )


RUN = """## Serve

```sh
# runs until Ctrl-C; ready once it prints "serving"
trap 'echo stopped > interrupted; exit 0' INT
echo serving
while true; do sleep 0.1; done
```

```python
# file: helper.py
ANSWER = 42
```

```python
import helper
assert helper.ANSWER == 42
print("python ok")
```

## After

```sh
test "$(cat interrupted)" = stopped
test -z "${RAY_ADDRESS:-}" && test -z "${PYTHONPATH:-}"
```

```sh
# takes minutes
exit 9
```

```sh
echo about to fail; exit 3
```

```sh
exit 4
```

```sh
sleep 30
```
"""


def test_a_run_reports_each_block_and_fails_when_one_does(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text(RUN)
    (tmp_path / ".venv").symlink_to(REPO / ".venv")
    env_before = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = "127.0.0.1:1"  # dropped for the blocks, as in a new shell
    try:
        got = check(
            "--quick",
            "--dir",
            str(tmp_path),
            "--timeout",
            "3",
            "--skip",
            "exit 4",
            ignore_sigint=True,  # the blocks get Ctrl-C all the same
        )
    finally:
        if env_before is None:
            os.environ.pop("RAY_ADDRESS")
        else:
            os.environ["RAY_ADDRESS"] = env_before
    lines = [ln for ln in got.stdout.splitlines() if ln.startswith(("README", "check_readme:"))]
    assert got.returncode == 1, got.stdout + got.stderr
    assert [ln.rsplit(" (", 1)[0] if "s)" in ln else ln for ln in lines[1:]] == [
        "README.md:3 [sh] Serve: ok",
        "README.md:10 [python] Serve: wrote helper.py",
        "README.md:15 [python] Serve: ok",
        "README.md:3 [sh] Serve: ended on Ctrl-C",
        "README.md:23 [sh] After: ok",
        "README.md:28 [sh] After: skipped, takes minutes (--quick)",
        "README.md:33 [sh] After: FAILED: exit status 3",
        "README.md:37 [sh] After: skipped, --skip 'exit 4'",
        "README.md:41 [sh] After: FAILED: still running after 3 s",
        "check_readme: 8 results: 4 passed, 2 failed, 2 skipped",
    ]
    assert "    about to fail" in got.stdout  # a failed block's output is shown
    assert not (tmp_path / "helper.py").exists()  # files the blocks write stay out of the tree


def test_the_readme_has_the_two_commands_and_a_runnable_block_per_role() -> None:
    blocks = cr.parse((REPO / "README.md").read_text(encoding="utf-8"))
    first, second = (b for b in blocks if b.section == "The two commands")
    assert first.code.splitlines()[-1] == "bash scripts/setup.sh && .venv/bin/tpcache demo --tp 2"
    assert second.code.splitlines()[-1] == "bash scripts/test.sh"
    assert "bash scripts/test.sh" in (REPO / ".ci" / "run").read_text()
    for role in (
        "Serve a model and generate",
        "Run your engine's own model",
        "Route with KV events and metrics",
        "Operate a cluster",
        "Test with torchrun",
    ):
        assert any(b.section == role and b.kind == "run" for b in blocks), role
    assert {b.skip for b in blocks if b.skip} == {"needs a GPU", "needs several machines"}


def test_the_readme_quick_blocks_pass_against_this_tree() -> None:
    """Every block that needs no long setup, as written (each role's servers, clients,
    runner, router, a Ray head of its own, torchrun); a minute or two on two cores."""
    got = check("--quick", "--dir", str(REPO), timeout=900)
    print(got.stdout[-6000:])
    assert got.returncode == 0, got.stdout[-6000:] + got.stderr[-3000:]
    summary = got.stdout.strip().splitlines()[-1]
    assert summary.startswith("check_readme: ") and " 0 failed" in summary


@pytest.mark.slow
def test_the_whole_readme_passes_in_a_fresh_clone() -> None:
    """Setup, the test suite and every block, in a fresh clone of what is committed."""
    got = check(timeout=3 * 3600)
    print(got.stdout[-10000:])
    assert got.returncode == 0, got.stdout[-10000:] + got.stderr[-3000:]


TINY = REPO / "scripts" / "tiny_model.py"


def tiny(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TINY), *args], capture_output=True, text=True, timeout=120
    )


def test_tiny_model_writes_a_checkpoint_the_strict_reader_takes_and_rewrites_only_its_own(
    tmp_path: Path,
) -> None:
    from tpcache.model.hf_config import read_hf_config

    out = tmp_path / "tiny"
    got = tiny(str(out), "--vocab", "300", "--seed", "3")
    assert got.returncode == 0, got.stderr
    assert got.stdout == f"a random Llama (vocab 300, seed 3) in {out}\n"
    cfg = read_hf_config(out)
    assert (cfg.model_type, cfg.vocab, cfg.hidden, cfg.num_layers) == ("llama", 300, 64, 2)
    assert (cfg.heads, cfg.kv_heads, cfg.head_dim) == (4, 2, 16)
    weights = (out / "model.safetensors").read_bytes()
    assert tiny(str(out), "--vocab", "300", "--seed", "3").returncode == 0  # its own: rewritten
    assert (out / "model.safetensors").read_bytes() == weights  # seeded: the same weights


def test_tiny_model_refuses_a_real_checkpoint_and_a_bad_vocab_before_writing(
    tmp_path: Path,
) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (real / "config.json").write_text('{"model_type": "llama"}')
    got = tiny(str(real))
    assert got.returncode == 2
    assert got.stderr == f"tiny_model: {real} already holds a checkpoint; give a new directory\n"
    assert sorted(p.name for p in real.iterdir()) == ["config.json"]
    got = tiny(str(tmp_path / "new"), "--vocab", "1")
    assert got.returncode == 2 and got.stderr.strip().endswith("--vocab must be >= 2, got 1")
    assert not (tmp_path / "new").exists()
