"""thinking_token_budget: past this many thinking tokens, the end marker is forced and the answer follows.

A per-request logits processor, so the engine needs nothing new: it reads the request's output ids,
finds where the thinking opened (in the prompt, or at the start marker's tokens) and whether the end
marker's tokens followed; once the thinking holds `budget` tokens it forces the end marker's tokens
one by one. It keeps no state between calls, so each of a request's n samples is held alike, and a
recomputed (preempted) request sees the same decisions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .parser import ReasoningParser
from .token_search import find, marker_ids

# (output ids, logits row [V]) -> row: the engine's per-request processor (core/request.py), named here
# without importing the engine, since front ends and LLM share this module.
LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]


def budget_processor(tokenizer: Any, parser: ReasoningParser, budget: int, opened: bool) -> LogitsProcessor:
    """The processor that closes the thinking after `budget` tokens of it (0: no thinking at all)."""
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise ValueError(f"thinking_token_budget must be an integer >= 0, got {budget!r}")
    start_ids, end_ids = marker_ids(tokenizer, parser.start), marker_ids(tokenizer, parser.end)

    def close_thinking(output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        begin = 0
        if not opened:
            at = find(output_ids, start_ids)
            if at < 0:
                return row
            begin = at + len(start_ids)
        if find(output_ids, end_ids, begin) >= 0:
            return row
        written = len(output_ids) - begin - budget  # end-marker tokens forced so far, once past the budget
        if written < 0 or written >= len(end_ids) or list(output_ids[begin + budget:]) != end_ids[:written]:
            return row
        forced = end_ids[written]
        value = row[forced].clone()
        row.fill_(float("-inf"))
        row[forced] = torch.where(torch.isfinite(value), value, torch.zeros_like(value))
        return row

    return close_thinking
