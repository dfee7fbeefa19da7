"""What each front end samples with when the caller says nothing: one table, one policy.

Greedy or sampling is decided here and nowhere else. The engine samples by default (temperature 1.0,
vLLM's and OpenAI's default), so `LLM`, the engine and the OpenAI-compatible server behave as the APIs
they copy. A front end departs from that only where its own ecosystem has another convention:

- LangChain (`PagedLLM`, `ChatPaged`): temperature 0.7 and 512 tokens, the defaults LangChain's OpenAI
  chat models long shipped with, so a chain moved onto this backend keeps its behaviour.
- The `paged-backend` command: greedy (0.0) and 256 tokens: a terminal tool gives the same answer to the
  same prompt, and an answer long enough to read.
- transformers `generate`: whatever the model's GenerationConfig says (`do_sample`, `max_new_tokens`),
  as `generate` itself does; there is no default of ours to apply.

A field a front end leaves out of its row takes `SamplingParams`' own default.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

GREEDY = 0.0

ENGINE: dict[str, Any] = {}  # SamplingParams' own defaults: temperature 1.0, max_tokens 16
OPENAI: dict[str, Any] = {"temperature": 1.0, "top_k": -1, "completion_max_tokens": 16, "chat_max_tokens": None}
LANGCHAIN: dict[str, Any] = {"temperature": 0.7, "max_tokens": 512}
CLI: dict[str, Any] = {"temperature": GREEDY, "max_tokens": 256}

DEFAULTS = MappingProxyType({"engine": ENGINE, "openai": OPENAI, "langchain": LANGCHAIN, "cli": CLI})
