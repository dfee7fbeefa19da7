"""LangChain adapters on the shared paged engine: PagedLLM (a BaseLLM), ChatPaged (a BaseChatModel) and
PagedEmbeddings (an Embeddings)."""

from .chat import ChatPaged
from .embeddings import PagedEmbeddings
from .engines import get_async_engine, shutdown_engines
from .llm import PagedLLM
from .tool_calls import HERMES_TOOL_TEMPLATE

__all__ = ["ChatPaged", "HERMES_TOOL_TEMPLATE", "PagedEmbeddings", "PagedLLM", "get_async_engine", "shutdown_engines"]
