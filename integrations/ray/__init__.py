"""Engine replicas on Ray: K engines as Ray actors behind one router, with one engine's API.

- `ReplicatedLLM(model, num_replicas)`: `generate(prompts, params)` like `LLM.generate`.
- `ReplicatedAsyncEngine`: async `generate(prompt, params)` and sync `stream(...)` like AsyncEngine;
  usable as the engine of `integrations.server.create_app`.
- `build_app(...)`: a Ray Serve deployment of the OpenAI-compatible server over replicas.
- `start_local_ray()`: Ray on this machine only, on 127.0.0.1.

Ray is an optional dependency; `build_app` also needs `ray[serve]`. Names load on first use, so
`start_local_ray` can set Ray's environment before anything imports Ray.
"""

from __future__ import annotations

import importlib
from typing import Any

HOMES = {
    "EngineReplica": ".replica",
    "NoLiveReplicaError": ".errors",
    "PrefixTable": ".prefix_table",
    "ReplicaFront": ".replica_front",
    "ReplicaInfo": ".replica",
    "ReplicatedAsyncEngine": ".replicated_engine",
    "ReplicatedLLM": ".replicated_llm",
    "Router": ".router",
    "build_app": ".serve",
    "launch_replicas": ".replica",
    "start_local_ray": ".local_cluster",
}
__all__ = ["EngineReplica", "NoLiveReplicaError", "PrefixTable", "ReplicaFront", "ReplicaInfo",
           "ReplicatedAsyncEngine", "ReplicatedLLM", "Router", "build_app", "launch_replicas", "start_local_ray"]


def __getattr__(name: str) -> Any:
    if name not in HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(HOMES[name], __name__), name)
