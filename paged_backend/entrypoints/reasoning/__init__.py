"""Reasoning models: splitting an answer's thinking from its content, for every front end.

The seam (see ARCHITECTURE.md): `resolve_reasoning_parser(name, tokenizer)` gives a `ReasoningParser`
(None: no parsing); `parser.opens_thinking(prompt_tail)` says whether the rendered prompt left the
thinking open; `ReasoningStream(parser, opened)` splits streamed text (`push` / `finish`), and
`parser.split(text, opened)` a whole answer the same way; `budget_processor` is the logits processor
of `thinking_token_budget`; `reasoning_tokens` counts the thinking for usage; `after_thinking` holds a
request's grammar to the answer after the thinking.
"""

from .answer_grammar import after_thinking
from .budget import budget_processor
from .parser import (
    AUTO,
    NONE,
    PARSERS,
    ReasoningParser,
    detect_reasoning_parser,
    get_reasoning_parser,
    reasoning_parser_names,
    resolve_reasoning_parser,
)
from .stream import ReasoningStream, Split
from .usage import reasoning_tokens

__all__ = ["AUTO", "NONE", "PARSERS", "ReasoningParser", "ReasoningStream", "Split", "after_thinking", "budget_processor",
           "detect_reasoning_parser", "get_reasoning_parser", "prompt_tail", "reasoning_parser_names",
           "reasoning_tokens", "resolve_reasoning_parser"]


def prompt_tail(tokenizer, prompt_ids: list[int], tokens: int = 32) -> str:
    """The text of a prompt's last tokens (markers kept): enough to see whether it opened the thinking."""
    return tokenizer.decode(prompt_ids[-tokens:], skip_special_tokens=False)
