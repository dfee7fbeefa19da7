"""Token rules: a value's rule (JSON number grammar, literal options) as the engine's per-request logits
processor over the tokenizer's vocabulary, and the sampling parameters of one value's request.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from paged_backend import SamplingParams

from .writers import (
    INTEGER,
    INTEGER_PREFIX,
    NUMBER,
    NUMBER_PREFIX,
    Ask,
    ChoiceRule,
    NumberRule,
    Rule,
)

NUMBER_TOKENS_MAX = 24
# A token that may take part in a number: optional leading space, number characters, then perhaps a delimiter.
NUMBER_TOKEN = re.compile(r"\s*[-+.0-9eE]*(?:[,}\]\n].*)?", re.DOTALL)
DELIMITER = re.compile(r"[,}\]\n]")


class TokenVocab:
    """Each token's text, looked up both ways; built once per tokenizer (a few hundred ms)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        self.by_text: dict[str, list[int]] = {}
        for i, text in enumerate(self.texts):
            self.by_text.setdefault(text, []).append(i)
        self.number_tokens = [(i, t) for i, t in enumerate(self.texts) if t and NUMBER_TOKEN.fullmatch(t)]
        eos = tokenizer.eos_token_id
        self.eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


_vocabs: dict[int, TokenVocab] = {}


def vocab_for(tokenizer: Any) -> TokenVocab:
    vocab = _vocabs.get(id(tokenizer))
    if vocab is None or vocab.tokenizer is not tokenizer:
        vocab = _vocabs[id(tokenizer)] = TokenVocab(tokenizer)
    return vocab


def value_processor(rule: Rule, vocab: TokenVocab) -> Callable[[list[int], torch.Tensor], torch.Tensor]:
    """The engine logits processor that keeps a value's tokens inside `rule`."""
    allowed_ids = allowed_number_ids if isinstance(rule, NumberRule) else allowed_choice_ids

    def process(output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        size = row.shape[-1]  # the model's vocabulary may be smaller or larger than the tokenizer's
        allowed = [i for i in allowed_ids(rule, vocab, vocab.decode(output_ids)) if i < size]
        if not allowed:  # nothing fits (a tokenizer quirk): leave the model free rather than stall
            return row
        keep = torch.full_like(row, float("-inf"))
        index = torch.tensor(allowed, device=row.device)
        keep[index] = row[index]
        return keep

    return process


def allowed_number_ids(rule: NumberRule, vocab: TokenVocab, written: str) -> list[int]:
    prefix, whole = (INTEGER_PREFIX, INTEGER) if rule.integer else (NUMBER_PREFIX, NUMBER)
    written = rule.prefix + written if rule.prefix else written.lstrip()
    allowed = [i for i in vocab.eos_ids if whole.fullmatch(written)]
    for token_id, text in vocab.number_tokens:
        candidate = written + text if written else text.lstrip()
        end = DELIMITER.search(candidate)
        if end is None:
            if candidate and prefix.fullmatch(candidate):
                allowed.append(token_id)
        elif whole.fullmatch(candidate[: end.start()]):
            allowed.append(token_id)
    return allowed


def allowed_choice_ids(rule: ChoiceRule, vocab: TokenVocab, written: str) -> list[int]:
    allowed: set[int] = set()
    for option in rule.options:
        if option == written:
            allowed.update(vocab.eos_ids)
        elif option.startswith(written):
            rest = option[len(written):]
            for k in range(1, len(rest) + 1):
                allowed.update(vocab.by_text.get(rest[:k], ()))
    return sorted(allowed) if allowed else list(vocab.eos_ids)


def value_params(ask: Ask, params: SamplingParams, generated: int = 0) -> SamplingParams | None:
    """The user's sampling settings for one value's request: its stops, EOS on, a short cap for rules,
    and what is left of the call's max_tokens after the `generated` tokens of earlier values. None once
    that is spent: the writer then gets `default_answer`, so the JSON still closes."""
    max_tokens = None if params.max_tokens is None else params.max_tokens - generated
    if max_tokens is not None and max_tokens <= 0:
        return None
    if isinstance(ask.rule, NumberRule):
        max_tokens = min(max_tokens or NUMBER_TOKENS_MAX, NUMBER_TOKENS_MAX)
    elif isinstance(ask.rule, ChoiceRule):
        longest = max(len(o) for o in ask.rule.options) + 1  # a token is at least one character
        max_tokens = min(max_tokens or longest, longest)
    stops = list(dict.fromkeys([*params.stop, *ask.stops]))
    return replace(params, n=1, best_of=None, stop=stops, max_tokens=max_tokens, min_tokens=0, ignore_eos=False)
