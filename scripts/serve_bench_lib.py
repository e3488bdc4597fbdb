"""Pieces of ``bench_serve.py``: the machine it runs on, a random checkpoint written by
Hugging Face transformers, a ``tpcache serve`` process with its network frontend on IPC,
and a client call that times its own stream.

Not imported by the package; run from the repository (``scripts/`` on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TPCACHE = [sys.executable, "-m", "tpcache"]


def machine() -> dict[str, Any]:
    """What the figures ran on: CPU model and count, load, Python and torch versions."""
    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import torch

    return {
        "host": platform.node(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


@dataclass(frozen=True)
class ModelShape:
    """A Llama-style decoder's shape (transformers' ``LlamaConfig`` fields)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def write_checkpoint(path: Path, shape: ModelShape, seed: int) -> Path:
    """A random Llama checkpoint written by transformers' ``save_pretrained`` (float32,
    no end-of-sequence id, so every request runs to its length)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=1 << 15,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


class Served:
    """``tpcache serve --model DIR`` in a process of its own (its own local Ray cluster
    under a temp dir), with the network frontend on an IPC socket; stopped and cleaned up
    on exit, whatever happened."""

    def __init__(self, model: Path, tp: int, capacity: int, page_size: int, extra: list[str]):
        self.root = Path(tempfile.mkdtemp(prefix="tpb", dir="/tmp"))
        self.endpoint = f"ipc://{self.root}/gen.sock"
        self.cmd = [*TPCACHE, "serve", "--model", str(model), "--tp", str(tp)]
        self.cmd += ["--capacity", str(capacity), "--page-size", str(page_size)]
        self.cmd += ["--name", "bench", "--namespace", f"bench-{os.getpid()}"]
        self.cmd += ["--network-endpoint", self.endpoint, *extra]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self.env.update(
            HOME=str(self.root), RAY_TMPDIR=str(self.root / "ray"), RAY_USAGE_STATS_ENABLED="0"
        )
        self.proc: subprocess.Popen | None = None
        self.address = ""

    def __enter__(self) -> Served:
        out = self.root / "serve.out"
        with open(out, "w") as f:
            self.proc = subprocess.Popen(
                self.cmd, env=self.env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 300
        while "network frontend on" not in (text := out.read_text()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"tpcache serve did not start:\n{text[-3000:]}")
            time.sleep(0.5)
        self.address = text.split("address='", 1)[1].split("'", 1)[0]
        return self

    def __exit__(self, *exc: object) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None and self.address:
            ns = f"bench-{os.getpid()}"
            stop = [*TPCACHE, "stop", "--name", "bench", "--namespace", ns]
            subprocess.run([*stop, "--address", self.address], env=self.env, timeout=120,
                           capture_output=True, check=False)  # fmt: skip
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(60)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _kill_marked(str(self.root))
        shutil.rmtree(self.root, ignore_errors=True)


def _kill_marked(marker: str) -> None:
    """Kill every process left whose command line names ``marker`` (Ray's, under it)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


@dataclass(frozen=True)
class Timed:
    """One streamed request as its client saw it."""

    ttft_s: float
    e2e_s: float
    tokens: list[int]
    cached_tokens: int  # the server's count of prompt tokens the cache held


def timed_stream(client: Any, prompt: list[int], max_new: int) -> Timed:
    """Generate greedily to ``max_new`` tokens over ``client``'s stream, timing from just
    before the call to the first token and to the last."""
    t0 = time.perf_counter()
    first = 0.0
    tokens: list[int] = []
    stream = client.generate(prompt, max_new, ignore_eos=True, stream=True)
    for tok in stream:
        if not tokens:
            first = time.perf_counter() - t0
        tokens.append(tok)
    return Timed(first, time.perf_counter() - t0, tokens, stream.result.cached_tokens)


def median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return (s[n // 2] + s[(n - 1) // 2]) / 2 if n else 0.0
