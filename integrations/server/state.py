"""ServerState: what every route needs: the engine client, the served model's name, metrics, the key."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, Request

from paged_backend.entrypoints.engine_client import EngineClient
from paged_backend.entrypoints.reasoning import ReasoningParser

from paged_backend.entrypoints.tool_calls import HERMES, ToolParser
from .errors import APIError
from .metrics import ServerMetrics

# The most sequences (prompts x choices) one request may start unless the deployer says otherwise:
# enough for an evaluation harness's batches, small enough that one request cannot hold the engine
# for minutes while every other client waits.
DEFAULT_MAX_SEQS_PER_REQUEST = 256


@dataclass(slots=True)
class ServerState:
    client: EngineClient  # the routes' only way to the engine (AsyncEngine, or replicas behind Ray)
    model_name: str
    metrics: ServerMetrics
    api_key: str | None = None
    max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST
    reasoning_parser: ReasoningParser | None = None  # None: answers are not split into reasoning and content
    tool_parser: ToolParser = HERMES  # the format tool calls are parsed (and forced) in

    def authorised(self) -> list:
        """The dependency every API route declares: the key check (`Authorization: Bearer <api_key>`)."""
        return [Depends(self.require_key)]

    async def require_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), self.api_key):
            raise APIError(401, "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                           None, "invalid_api_key")

    @property
    def tokenizer(self) -> Any:
        return self.client.tokenizer

    def check_model(self, model: str) -> str | None:
        """The LoRA adapter `model` names (None: the base model); 404 naming what is served otherwise."""
        if model == self.model_name:
            return None
        adapters = self.lora_names()
        if model in adapters:
            return model
        served = ", ".join(f"`{name}`" for name in [self.model_name, *adapters])
        raise APIError(404, f"The model `{model}` does not exist. This server serves {served}.",
                       "model", "model_not_found")

    def lora_names(self) -> list[str]:
        return self.client.list_loras()

    def tokenize(self, prompt: str | list[int], param: str = "prompt") -> tuple[str | None, list[int]]:
        try:
            return self.client.tokenize(prompt)
        except ValueError as exc:
            raise APIError(400, str(exc), param) from None

    def check_sequences(self, prompts: int, per_prompt: int, param: str) -> None:
        """Refuse (400, with the numbers) a request that would start more sequences than the deployer allows."""
        wanted = prompts * per_prompt
        if wanted > self.max_seqs_per_request:
            raise APIError(400, f"this request would start {wanted} sequences ({prompts} prompt(s) x {per_prompt} "
                           f"each); this server allows at most {self.max_seqs_per_request} per request "
                           "(--max-seqs-per-request)", param)
