"""SchedulerOutput: what one step runs, as plain data.

The scheduler makes it; the model runner packs it into one forward, the speculator drafts for it and the
engine samples its rows. None of them needs the scheduler to read it, so they import this module only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from paged_backend.core.request import Request


class SchedulerOutput(NamedTuple):
    requests: list[Request]  # running requests first (oldest first), then the ones admitted this step
    num_new_tokens: list[int]  # per request: the tokens it computes this step, proposals included
    # Indices of requests whose `num_new_tokens - 1` proposals a draft model makes before the forward.
    drafts: list[int]
