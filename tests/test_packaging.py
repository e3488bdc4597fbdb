"""What an install holds and what each role can run: the plain install's dependencies
(the client's three) against the server extra's (and ``tpcache.install``'s list of them),
the wheel's files (py.typed, the trace as package data, the license) and metadata, one
version everywhere, and the one-line refusal of a server command where torch and Ray
cannot be imported (blocked in a subprocess; ``scripts/check_client_install.py``, run by
the slow test below, checks the same in a real venv without them)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

import tpcache
from tpcache.errors import TpcacheError
from tpcache.install import SERVER_MODULES, MissingExtra, missing_server_modules, require_server

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
SERVER_COMMANDS = ("demo", "generate", "serve", "stop")
EXTRA = "pip install 'tpcache[server]'"

# Runs the CLI with the server extra's modules made unimportable (as on a client host):
# a module set to None in sys.modules raises ImportError on import.
BLOCKED = (
    "import sys\n"
    f"for name in {SERVER_MODULES!r}:\n"
    "    sys.modules[name] = None\n"
    "from tpcache.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def _names(specs: list[str]) -> list[str]:
    """Distribution names of requirement strings, normalised (``prometheus-client``)."""
    out = []
    for spec in specs:
        name = spec.split(";")[0].split("[")[0]
        for op in "<>=!~ ":
            name = name.split(op)[0]
        out.append(name.lower().replace("_", "-"))
    return out


def blocked_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCKED, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def test_the_plain_install_is_the_client_and_the_server_extra_adds_torch_and_ray() -> None:
    project = PYPROJECT["project"]
    assert _names(project["dependencies"]) == ["numpy", "msgspec", "pyzmq"]
    server = _names(project["optional-dependencies"]["server"])
    assert server == [m.replace("_", "-") for m in SERVER_MODULES]
    assert "torch" not in _names(project["optional-dependencies"]["dev"])
    assert project["license"] == "Apache-2.0" and "LICENSE" in project["license-files"]
    assert project["dynamic"] == ["version"]  # read from tpcache.__version__ alone
    assert "version" not in project


def test_the_license_is_apache_2() -> None:
    text = (REPO / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_this_venv_has_the_server_extra_and_require_server_passes() -> None:
    assert missing_server_modules() == []
    require_server("tpcache serve")  # raises nothing


def test_tpcache_version_prints_the_one_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tpcache", "--version"], capture_output=True, text=True
    )
    assert (done.returncode, done.stdout, done.stderr) == (
        0,
        f"tpcache {tpcache.__version__}\n",
        "",
    )
    assert tpcache.__version__.count(".") == 2


@pytest.mark.parametrize("command", SERVER_COMMANDS)
def test_a_server_command_without_the_server_extra_is_one_line(command: str) -> None:
    done = blocked_cli(command)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        f"tpcache {command} needs the server extra, which this install lacks (torch, ray, "
        f"safetensors, tokenizers, prometheus_client not installed): {EXTRA}\n"
    )


def test_the_client_commands_run_without_the_server_extra(tmp_path: Path) -> None:
    # replay reads the packaged trace; keys makes a CURVE pair; every command parses.
    done = blocked_cli("replay", "--limit", "20", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["requests"] == 20
    done = blocked_cli("keys", str(tmp_path / "k"))
    assert done.returncode == 0, done.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["k"]
    assert len(done.stdout.strip()) == 40  # the public key, Z85
    for command in ("events", "replay", "keys", *SERVER_COMMANDS):
        done = blocked_cli(command, "--help")
        assert done.returncode == 0 and "usage: tpcache" in done.stdout, (command, done.stderr)


def test_the_ray_client_without_the_server_extra_names_it_and_the_network_client_imports() -> None:
    code = (
        "import sys\n"
        f"for name in {SERVER_MODULES!r}:\n"
        "    sys.modules[name] = None\n"
        "import tpcache\n"
        "from tpcache.install import MissingExtra\n"
        "print(tpcache.NetworkClient.__module__)\n"
        "for name in ('RayClient', 'connect'):\n"
        "    try:\n"
        "        getattr(tpcache, name)\n"
        "    except MissingExtra as exc:\n"
        "        print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "tpcache.client"
    assert lines[1].startswith("tpcache.RayClient needs the server extra") and EXTRA in lines[1]
    assert lines[2].startswith("tpcache.connect needs the server extra")


def test_missing_extra_is_a_tpcache_error_and_an_import_error() -> None:
    assert issubclass(MissingExtra, TpcacheError) and issubclass(MissingExtra, ImportError)
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from tpcache.install import missing_server_modules, require_server\n"
        "print(missing_server_modules())\n"
        "require_server('x')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout == "['ray']\n"
    assert done.stderr.rstrip().endswith(
        "tpcache.install.MissingExtra: x needs the server extra, which this install lacks "
        f"(ray not installed): {EXTRA}"
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """The wheel ``pip wheel --no-deps`` builds from a copy of the checkout (the build
    writes build/ beside its sources), with this venv's setuptools (no index needed)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "tpcache", src / "tpcache", ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "wheel", "-q"]
    done = subprocess.run(
        [*pip, "--no-deps", "--no-build-isolation", "-w", str(root), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (path,) = root.glob("tpcache-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_ships_the_trace_py_typed_and_the_license(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    dist = f"tpcache-{tpcache.__version__}.dist-info"
    for name in (
        "tpcache/py.typed",
        "tpcache/data/mooncake_conversation.jsonl.gz",
        "tpcache/data/README.md",
        "tpcache/data/LICENSE-mooncake-trace",
        "tpcache/client.py",
        f"{dist}/licenses/LICENSE",
    ):
        assert name in names, name
    trace = wheel.read("tpcache/data/mooncake_conversation.jsonl.gz")
    assert trace == (REPO / "tpcache" / "data" / "mooncake_conversation.jsonl.gz").read_bytes()
    assert not [n for n in names if n.startswith(("tests/", "scripts/", "data/"))]


def test_the_wheel_metadata_has_the_version_license_and_extras(wheel: zipfile.ZipFile) -> None:
    meta = Parser().parsestr(
        wheel.read(f"tpcache-{tpcache.__version__}.dist-info/METADATA").decode()
    )
    assert meta["Version"] == tpcache.__version__
    assert meta["License-Expression"] == "Apache-2.0"
    assert set(meta.get_all("Provides-Extra")) == {"server", "dev", "plot"}
    plain = [r for r in meta.get_all("Requires-Dist") if "extra ==" not in r]
    assert _names(plain) == ["numpy", "msgspec", "pyzmq"]


@pytest.mark.slow
def test_the_client_installs_alone_and_reaches_a_served_group() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "check_client_install.py"), "--json"],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    print(got["times"])
    answers = got["answers"]
    assert (answers["cold_prefix"], answers["warm_prefix"], answers["generated"]) == (0, 28, 8)
    assert answers["finish_reply"] == "CachedReply"
    assert not (answers["imported_torch"] or answers["imported_ray"])
    assert EXTRA in got["serve_refusal"]


def test_setup_without_torch_under_skip_stops_before_the_extra_pulls_one(tmp_path: Path) -> None:
    # A copy of the script in an empty tree: it makes .venv there (no torch), then must
    # stop rather than let the server extra install an unpinned torch.
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TPCACHE_TORCH": "skip"}
    done = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "setup.sh")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "PYTHON": sys.executable},
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "TPCACHE_TORCH=skip: leaving torch as it is (not installed)" in done.stdout
    assert done.stderr == (
        "setup: no torch in .venv (TPCACHE_TORCH=skip): install a torch build first\n"
    )
    assert "installing tpcache" not in done.stdout
