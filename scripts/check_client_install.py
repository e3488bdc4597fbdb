"""The client install, checked as a router host would meet it: a fresh venv holding only
pip gets ``pip install`` of this checkout (no extra), and must hold neither torch nor Ray;
from that venv's python, the network client reaches a group served by this checkout's
venv (``tpcache serve --runner ... --network-endpoint ...``: TP=2 with the reference
model) and gets real answers: a cold admit, a cache hit on the same prompt, a generate.

    .venv/bin/python scripts/check_client_install.py [--json] [--keep]

Also checked in the client venv: ``tpcache --version``; ``tpcache replay`` on the trace
shipped as package data; ``tpcache serve`` and ``tpcache.connect`` refused in one line
naming the server extra. Prints each phase's seconds (the install's is what a user
waits for) and exits 1 with the reason if anything is not as it should be. Needs a
package index (PyPI or a mirror pip is configured with) for the client's three
dependencies and the build backend. Not imported by the package.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SERVER_DISTS = ("torch", "ray", "safetensors", "tokenizers", "prometheus-client")
MODEL = ("vocab=64", "hidden=32", "heads=4", "head_dim=8", "ffn=64")

# Run by the client venv's python: the calls a router makes, and what it imported.
CLIENT = """
import json, sys, time
from tpcache.client import NetworkClient
t0 = time.perf_counter()
with NetworkClient(sys.argv[1], timeout_s=120) as c:
    prompt = list(range(1, 33))
    cold = c.admit("a", prompt)
    done = c.finish("a", [40, 41])
    warm = c.admit("b", prompt)
    c.finish("b")
    gen = c.generate(prompt, 8, ignore_eos=True)
print(json.dumps({
    "cold_prefix": cold.prefix_len, "warm_prefix": warm.prefix_len,
    "finish_reply": type(done).__name__, "cached_after_finish": done.cached_tokens,
    "generated": len(gen.tokens), "generate_cached": gen.cached_tokens,
    "imported_torch": "torch" in sys.modules, "imported_ray": "ray" in sys.modules,
    "calls_s": round(time.perf_counter() - t0, 3),
}))
"""


class CheckFailed(Exception):
    """One of the checks did not hold; the message says which and what was seen."""


def run(cmd: list[str], timeout: float = 600, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def expect(ok: bool, what: str, seen: object) -> None:
    if not ok:
        raise CheckFailed(f"{what}; got: {str(seen)[-2000:]}")


def timed(times: dict[str, float], name: str, t0: float) -> None:
    times[name] = round(time.monotonic() - t0, 1)


def make_client_venv(root: Path, times: dict[str, float]) -> Path:
    """A venv holding only pip, with this checkout installed into it (no extra)."""
    t0 = time.monotonic()
    venv = root / "client-venv"
    done = run([sys.executable, "-m", "venv", str(venv)])
    expect(done.returncode == 0, "python -m venv failed", done.stderr)
    py = venv / "bin" / "python"
    pip = [str(py), "-m", "pip", "--disable-pip-version-check"]
    run([*pip, "uninstall", "-y", "-q", "setuptools"])  # 3.11's venv brings it: only pip
    expect(_listed(pip) == {"pip"}, "the new venv should hold pip alone", _listed(pip))
    timed(times, "venv_s", t0)
    # Built from a copy: the build writes build/ and *.egg-info next to its sources.
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    shutil.copytree(REPO / "tpcache", src / "tpcache", ignore=skip)
    t0 = time.monotonic()
    done = run([*pip, "install", "-q", str(src)], timeout=900)
    expect(done.returncode == 0, "pip install of the checkout failed", done.stderr)
    timed(times, "install_s", t0)
    have = _listed(pip)
    expect({"tpcache", "numpy", "msgspec", "pyzmq"} <= have, "the client's packages", have)
    extra = sorted(have & set(SERVER_DISTS))
    expect(not extra, "the plain install must not bring the server extra", extra)
    return py


def _listed(pip: list[str]) -> set[str]:
    done = run([*pip, "list", "--format", "json"])
    return {p["name"].lower().replace("_", "-") for p in json.loads(done.stdout or "[]")}


def check_client_commands(py: Path, root: Path) -> dict[str, Any]:
    """What a router host's install does alone: version, replay on the shipped trace,
    and the server's commands refused in one line."""
    cli = [str(py), "-m", "tpcache"]
    from tpcache import __version__

    got = run([*cli, "--version"])
    expect(got.stdout.strip() == f"tpcache {__version__}", "tpcache --version", got)
    got = run([*cli, "replay", "--limit", "50", "--json"], cwd=root)
    expect(got.returncode == 0, "tpcache replay on the installed trace", got.stderr)
    replayed = json.loads(got.stdout)
    expect(replayed["requests"] == 50, "replay read 50 requests", replayed)
    got = run([*cli, "serve"])
    said = got.stderr.strip()
    expect(
        got.returncode == 2 and "\n" not in said and "pip install 'tpcache[server]'" in said,
        "tpcache serve on the client install: one line naming the server extra",
        got.stderr,
    )
    probe = "import tpcache\ntry:\n    tpcache.connect\nexcept ImportError as e:\n    print(e)"
    got = run([str(py), "-c", probe])
    expect("tpcache[server]" in got.stdout, "tpcache.connect names the server extra", got)
    return {"version": __version__, "serve_refusal": said}


