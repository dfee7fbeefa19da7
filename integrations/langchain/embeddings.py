"""PagedEmbeddings: LangChain's `Embeddings` on the shared paged engine (a decoder model's pooled final
hidden states, core/pooling.py), for vector stores and retrievers.

Every text of a call joins the engine's continuous batch at once, beside whatever else it runs; the
engine is shared with PagedLLM / ChatPaged built for the same model and settings.
"""

from __future__ import annotations

import asyncio
import queue
from typing import Any, Literal

from langchain_core.embeddings import Embeddings
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from paged_backend.core.outputs import RequestOutput
from paged_backend.core.pooling import PoolingParams
from paged_backend.entrypoints.async_engine import AsyncEngine
from paged_backend.entrypoints.engine_client import EngineClient

from .engines import get_async_engine
from .submit import get_before, make_deadline, raise_if_failed, remaining


class PagedEmbeddings(BaseModel, Embeddings):
    """Embeddings from a decoder model's last-token (or mean) final hidden state, L2-normalised."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())

    model: Any = None
    """None (the default model), a hub id, folder or .gguf path, a loaded PreTrainedModel, or a ready
    paged_backend.LLM / Engine / AsyncEngine."""
    tokenizer: Any = None
    engine_config: dict[str, Any] = Field(default_factory=dict)
    """EngineConfig fields plus dtype/device; adapters with equal settings share one engine."""
    pooling: Literal["last", "mean"] = "last"
    normalize: bool = True
    dimensions: int | None = None
    """Keep the first k components (Matryoshka models only; others refuse it)."""
    timeout: float | None = None
    """Seconds one call may take; past it its requests are aborted and TimeoutError raised."""

    _aengine: AsyncEngine | None = PrivateAttr(default=None)

    @property
    def client(self) -> EngineClient:
        """The shared engine, built on first use so that construction stays cheap."""
        if self._aengine is None:
            self._aengine = get_async_engine(self.model, self.tokenizer, self.engine_config)
        return self._aengine

    @property
    def params(self) -> PoolingParams:
        return PoolingParams(pooling=self.pooling, normalize=self.normalize, dimensions=self.dimensions)

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        params, client = self.params, self.client
        check_all(client, texts, params)
        outputs: queue.SimpleQueue[tuple[int, RequestOutput]] = queue.SimpleQueue()
        ids = [client.submit_pooling(text, params, None, lambda o, i=i: outputs.put((i, o)))
               for i, text in enumerate(texts)]
        deadline, pending = make_deadline(self.timeout), set(range(len(ids)))
        vectors: list[list[float]] = [[] for _ in texts]
        try:
            while pending:
                index, output = get_before(outputs, deadline, self.timeout)
                raise_if_failed(output)
                vectors[index] = output.embedding.tolist()
                pending.discard(index)
        finally:
            for index in pending:
                client.abort(ids[index])
        return vectors

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        params, client = self.params, self.client
        check_all(client, texts, params)
        try:
            finals = await asyncio.wait_for(asyncio.gather(*(client.embed(t, params) for t in texts)),
                                            remaining(make_deadline(self.timeout)))
        except asyncio.TimeoutError:
            raise TimeoutError(f"the request took longer than timeout={self.timeout} s") from None
        for output in finals:
            raise_if_failed(output)
        return [output.embedding.tolist() for output in finals]

    async def aembed_query(self, text: str) -> list[float]:
        return (await self.aembed_documents([text]))[0]


def check_all(client: EngineClient, texts: list[str], params: PoolingParams) -> None:
    """Check every text first, so a bad one (or too long) never leaves half a batch running."""
    for i, text in enumerate(texts):
        try:
            client.validate_pooling(client.tokenize(text)[1], params)
        except ValueError as exc:
            raise ValueError(f"text {i}: {exc}") from None
