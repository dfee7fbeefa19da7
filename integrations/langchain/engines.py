"""Engine sharing: adapters built for the same model and engine settings drive one AsyncEngine.

Loading a model and allocating its KV cache is the expensive part, and LangChain builds chat
models freely (per chain, per test, per `bind`). So adapters hold only a description of the
engine they want; their first call resolves it here, once per process, under a lock.
"""

from __future__ import annotations

import threading
from typing import Any

from paged_backend.engine import Engine
from paged_backend.entrypoints.async_engine import AsyncEngine
from paged_backend.entrypoints.llm import LLM
from paged_backend.model.loading.default_model import DEFAULT_MODEL

_lock = threading.Lock()
# key -> AsyncEngine. One AsyncEngine per Engine: two stepping threads would corrupt it.
_engines: dict[tuple, AsyncEngine] = {}
# Objects keyed by id() stay referenced here, so their ids cannot be reused by other objects.
_keep_alive: dict[int, Any] = {}


def get_async_engine(model: Any = None, tokenizer: Any = None,
                     engine_config: dict[str, Any] | None = None) -> AsyncEngine:
    """Return the shared AsyncEngine for this model, tokenizer and engine settings, building it once.

    `model` is None (the default model), a hub id, folder or `.gguf` path, a loaded
    `PreTrainedModel`, or a ready `paged_backend.LLM`, `Engine` or `AsyncEngine`."""
    if isinstance(model, (LLM, Engine, AsyncEngine)):
        if tokenizer is not None or engine_config:
            raise ValueError("tokenizer and engine_config configure an engine the adapter builds; "
                             f"this adapter was given a ready {type(model).__name__}")
        return adopt_engine(model)
    with _lock:
        key = build_key(model, tokenizer, engine_config or {})
        if key not in _engines:
            llm = LLM(model, tokenizer, **(engine_config or {}))
            _engines[key] = _engines[engine_key(llm.engine)] = AsyncEngine(llm.engine)
        return _engines[key]


def adopt_engine(source: LLM | Engine | AsyncEngine) -> AsyncEngine:
    """Wrap a caller's engine once; later adapters given the same engine reuse that wrapper."""
    engine = source if isinstance(source, Engine) else source.engine
    with _lock:
        key = engine_key(engine)
        if key not in _engines:
            _engines[key] = source if isinstance(source, AsyncEngine) else AsyncEngine(engine)
        return _engines[key]


def engine_key(engine: Engine) -> tuple:
    _keep_alive[id(engine)] = engine
    return ("engine", id(engine))


def build_key(model: Any, tokenizer: Any, engine_config: dict[str, Any]) -> tuple:
    """Names are keyed by value, objects (a loaded model or tokenizer) by identity."""
    return ("build", identity(DEFAULT_MODEL if model is None else model), identity(tokenizer),
            tuple(sorted((k, repr(v)) for k, v in engine_config.items())))


def identity(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    _keep_alive[id(value)] = value
    return ("object", id(value))


def describe_model(model: Any) -> str:
    """A display name for a model source, found without loading anything."""
    if model is None:
        return DEFAULT_MODEL
    if isinstance(model, str):
        return model
    if isinstance(model, AsyncEngine):
        model = model.engine
    if isinstance(model, (LLM, Engine)):
        model = model.model
    return getattr(model, "name_or_path", "") or type(model).__name__


def shutdown_engines() -> None:
    """Stop every registered engine thread, adopted ones included, and forget them."""
    with _lock:
        for aengine in {id(e): e for e in _engines.values()}.values():
            aengine.shutdown()
        _engines.clear()
        _keep_alive.clear()
