"""A Ray Serve deployment of the OpenAI-compatible server over engine replicas.

One Serve replica (the HTTP ingress) runs `integrations.server.create_app` unchanged on a
ReplicatedAsyncEngine, which routes each request to one of K EngineReplica actors. The app needs
the engine object at construction, so it is built at replica start through Serve's late-bound
ingress (`__serve_build_asgi_app__`). The ingress itself needs no CPU of its own: the replicas do
the work. Run it with `serve.run(build_app(...))` or `serve run module:builder`.
"""

from __future__ import annotations

from collections.abc import Sequence
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
                 launch_kwargs: dict[str, Any], client_kwargs: dict[str, Any]) -> None:
        if replicas is None:
            self.aengine = ReplicatedAsyncEngine.launch(**launch_kwargs, **client_kwargs)
        else:
            self.aengine = ReplicatedAsyncEngine(replicas, **client_kwargs)
        self.model_name = model_name
        self.api_key = api_key

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_app(self.aengine, self.model_name, self.api_key)


def build_app(model: str | None = None, num_replicas: int = 2, *, model_name: str | None = None,
              api_key: str | None = None, replicas: Sequence[ActorHandle] | None = None,
              tokenizer: str | None = None, num_cpus: float = 1, num_gpus: float = 0, prefix_aware: bool = True,
              request_timeout_s: float | None = 600.0, max_attempts: int = 2,
              **engine_config: Any) -> Application:
    """The Serve application: the ingress launches `num_replicas` replicas of `model` (or uses the
    running EngineReplica actors given as `replicas`, which it then does not own)."""
    if replicas is not None and (model is not None or engine_config):
        raise ValueError("give either `replicas` (running actors) or a model and its engine settings, not both")
    launch_kwargs = {"model": model, "num_replicas": num_replicas, "tokenizer": tokenizer, "num_cpus": num_cpus,
                     "num_gpus": num_gpus, **engine_config}
    client_kwargs = {"prefix_aware": prefix_aware, "request_timeout_s": request_timeout_s,
                     "max_attempts": max_attempts}
    name = model_name or (str(model) if model is not None else "default")
    return OpenAIReplicasServer.bind(name, api_key, None if replicas is None else list(replicas), launch_kwargs,
                                     client_kwargs)
