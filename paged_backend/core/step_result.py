"""StepResult: what one step's forward and sampling produced; RequestUpdate: what it changed of a request.

The engine makes the result; the scheduler takes it in (`Scheduler.update_from_output`) and answers with one
update per request that changed, which the output processor turns into the user's outputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from paged_backend.core.request import Request
    from paged_backend.sampling.sampler import SamplerOutput


class StepResult(NamedTuple):
    sampled: SamplerOutput  # every sampler row of the step
    sampling_requests: list[Request]  # the requests that sampled, in row order
    kept: list[list[int]]  # per sampling request: the tokens it keeps (agreeing proposals, then the next token)
    rows: list[int]  # per sampling request: the sampler row of its first kept token
    pooled: list[Request]  # the step's pooling requests


class RequestUpdate(NamedTuple):
    request: Request
    new_token_ids: list[int]  # the tokens appended this step (a stop may have ended it before all it kept)
    row: int  # the sampler row of its first new token
    # Whether its group had finished once this request was updated: the group's final output is made once,
    # after the last of its samples to finish, even when several finish in one step.
    group_finished: bool
