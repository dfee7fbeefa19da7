"""Prompt logprobs: the model's log probability of each prompt token given the tokens before it.

A request asks with `SamplingParams(prompt_logprobs=k)`. Position p's logits predict token p + 1, so
while its prompt is prefilled (in one step or in chunks) the runner also keeps the logits rows of its
positions whose next token is still a prompt token, and the engine records them here, vLLM's shape:
`[None, {token: Logprob}, ...]`, one entry per prompt token, the first having no context. Such a
request skips the prefix cache (a cached block has no logits), and a preempted one that recomputes its
prompt records each position once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from paged_backend.core.outputs import Logprob
from paged_backend.core.request import Request
from paged_backend.sampling.sampler import on_device, to_host


class PromptSpan(NamedTuple):
    """Rows `[row, row + count)` of a step's kept logits score prompt tokens `[first, first + count)`."""

    request: Request
    first: int
    count: int


def wanted_targets(request: Request, start: int, end: int) -> tuple[int, int]:
    """(first target, count): the prompt tokens still unscored whose predicting position is in [start, end)."""
    recorded = len(request.prompt_logprobs)
    first = max(recorded, start + 1)
    last = min(request.num_prompt_tokens - 1, end)
    return first, max(0, last - first + 1)


def record(logits: torch.Tensor, spans: list[PromptSpan]) -> None:
    """Append each span's entries to its request, from the span rows of `logits [R, V]` in order."""
    if not spans:
        return
    target_list = [t for s in spans for t in s.request.prompt_token_ids[s.first:s.first + s.count]]
    targets = on_device(target_list, logits.device, torch.long)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    k = max(s.request.params.prompt_logprobs for s in spans)
    top = logprobs.topk(k, dim=-1) if k else None
    if top is None:
        (chosen_list, rank_list), top_ids, top_values = to_host(chosen[:, 0], ranks), None, None
    else:
        chosen_list, rank_list, top_ids, top_values = to_host(chosen[:, 0], ranks, top.indices, top.values)
    row = 0
    for span in spans:
        k_here = span.request.params.prompt_logprobs
        for _ in range(span.count):
            entry = {target_list[row]: Logprob(chosen_list[row], rank_list[row])}
            if k_here:
                for rank, (tid, value) in enumerate(zip(top_ids[row][:k_here], top_values[row][:k_here]), start=1):
                    entry.setdefault(tid, Logprob(value, rank))
            span.request.prompt_logprobs.append(entry)
            row += 1
