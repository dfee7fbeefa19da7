"""Logprobs in OpenAI's shapes, for every front end that reports them (the server, `PagedLLM`, `ChatPaged`).

A generated position is (token id, its `{token id: Logprob}` entry); the entry holds the sampled
token and the top-k alternatives, ranked from 1 (the sampled token has no rank when outside them).
"""

from __future__ import annotations

from typing import Any

from paged_backend.core.outputs import CompletionOutput, Logprob

Position = tuple[int, dict[int, Logprob]]


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def top_entries(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The top-k alternatives of one position, best first."""
    ranked = sorted(((tid, lp) for tid, lp in entry.items() if lp.rank is not None), key=lambda x: x[1].rank)
    return ranked[:k]


def positions(completion: CompletionOutput, num_tokens: int | None = None) -> list[Position]:
    """(token id, logprob entry) for the last num_tokens generated tokens (all when None)."""
    ids, entries = completion.token_ids, completion.logprobs or []
    start = 0 if num_tokens is None else max(0, len(ids) - num_tokens)
    return list(zip(ids[start:], entries[start:]))


def completion_logprobs(tokenizer: Any, pairs: list[Position], k: int, offset: int = 0) -> dict[str, list[Any]]:
    """The completions shape: tokens, token_logprobs, top_logprobs (None per position when k is 0),
    text_offset (each token's start in the text, counting from `offset`)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for token_id, entry in pairs:
        text = token_text(tokenizer, token_id)
        tokens.append(text)
        token_lps.append(entry[token_id].logprob)
        tops.append({token_text(tokenizer, t): lp.logprob for t, lp in top_entries(entry, k)} if k else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer: Any, pairs: list[Position], k: int) -> dict[str, Any]:
    """The chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    return {"content": [
        dict(token_logprob(tokenizer, token_id, entry[token_id]),
             top_logprobs=[token_logprob(tokenizer, t, lp) for t, lp in top_entries(entry, k)])
        for token_id, entry in pairs
    ]}


def token_logprob(tokenizer: Any, token_id: int, logprob: Logprob) -> dict[str, Any]:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": logprob.logprob, "bytes": list(text.encode("utf-8"))}
