"""LangChain adapters on the shared paged engine: PagedLLM (a BaseLLM) and ChatPaged (a BaseChatModel)."""

from .chat import ChatPaged
from .engines import get_async_engine, shutdown_engines
from .llm import PagedLLM
from .tool_calls import HERMES_TOOL_TEMPLATE

__all__ = ["ChatPaged", "HERMES_TOOL_TEMPLATE", "PagedLLM", "get_async_engine", "shutdown_engines"]
