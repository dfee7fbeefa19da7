"""How many of an answer's tokens were thinking: OpenAI's `completion_tokens_details.reasoning_tokens`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .token_search import find, marker_ids

if TYPE_CHECKING:
    from .base import ReasoningParser


def reasoning_tokens(tokenizer: Any, parser: ReasoningParser, token_ids: Sequence[int], opened: bool) -> int:
    """How many of `token_ids` (an answer) were thinking, as `parser`'s format marks it."""
    return parser.reasoning_tokens(tokenizer, token_ids, opened)


def marked_thinking_tokens(tokenizer: Any, parser: ReasoningParser, token_ids: Sequence[int], opened: bool) -> int:
    """For a thinking between a pair of markers: the tokens from the start of the thinking through its end
    marker (all of them while it is unclosed); 0 for an answer that never thought. Markers are found by
    their token ids, as the model wrote them."""
    ids = list(token_ids)
    begin = 0
    if not opened:
        at = find(ids, marker_ids(tokenizer, parser.start)) if ids else -1
        if at < 0:
            return 0
        begin = at + len(marker_ids(tokenizer, parser.start))
    end_ids = marker_ids(tokenizer, parser.end)
    at = find(ids, end_ids, begin) if ids else -1
    return len(ids) if at < 0 else at + len(end_ids)
