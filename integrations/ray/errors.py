"""Errors of the replicated engine, and the failed RequestOutput a request ends with."""

from __future__ import annotations

import dataclasses
import time

from paged_backend import CompletionOutput, RequestMetrics, RequestOutput


class NoLiveReplicaError(RuntimeError):
    """Every replica that could take the request is dead (or was already tried for it)."""


def failed_output(request_id: str, prompt: str | None, token_ids: list[int], error: str,
                  last: RequestOutput | None = None) -> RequestOutput:
    """A finished output carrying `error`; it keeps whatever the caller already received in `last`."""
    if last is not None:
        completion = dataclasses.replace(last.outputs[0], finish_reason="abort", stop_reason=None)
        return dataclasses.replace(last, outputs=[completion], finished=True, error=error, delta_text="",
                                   delta_token_ids=[])
    return RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=list(token_ids),
                         outputs=[CompletionOutput(0, "", [], finish_reason="abort")], finished=True,
                         metrics=RequestMetrics(arrival_time=time.time()), error=error)
