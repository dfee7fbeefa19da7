"""LangChain's standard chat-model suites (langchain-tests) for ChatPaged on the default model.

Skipped groups, and why:
- tool calling, tool choice, tool message histories, structured output, agent loop, unicode
  tool calls: the default model's ChatML template does not render tools (ChatPaged then describes
  them Hermes style in the system turn), so these run in test_langchain_tools.py, on the same weights
  with a template that renders tools.
- json mode: the standard test needs the model to pick the keys its prompt names; ChatPaged's json
  mode holds the answer to any JSON object (tested in test_langchain_tools.py), but the keys are the
  model's choice and the 135M model names only "setup", not "punchline". The json_schema path, which
  fixes the keys, is tested in test_langchain_tools.py.
- image, audio, video and PDF inputs, image and PDF tool messages, Anthropic-format inputs:
  ChatPaged is text only and refuses other content blocks.
- per-call model override: one ChatPaged drives one engine; a call's `model=` is refused.
- init from environment, serialisation: nothing is configured from the environment, and the
  model field may hold live objects (a loaded model, an engine), so ChatPaged is not serialisable.
- stream time benchmark: needs VCR cassettes, for network models only.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers.engine import peak_in_flight as record_peak
from langchain_core.messages import AIMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests
from paged_backend.integrations.langchain import ChatPaged

# Slow tier: compiles models or runs a whole client suite; `-m "not slow"` leaves it out (CI runs it).
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


class TestChatPagedUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatPaged]:
        return ChatPaged

    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        # api_key and max_retries are options of network clients; ChatPaged refuses unknown
        # options instead of ignoring them, so they are left out here.
        params = super().standard_chat_model_params
        return {k: v for k, v in params.items() if k not in ("api_key", "max_retries")}

    @property
    def supports_model_override(self) -> bool:
        return False


class TestChatPagedIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatPaged]:
        return ChatPaged

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # Greedy and short, so the suite fits the time budget of a 2-core machine. The integration
        # suite never passes max_tokens or stop in a way that collides with these (only the unit
        # suite's test_standard_params does, and the unit class above keeps them out).
        return {"temperature": 0, "max_tokens": 12}

    @property
    def has_tool_calling(self) -> bool:
        return False  # see the module docstring: run in test_langchain_tools.py

    @property
    def has_structured_output(self) -> bool:
        return False  # see the module docstring: run in test_langchain_tools.py

    @property
    def supports_model_override(self) -> bool:
        return False

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[str]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        model = ChatPaged(temperature=0, max_tokens=4)
        if not stream:
            return model.invoke("Hello")
        full = None
        for chunk in model.stream("Hello"):
            full = chunk if full is None else full + chunk
        return full


# ---------------------------------------------------------------------- ChatPaged's own batching


@pytest.fixture()
def peak_in_flight() -> Any:
    """Records, before every engine step, how many requests the shared engine holds."""
    with record_peak(ChatPaged().async_engine.engine) as peaks:
        yield peaks


def test_batch_has_every_conversation_in_flight(peak_in_flight: list[int]) -> None:
    # Runnable.batch's default pool runs min(32, cpu + 4) = 6 at a time on this machine.
    results = ChatPaged(temperature=0, max_tokens=4).batch([f"Say {i}" for i in range(10)])
    assert len(results) == 10 and peak_in_flight[0] == 10


async def test_abatch_has_every_conversation_in_flight(peak_in_flight: list[int]) -> None:
    results = await ChatPaged(temperature=0, max_tokens=4).abatch([f"Say {i}" for i in range(10)])
    assert len(results) == 10 and peak_in_flight[0] == 10


def test_stream_reports_usage_once_and_model_name() -> None:
    chat = ChatPaged(temperature=0, max_tokens=6)
    messages = [("system", "Be brief."), ("human", "Hi")]
    chunks = list(chat.stream(messages))
    assert sum(1 for c in chunks if c.usage_metadata) == 1
    assert chunks[-1].chunk_position == "last" and chunks[-1].usage_metadata["output_tokens"] >= 1
    # The same conversation again finds every full block of its prompt cached (the last token is recomputed).
    usage = list(chat.stream(messages))[-1].usage_metadata
    block_size = chat.async_engine.engine.kv.block_size
    assert usage["input_token_details"]["cache_read"] == (usage["input_tokens"] - 1) // block_size * block_size > 0
    assert chunks[-1].response_metadata["model_name"] == "SmolLM2-135M-Instruct"
