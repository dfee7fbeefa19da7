"""start_local_ray: a one-machine Ray instance whose every process listens on 127.0.0.1 only."""

from __future__ import annotations

import os
from typing import Any

LOOPBACK_ENV = {
    # Ray treats "no clusters" (its Windows/macOS default) as "bind loopback"; on Linux it binds the
    # machine's external address unless this is off. Worker processes read it from the environment.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def start_local_ray(num_cpus: int | None = None, num_gpus: int | None = None, **init_kwargs: Any) -> None:
    """`ray.init` for one machine, on loopback, without the dashboard; a no-op if Ray is already up.

    For a multi-node cluster use `ray start` on each node and `ray.init(address="auto")` instead."""
    os.environ.update(LOOPBACK_ENV)
    import ray
    from ray._private import ray_constants

    if ray.is_initialized():
        return
    # The constant is read from the environment when ray is first imported, which may have happened
    # before this call; the driver consults the module attribute when it picks its address.
    ray_constants.ENABLE_RAY_CLUSTER = False
    init_kwargs.setdefault("include_dashboard", False)
    # "local" always starts a fresh instance; the default would join one left by `ray start` on this machine.
    init_kwargs.setdefault("address", "local")
    ray.init(num_cpus=num_cpus, num_gpus=num_gpus, **init_kwargs)
