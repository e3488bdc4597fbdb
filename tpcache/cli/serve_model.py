"""The options of ``tpcache serve`` that make it serve a model: ``--model DIR`` (a Hugging
Face checkpoint every rank loads as its TP shard) or ``--runner module:Class`` (an
engine's own runner), the engine's schedule, and the endpoints that serve generate (the
network frontend, the OpenAI-compatible HTTP endpoint). Without a model, ``serve``
stays the index service it is.

What these options make: the ``GroupConfig`` fields of the runner, with the KV pool its
model shapes and a CPU budget that holds ``--capacity`` of it, and the service's
``ServeOptions``."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from tpcache.cli.args import port_arg, positive_arg
from tpcache.cli.key_files import read_key
from tpcache.errors import TpcacheError

LLAMA = "tpcache.model.llama:LlamaRunner"
DTYPES = ("float32", "float16", "bfloat16")
# With a model, what --capacity must hold at least: a few requests of a few pages each.
MIN_CAPACITY_PAGES = 4
CPU_BUDGET = 1 << 30  # a CPU rank's KV budget with a model and no --capacity
# Options that only a served model uses, and the network frontend's own.
_MODEL_ONLY = (
    "--dtype",
    "--step-tokens",
    "--max-batch",
    "--no-prefix-cache",
    "--ordered-admission",
    "--http-port",
    "--http-api-key-file",
)
_NETWORK_ONLY = ("--network-token-file", "--network-curve-secret-file", "--network-insecure")


class ServeModelError(TpcacheError, ValueError):
    """Options of ``tpcache serve`` that do not go together, or a model it cannot serve
    as asked (the message names the option)."""


def add_model_options(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("a served model (generate; without one, an index service)")
    m.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="a Hugging Face checkpoint directory (config.json, *.safetensors) each rank "
        "loads as its tensor-parallel shard; its shape sizes the KV pool",
    )
    m.add_argument("--dtype", choices=DTYPES, default=None, help="weights and KV (default float32)")
    m.add_argument(
        "--runner",
        default=None,
        metavar="MODULE:CLASS",
        help="a model runner of your own every rank builds (instead of --model)",
    )
    m.add_argument(
        "--runner-arg",
        action="append",
        default=[],
        metavar="K=V",
        help="a keyword argument of --runner (repeatable; V read as JSON when it parses)",
    )
    m.add_argument("--step-tokens", type=positive_arg, help="tokens per step (default 2048)")
    m.add_argument("--max-batch", type=positive_arg, help="requests per step (default 64)")
    m.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="cache nothing for later requests (every prompt computed whole: a baseline)",
    )
    m.add_argument(
        "--ordered-admission",
        action="store_true",
        help="admit in arrival order, each once the cache holds what it would match from "
        "the prefills before it, and only with room for its whole output (no preemption)",
    )
    n = p.add_argument_group("generate and cache calls over the network")
    n.add_argument(
        "--network-endpoint",
        metavar="ENDPOINT",
        help="serve the network frontend (tpcache.client.NetworkClient) here, e.g. "
        "ipc:///tmp/tpcache.sock or tcp://127.0.0.1:5560; a network address needs "
        "--network-token-file, --network-curve-secret-file or --network-insecure",
    )
    n.add_argument("--network-token-file", metavar="PATH", help="a token every request carries")
    n.add_argument(
        "--network-curve-secret-file", metavar="PATH", help="CURVE secret key (`tpcache keys`)"
    )
    n.add_argument(
        "--network-insecure",
        action="store_true",
        help="serve a network address with no authentication (anyone who reaches it)",
    )
    n.add_argument("--http-host", default=None, help="OpenAI endpoint host (default 127.0.0.1)")
    n.add_argument(
        "--http-port",
        type=port_arg,
        default=None,
        help="serve the OpenAI-compatible /v1/completions here (0: any free port)",
    )
    n.add_argument(
        "--http-api-key-file", metavar="PATH", help="the key OpenAI clients send (Bearer)"
    )


def model_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the model options together (before anything is read), or None."""
    if args.model is not None and args.runner is not None:
        return "give --model or --runner, not both"
    if args.runner_arg and args.runner is None:
        return "--runner-arg needs --runner (--model builds its own runner)"
    given = [flag for flag in _MODEL_ONLY if _given(args, flag)]
    if given and args.model is None and args.runner is None:
        return _need(given, "--model or --runner (no model is served without one)")
    if args.model is not None or args.runner is not None:
        placeholder = [flag for flag in ("--layers", "--head-dim") if _given(args, flag)]
        if placeholder:
            return (
                f"{' and '.join(placeholder)} shape the placeholder pool of a group without "
                "a model; the model shapes the KV pool: drop them"
            )
    alone = [flag for flag in _NETWORK_ONLY if _given(args, flag)]
    if alone and args.network_endpoint is None:
        return _need(alone, "--network-endpoint")
    alone = [flag for flag in ("--http-host", "--http-api-key-file") if _given(args, flag)]
    if alone and args.http_port is None:
        return _need(alone, "--http-port")
    return None


