"""A Ray Serve deployment of the OpenAI-compatible server over engine replicas.

One Serve replica (the HTTP ingress) runs `integrations.server.create_app` unchanged on a
ReplicatedAsyncEngine, which routes each request to one of K EngineReplica actors. The app needs
the engine object at construction, so it is built at replica start through Serve's late-bound
ingress (`__serve_build_asgi_app__`). The ingress itself needs no CPU of its own: the replicas do
the work. Run it with `serve.run(build_app(...))` or `serve run module:builder`. LoRA adapters work
as with `paged-backend serve`: `lora_modules` (the `--lora-modules` of the one-engine server) are
registered on every replica at start, and `allow_runtime_lora_updating` adds the load/unload routes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI
from paged_backend.integrations.server import create_app
from ray import serve
from ray.actor import ActorHandle
from ray.serve import Application

from .replicated_engine import ReplicatedAsyncEngine


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
@serve.ingress()
class OpenAIReplicasServer:
    def __init__(self, model_name: str, api_key: str | None, replicas: Sequence[ActorHandle] | None,
                 launch_kwargs: dict[str, Any], client_kwargs: dict[str, Any],
                 lora_modules: Mapping[str, str] | None = None, allow_runtime_lora_updating: bool = False) -> None:
        if replicas is None:
            self.aengine = ReplicatedAsyncEngine.launch(**launch_kwargs, **client_kwargs)
        else:
            self.aengine = ReplicatedAsyncEngine(replicas, **client_kwargs)
        for name, path in (lora_modules or {}).items():
            self.aengine.add_lora(name, path)
        self.model_name = model_name
        self.api_key = api_key
        self.allow_runtime_lora_updating = allow_runtime_lora_updating

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_app(self.aengine, self.model_name, self.api_key,
                          allow_runtime_lora_updating=self.allow_runtime_lora_updating)


def build_app(model: str | None = None, num_replicas: int = 2, *, model_name: str | None = None,
              api_key: str | None = None, replicas: Sequence[ActorHandle] | None = None,
              tokenizer: str | None = None, num_cpus: float = 1, num_gpus: float = 0, prefix_aware: bool = True,
              request_timeout_s: float | None = 600.0, max_attempts: int = 2,
              lora_modules: Mapping[str, str] | None = None, allow_runtime_lora_updating: bool = False,
              **engine_config: Any) -> Application:
    """The Serve application: the ingress launches `num_replicas` replicas of `model` (or uses the
    running EngineReplica actors given as `replicas`, which it then does not own). `lora_modules`
    ({name: PEFT folder}, a path every replica can read) or `allow_runtime_lora_updating` need
    replicas with `enable_lora=True` (turned on here when the ingress launches them)."""
    if replicas is not None and (model is not None or engine_config):
        raise ValueError("give either `replicas` (running actors) or a model and its engine settings, not both")
    if replicas is None and (lora_modules or allow_runtime_lora_updating):
        engine_config.setdefault("enable_lora", True)  # as `paged-backend serve --lora-modules` does
    launch_kwargs = {"model": model, "num_replicas": num_replicas, "tokenizer": tokenizer, "num_cpus": num_cpus,
                     "num_gpus": num_gpus, **engine_config}
    client_kwargs = {"prefix_aware": prefix_aware, "request_timeout_s": request_timeout_s,
                     "max_attempts": max_attempts}
    name = model_name or (str(model) if model is not None else "default")
    return OpenAIReplicasServer.bind(name, api_key, None if replicas is None else list(replicas), launch_kwargs,
                                     client_kwargs, dict(lora_modules or {}), allow_runtime_lora_updating)