@contextlib.contextmanager
def served_group(root: Path, times: dict[str, float]) -> Any:
    """``tpcache serve`` from this venv, its own Ray cluster under ``root``; yields the
    network endpoint. Stopped, and every process under ``root`` ended, on exit."""
    endpoint = f"ipc://{root}/net.sock"
    ns = f"client-check-{os.getpid()}"
    cmd = [sys.executable, "-m", "tpcache", "serve", "--tp", "2", "--capacity", "512"]
    cmd += ["--page-size", "4", "--name", "check", "--namespace", ns]
    cmd += ["--runner", "tpcache.model.reference:ReferenceRunner"]
    for arg in MODEL:
        cmd += ["--runner-arg", arg]
    cmd += ["--network-endpoint", endpoint]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(root), RAY_TMPDIR=str(root / "ray"), RAY_USAGE_STATS_ENABLED="0")
    out = root / "serve.out"
    t0 = time.monotonic()
    with open(out, "w") as f:
        proc = subprocess.Popen(
            cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    address = ""
    try:
        while "network frontend on" not in (text := out.read_text()):
            expect(proc.poll() is None, "tpcache serve exited before serving", text)
            expect(time.monotonic() - t0 < 300, "tpcache serve did not start in 300 s", text)
            time.sleep(0.5)
        timed(times, "serve_start_s", t0)
        address = text.split("address='", 1)[1].split("'", 1)[0]
        yield endpoint
    finally:
        if address and proc.poll() is None:
            stop = [sys.executable, "-m", "tpcache", "stop", "--name", "check"]
            run([*stop, "--namespace", ns, "--address", address], timeout=120, env=env)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(60)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _end_marked(str(root))


def _end_marked(marker: str) -> None:
    """Kill what is left whose command line names ``marker`` (Ray's processes under it)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                os.kill(int(entry.name), signal.SIGKILL)


def check(keep: bool) -> dict[str, Any]:
    """Every check in order; the figures and answers seen. Raises ``CheckFailed``."""
    root = Path(tempfile.mkdtemp(prefix="tpci", dir="/tmp"))  # short: socket paths
    times: dict[str, float] = {}
    t0 = time.monotonic()
    try:
        py = make_client_venv(root, times)
        said = check_client_commands(py, root)
        with served_group(root, times) as endpoint:
            got = run([str(py), "-c", CLIENT, endpoint], timeout=300)
        expect(got.returncode == 0, "the client's calls failed", got.stderr)
        answers = json.loads(got.stdout)
        expect(answers["cold_prefix"] == 0 and answers["warm_prefix"] > 0, "a hit", answers)
        expect(answers["generated"] == 8, "8 generated tokens", answers)
        expect(not (answers["imported_torch"] or answers["imported_ray"]), "no torch", answers)
        timed(times, "total_s", t0)
        return {"times": times, "answers": answers, **said, "root": str(root) if keep else None}
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (the client venv)")
    args = ap.parse_args()
    try:
        got = check(args.keep)
    except (CheckFailed, subprocess.TimeoutExpired) as exc:
        print(f"check_client_install: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(got))
        return 0
    t = got["times"]
    a = got["answers"]
    print(f"client venv (pip only) in {t['venv_s']} s; `pip install .` in {t['install_s']} s")
    print("  holds numpy, msgspec, pyzmq and tpcache; no torch, no Ray")
    print(f"  `tpcache serve` there says: {got['serve_refusal']}")
    print(f"served group (TP=2, reference model) up in {t['serve_start_s']} s")
    print(
        f"client calls in {a['calls_s']} s: admit cold prefix {a['cold_prefix']}, warm "
        f"{a['warm_prefix']}; generate {a['generated']} tokens ({a['generate_cached']} cached)"
    )
    print(f"total {t['total_s']} s")
    if got["root"]:
        print(f"kept: {got['root']} (the client venv is client-venv/ there)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
