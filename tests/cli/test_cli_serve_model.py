"""``tpcache serve --model DIR``: a tiny random Llama checkpoint written by Hugging Face
transformers, served by a real ``tpcache serve`` process (its own local Ray cluster, TP=2
rank actors loading their shards) with the network frontend on IPC; the torch-free
client generates, the tokens equal transformers' own greedy output, and `tpcache stop`
ends it. Options that do not go together are refused in one line, exit 2, before Ray."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from cluster_helpers import TPCACHE, clean_env, end, run_tpcache

from tpcache.cli import build_parser, main
from tpcache.cli.serve_model import LLAMA
from tpcache.cli.serve_options import serve_config

PROMPT = [1, 5, 9, 14]


@pytest.fixture(scope="module")
def tiny_model():
    """A random Llama checkpoint (2 layers, 4 heads, 2 KV heads, head dim 16, vocab
    128, eos 2) in a short temp dir, and transformers' greedy 12 tokens after PROMPT."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    root = Path(tempfile.mkdtemp(prefix="tpm", dir="/tmp"))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=256,
        eos_token_id=2,
        bos_token_id=1,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(root / "tiny")
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, eos_token_id=None
        )
    try:
        yield root, out[0, len(PROMPT) :].tolist()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_model_options_make_the_group_and_the_engine(tiny_model) -> None:
    root, _ = tiny_model
    model = str(root / "tiny")
    args = build_parser().parse_args(
        [
            *["serve", "--model", model, "--dtype", "bfloat16", "--capacity", "1024"],
            *["--page-size", "4", "--step-tokens", "64", "--max-batch", "3"],
            *["--network-endpoint", f"ipc://{root}/x.sock"],
        ]
    )
    config, serving = serve_config(args)
    assert (config.runner, config.runner_args) == (LLAMA, {"model": model, "dtype": "bfloat16"})
    pool = config.pool_spec()
    assert (pool.num_layers, pool.kv_heads, pool.head_dim, pool.dtype) == (2, 2, 16, "bfloat16")
    assert config.capacity_tokens == 1024
    assert config.cpu_budget_bytes == 1024 * pool.bytes_per_slot + (1 << 20)
    eng = serving.engine
    assert (eng.step_tokens, eng.max_batch, eng.eos_token_ids) == (64, 3, (2,))
    assert (serving.vocab, serving.model_name, serving.http_port) == (128, "tiny", None)
    assert (eng.prefix_cache, eng.ordered_admission) == (True, False)
    _, baseline = serve_config(
        build_parser().parse_args(
            ["serve", "--model", model, "--no-prefix-cache", "--ordered-admission"]
        )
    )
    assert (baseline.engine.prefix_cache, baseline.engine.ordered_admission) == (False, True)
    assert serving.network.endpoint == f"ipc://{root}/x.sock"
    (root / "token").write_text("a-token-of-16-chars-or-more\n")
    tcp = ["--network-endpoint", "tcp://0.0.0.0:5999", "--network-token-file", str(root / "token")]
    _, guarded = serve_config(build_parser().parse_args(["serve", "--model", model, *tcp]))
    assert (guarded.network.token, guarded.network.insecure) == (
        "a-token-of-16-chars-or-more",
        False,
    )
    # Without a model: the index service, as before.
    plain, none = serve_config(build_parser().parse_args(["serve"]))
    assert (plain.runner, plain.capacity_tokens, none.network) == (None, 1 << 20, None)
    own = build_parser().parse_args(
        ["serve", "--runner", "tpcache.model.reference:ReferenceRunner", "--runner-arg", "vocab=32"]
    )
    cfg, _ = serve_config(own)
    assert (cfg.runner, cfg.runner_args) == (
        "tpcache.model.reference:ReferenceRunner",
        {"vocab": 32},
    )


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--layers", "2"], "--layers shape the placeholder pool"),
        (["--capacity", "8", "--page-size", "4"], "--capacity 8 holds less than 4 pages"),
        (["--runner", "a.b:C"], "give --model or --runner, not both"),
        (["--network-endpoint", "tcp://0.0.0.0:5999"], "--network-token-file, --network-curve"),
        (["--tp", "3"], "kv_heads=2 does not divide by tp=3"),
    ],
)
def test_model_refusals_are_one_line(tiny_model, capsys, extra, said) -> None:
    root, _ = tiny_model
    assert main(["serve", "--model", str(root / "tiny"), *extra]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1 and err.startswith("tpcache serve: ")


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--model", "/nonexistent/x"], "is not a directory"),
        (["--model", "/"], "--model '/' has no config.json: give the directory of a Hugging"),
        (["--dtype", "float16"], "--dtype needs --model or --runner"),
        (["--no-prefix-cache"], "--no-prefix-cache needs --model or --runner"),
        (["--http-port", "0"], "--http-port needs --model or --runner"),
        (["--runner-arg", "a=1"], "--runner-arg needs --runner"),
        (["--network-insecure"], "--network-insecure needs --network-endpoint"),
        (["--model", "m", "--http-host", "::1"], "--http-host needs --http-port"),
    ],
)
def test_options_without_what_they_need(capsys, args, said) -> None:
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1


def test_serve_a_model_end_to_end(tiny_model) -> None:
    root, want = tiny_model
    env = clean_env(root)
    env["RAY_TMPDIR"] = str(root / "ray")  # short: Unix socket paths
    endpoint = f"ipc://{root}/gen.sock"
    out = root / "serve.out"
    cmd = [*TPCACHE, "serve", "--model", str(root / "tiny"), "--tp", "2", "--capacity", "1024"]
    cmd += ["--page-size", "4", "--name", "m", "--namespace", "cli-model"]
    cmd += ["--network-endpoint", endpoint]
    with open(out, "w") as f:
        proc = subprocess.Popen(
            cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 240
        while "network frontend on" not in (text := out.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, text[-3000:]
            time.sleep(0.5)
        address = text.split("address='", 1)[1].split("'", 1)[0]
        client = (
            "import json, sys\n"
            "from tpcache.client import NetworkClient\n"
            "with NetworkClient(sys.argv[1]) as c:\n"
            "    whole = c.generate([1, 5, 9, 14], 12, ignore_eos=True)\n"
            "    streamed = list(c.generate([1, 5, 9, 14], 12, ignore_eos=True, stream=True))\n"
            "print(json.dumps([whole.tokens, streamed, whole.finish_reason, "
            "'torch' in sys.modules]))\n"
        )
        got = subprocess.run(
            [sys.executable, "-c", client, endpoint], capture_output=True, text=True, timeout=120
        )
        assert got.returncode == 0, got.stderr
        import json

        assert json.loads(got.stdout) == [want, want, "length", False]
        stop = run_tpcache(
            ["stop", "--name", "m", "--namespace", "cli-model", "--address", address], env
        )
        assert stop.returncode == 0 and "stopped 'm'" in stop.stdout, stop.stderr
        assert proc.wait(60) == 0
    finally:
        end([proc], str(root))