def _given(args: argparse.Namespace, flag: str) -> bool:
    value = getattr(args, flag.removeprefix("--").replace("-", "_"))
    return value is not None and value is not False and value != []  # (0 is a port)


def _need(given: list[str], what: str) -> str:
    return f"{' and '.join(given)} {'needs' if len(given) == 1 else 'need'} {what}"


def model_group(args: argparse.Namespace, config: Any) -> tuple[Any, dict[str, Any]]:
    """``config`` (a ``GroupConfig``) running the model the options name, with a CPU
    budget that holds ``--capacity`` of its KV, and what the engine needs of the
    checkpoint (``vocab``, ``eos_token_ids``, ``tokenizer_dir``, ``model_name``).
    Raises ``ServeModelError`` for a checkpoint that cannot be read or a capacity too
    small; the model's own refusals (``RunnerConfigError``) pass through."""
    from tpcache.model.runner_spec import runner_options

    found: dict[str, Any] = {}
    if args.model is not None:
        found = checkpoint_facts(args.model)
        fields = {"runner": LLAMA, "runner_args": {"model": os.path.abspath(args.model)}}
        fields["runner_args"]["dtype"] = args.dtype or "float32"
    else:
        fields = runner_options(args.runner, args.runner_arg)
        if args.dtype is not None:
            fields["runner_args"].setdefault("dtype", args.dtype)
    config = dataclasses.replace(config, **fields)
    pool = config.pool_spec()  # builds the runner (no weights): its KV layout
    least = MIN_CAPACITY_PAGES * args.page_size
    if args.capacity is not None and args.capacity < least:
        raise ServeModelError(
            f"--capacity {args.capacity} holds less than {MIN_CAPACITY_PAGES} pages of "
            f"{args.page_size} tokens: give at least {least}"
        )
    # A CPU rank's KV budget: what --capacity of this model's KV takes, else 1 GiB.
    budget = CPU_BUDGET if args.capacity is None else args.capacity * pool.bytes_per_slot
    config = dataclasses.replace(config, cpu_budget_bytes=budget + (1 << 20))
    return config, found


def checkpoint_facts(model_dir: str) -> dict[str, Any]:
    """What a checkpoint directory tells the engine and the HTTP endpoint. Raises
    ``ServeModelError`` for a directory without a readable config.json."""
    from tpcache.model.hf_config import read_hf_config

    if not os.path.isdir(model_dir):
        raise ServeModelError(f"--model {model_dir!r} is not a directory")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ServeModelError(
            f"--model {model_dir!r} has no config.json: give the directory of a Hugging "
            "Face checkpoint (config.json and its *.safetensors)"
        )
    try:
        hf = read_hf_config(model_dir)
    except OSError as exc:
        raise ServeModelError(f"--model {model_dir!r}: {exc.strerror or exc}") from None
    has_tokenizer = os.path.exists(os.path.join(model_dir, "tokenizer.json"))
    return {
        "vocab": hf.vocab,
        "eos_token_ids": tuple(hf.eos_token_ids),
        "tokenizer_dir": model_dir if has_tokenizer else None,
        "model_name": os.path.basename(os.path.normpath(model_dir)),
    }


def serve_options(args: argparse.Namespace, found: dict[str, Any]) -> Any:
    """The service's ``ServeOptions``: the engine's schedule, the endpoints. Raises
    ``ServeModelError`` for a network endpoint that needs keys it was not given."""
    from tpcache.engine.config import EngineConfig
    from tpcache.frontend.netfront import FrontendConfig, FrontendConfigError
    from tpcache.frontend.serving import ServeOptions

    engine = EngineConfig(
        step_tokens=args.step_tokens or 2048,
        max_batch=args.max_batch or 64,
        eos_token_ids=found.get("eos_token_ids", ()),
        prefix_cache=not args.no_prefix_cache,
        ordered_admission=args.ordered_admission,
    )
    network = None
    if args.network_endpoint is not None:
        try:
            network = FrontendConfig(
                endpoint=args.network_endpoint,
                token=read_key(args.network_token_file),
                curve_secret_key=read_key(args.network_curve_secret_file),
                insecure=args.network_insecure,
            )
        except FrontendConfigError as exc:
            raise ServeModelError(
                f"--network-endpoint {args.network_endpoint}: {exc} (here: "
                "--network-token-file, --network-curve-secret-file or --network-insecure)"
            ) from None
    return ServeOptions(
        engine=engine,
        vocab=found.get("vocab"),
        network=network,
        http_host=args.http_host or "127.0.0.1",
        http_port=args.http_port,
        http_api_key=read_key(args.http_api_key_file),
        model_name=found.get("model_name", "tpcache"),
        tokenizer_dir=found.get("tokenizer_dir"),
    )


__all__ = ["ServeModelError", "add_model_options", "model_error", "model_group", "serve_options"]
