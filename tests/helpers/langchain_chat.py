"""ChatPaged over a scripted client (helpers/scripted.py): a chat model whose next answer is `script`."""

from __future__ import annotations

from langchain_core.messages import AIMessageChunk
from paged_backend.integrations.langchain import ChatPaged

from helpers.scripted import ScriptedClient


def chat(client: ScriptedClient, script: str, **fields) -> ChatPaged:
    client.script = script
    model = ChatPaged(temperature=0.0, max_tokens=80, **fields)
    model._aengine = client  # the scripted client in place of a built engine
    return model


def joined(chunks: list[AIMessageChunk]) -> AIMessageChunk:
    """The streamed chunks added up, as LangChain joins them."""
    total = chunks[0]
    for chunk in chunks[1:]:
        total += chunk
    return total
