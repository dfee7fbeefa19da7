"""OpenAI-compatible HTTP server on the engine: /v1/models, /v1/completions, /v1/chat/completions,
the older /generate, /health and Prometheus /metrics. `paged-backend serve` starts it.

Names are imported on first use, so the CLI can import `.cli` (for its flags) without fastapi.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["APIError", "ServerState", "create_app"]
HOMES = {"create_app": ".app", "APIError": ".errors", "ServerState": ".state"}


def __getattr__(name: str) -> Any:
    if name not in HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(HOMES[name], __name__), name)
