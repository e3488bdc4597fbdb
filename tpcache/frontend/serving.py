"""What a served group serves beside its cache calls when its ranks run a model: the
serving engine, generate over Ray (``ray_gen``), and the network frontend and the
OpenAI-compatible HTTP endpoint, all in the process that holds the coordinator (the Ray
service's actor, or the caller's)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from tpcache.coordinator.core import Coordinator
from tpcache.engine.config import EngineConfig
from tpcache.engine.loop import Engine
from tpcache.errors import TpcacheError
from tpcache.frontend.frontend import serve_network
from tpcache.frontend.netfront import FrontendConfig, NetFrontend
from tpcache.frontend.ray_gen import RayGenerate


class ServingConfigError(TpcacheError, ValueError):
    """``ServeOptions`` that ask for what cannot be served (an HTTP endpoint with no
    model to serve)."""


@dataclass(frozen=True)
class ServeOptions:
    """``engine``: how the engine schedules (with the model's end-of-sequence ids);
    ``vocab``: the model's vocabulary (None: the engine finds it with one forward);
    ``network``: serve the network frontend there (cache calls, and generate with a
    model); ``http_port``: serve the OpenAI endpoint on ``http_host`` (needs a model;
    0 picks a port), as ``model_name``, with the tokenizer of ``tokenizer_dir``."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    vocab: int | None = None
    network: FrontendConfig | None = None
    http_host: str = "127.0.0.1"
    http_port: int | None = None
    http_api_key: str | None = None
    model_name: str = "tpcache"
    tokenizer_dir: str | None = None


class ModelServing:
    """The engine over ``coord`` (when ``has_model``: its ranks run a runner) and the
    endpoints ``options`` ask for, started in the constructor; ``close`` stops them
    (endpoints first, so their running calls are cancelled while the engine runs).
    Raises ``ServingConfigError``, ``FrontendConfigError`` (a taken address) or the
    HTTP server's ``OpenAIConfigError``, with nothing left running."""

    def __init__(self, coord: Coordinator, options: ServeOptions, has_model: bool) -> None:
        if options.http_port is not None and not has_model:
            raise ServingConfigError("an HTTP endpoint needs a model to serve")
        self.engine: Engine | None = None
        self.generate = RayGenerate(None)  # NoModel until an engine runs
        self.front: NetFrontend | None = None
        self.http: Any = None  # an OpenAIServer
        try:
            if has_model:
                self.engine = Engine(coord, options.engine, vocab=options.vocab)
                self.engine.start()
                self.generate = RayGenerate(self.engine)
            if options.network is not None:
                self.front = serve_network(coord, options.network, engine=self.engine)
            if options.http_port is not None:
                from tpcache.frontend.openai_http import OpenAIServer

                self.http = OpenAIServer(
                    self.engine,
                    host=options.http_host,
                    port=options.http_port,
                    model_name=options.model_name,
                    tokenizer_dir=options.tokenizer_dir,
                    api_key=options.http_api_key,
                )
                self.http.start()
        except BaseException:
            self.close()
            raise

    def endpoints(self) -> dict[str, str | None]:
        """Where the network frontend and the HTTP endpoint listen (None: not served)."""
        return {
            "network": None if self.front is None else self.front.endpoint,
            "http": None if self.http is None else self.http.url,
        }

    def close(self) -> None:
        """Stop the endpoints, then the engine (its live requests fail ``EngineClosed``).
        Idempotent."""
        for part in (self.front, self.http, self.engine):
            if part is not None:
                with contextlib.suppress(Exception):
                    part.close()
        self.front = self.http = self.engine = None


__all__ = ["ModelServing", "ServeOptions", "ServingConfigError"]
