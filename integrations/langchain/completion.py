"""Completion: the assistant text of one chat call (written for the model, then by it) and its usage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paged_backend import CompletionOutput, RequestOutput


@dataclass(slots=True)
class Completion:
    """The assistant text of one call (what was written for the model, then what it wrote), with usage."""

    text: str
    delta: str
    finish_reason: str | None
    usage: dict[str, Any]
    token_ids: list[int]
    logprobs: list | None

    @classmethod
    def of(cls, output: RequestOutput, written: str, index: int = 0) -> Completion:
        completion = output.outputs[index]
        first = len(completion.token_ids) == len(output.delta_token_ids)  # written text goes out with the first delta
        return cls(text=written + completion.text, delta=(written if first else "") + output.delta_text,
                   finish_reason=completion.finish_reason if output.finished else None,
                   usage=usage(output, completion), token_ids=completion.token_ids, logprobs=completion.logprobs)

    def then(self, later: Completion) -> Completion:
        """This step followed by a later one of the same call: the later text, output tokens added up."""
        output_tokens = self.usage["output_tokens"] + later.usage["output_tokens"]
        summed = {**self.usage, "output_tokens": output_tokens, "total_tokens": self.usage["input_tokens"] + output_tokens}
        logprobs = None if self.logprobs is None else self.logprobs + (later.logprobs or [])
        return Completion(later.text, later.text, later.finish_reason, summed, self.token_ids + later.token_ids, logprobs)


def usage(output: RequestOutput, completion: CompletionOutput) -> dict[str, Any]:
    """Token counts of one sample; cache_read is the prompt tokens served from the prefix cache."""
    prompt = len(output.prompt_token_ids)
    generated = len(completion.token_ids)
    return {"input_tokens": prompt, "output_tokens": generated, "total_tokens": prompt + generated,
            "input_token_details": {"cache_read": output.num_cached_tokens}}


def openai_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[dict]) -> list[dict[str, Any]]:
    """OpenAI chat shape: per token, its text, logprob and the ranked alternatives."""
    entries = []
    for token_id, candidates in zip(token_ids, logprobs):
        ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in candidates.items() if lp.rank)
        entries.append({"token": tokenizer.decode([token_id]), "logprob": candidates[token_id].logprob,
                        "top_logprobs": [{"token": tokenizer.decode([tid]), "logprob": lp} for _, tid, lp in ranked]})
    return entries
