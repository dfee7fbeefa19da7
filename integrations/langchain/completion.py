"""Completion: the assistant text of one chat call and its usage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paged_backend.core.outputs import CompletionOutput, RequestOutput


@dataclass(slots=True)
class Completion:
    """The assistant text of one call (all of it, and the part new in this output), with usage."""

    text: str
    delta: str
    finish_reason: str | None
    usage: dict[str, Any]
    token_ids: list[int]
    logprobs: list | None
    stop_reason: int | str | None = None

    @classmethod
    def of(cls, output: RequestOutput, index: int = 0) -> Completion:
        completion = output.outputs[index]
        return cls(text=completion.text, delta=output.delta_text,
                   finish_reason=completion.finish_reason if output.finished else None,
                   usage=usage(output, completion), token_ids=completion.token_ids, logprobs=completion.logprobs,
                   stop_reason=completion.stop_reason)

    def without_eos(self, text: str, eos_texts: tuple[str, ...]) -> str:
        """`text` (all of it, or the last delta) less the decoded EOS that ended it: special tokens are kept
        (for a marker's sake) only when a format needs them, and then the engine decodes the EOS too."""
        if self.finish_reason == "stop" and self.stop_reason is None:
            for eos in eos_texts:
                if text.endswith(eos):
                    return text[:-len(eos)]
        return text


def usage(output: RequestOutput, completion: CompletionOutput) -> dict[str, Any]:
    """Token counts of one sample; cache_read is the prompt tokens served from the prefix cache."""
    prompt = len(output.prompt_token_ids)
    generated = len(completion.token_ids)
    return {"input_tokens": prompt, "output_tokens": generated, "total_tokens": prompt + generated,
            "input_token_details": {"cache_read": output.num_cached_tokens}}
