"""ServerState: what every route needs: the async engine, the served model's name, metrics, the key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paged_backend import AsyncEngine, Engine

from .errors import APIError
from .metrics import ServerMetrics


@dataclass(slots=True)
class ServerState:
    aengine: AsyncEngine
    model_name: str
    metrics: ServerMetrics
    api_key: str | None = None

    @property
    def engine(self) -> Engine:
        return self.aengine.engine

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                           "model", "model_not_found")

    def tokenize(self, prompt: str | list[int], param: str = "prompt") -> tuple[str | None, list[int]]:
        try:
            return self.engine.tokenize(prompt)
        except ValueError as exc:
            raise APIError(400, str(exc), param) from None
