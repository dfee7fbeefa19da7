"""The checks a request passes before it is queued, shared by the engine and clients that check
requests on its behalf (a replicated engine refuses a bad request before it travels to a replica).

Both raise ValueError naming what is wrong, so every front end accepts and refuses exactly what one
engine does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from paged_backend.sampling.sampling_params import SamplingParams


def tokenize_prompt(tokenizer: Any, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
    """(the text or None, the token ids) of a text or token-id prompt."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids or give the engine a tokenizer")
        return prompt, tokenizer(prompt)["input_ids"]
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise ValueError("a prompt must be a string or a sequence of int token ids")
    return None, list(prompt)


def check_request(token_ids: list[int], params: SamplingParams, *, max_model_len: int, vocab_size: int,
                  has_tokenizer: bool, can_constrain: bool, context_note: str = "") -> None:
    """`can_constrain`: the engine can build grammars (it has a vocabulary to constrain); `context_note`
    says why the context is shorter than the model's positions, when it is."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")  # noqa: TRY004  (a ValueError, as every refusal)
    params.validate()
    token_ids = params.kept_prompt(token_ids, max_model_len)  # what the engine's intake will run
    if not token_ids:
        raise ValueError("the prompt is empty")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(token_ids)} tokens; this engine's context length is {max_model_len}"
            f"{context_note}, which must also leave room for at least one generated token"
        )
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if params.stop and not has_tokenizer:
        raise ValueError("stop strings need a tokenizer")
    if params.structured_outputs is not None and not can_constrain:
        raise ValueError("structured_outputs need a tokenizer (its vocabulary is what the grammar constrains)")
