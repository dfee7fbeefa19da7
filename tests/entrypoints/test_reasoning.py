"""Reasoning parsers: the split of thinking and answer, streamed in any chunking and at once; markers
never reach the content; detection from templates; the budget processor; reasoning-token counts."""

from __future__ import annotations

import pytest
import torch
from helpers.chunks import chunkings

from paged_backend.entrypoints.reasoning import (
    budget_processor,
    detect_reasoning_parser,
    get_reasoning_parser,
    reasoning_tokens,
    resolve_reasoning_parser,
)

QWEN3, R1, MISTRAL, HARMONY = (get_reasoning_parser(n) for n in ("qwen3", "deepseek_r1", "mistral", "harmony"))

CASES = [
    (QWEN3, False, "<think>\nLet me see.\n</think>\n\nThe answer is 4.", "Let me see.\n", "The answer is 4."),
    (QWEN3, False, "The answer is 4.", None, "The answer is 4."),
    (QWEN3, True, "Let me see.</think>4", "Let me see.", "4"),  # the prompt opened it
    (QWEN3, False, "<think>cut by max_tokens", "cut by max_tokens", ""),
    (R1, R1.opens_thinking("<|Assistant|>"), "Let me see.</think>\n\n4", "Let me see.", "4"),  # R1: open by default
    (MISTRAL, False, "[THINK]Hmm.[/THINK]Yes.", "Hmm.", "Yes."),
    (QWEN3, False, "a <think>b</think> c </think>d<think>e", "be", "a c d"),  # stray markers are dropped too
    # gpt-oss (harmony): the analysis channel is the thinking, the final channel the answer.
    (HARMONY, False, "<|channel|>analysis<|message|>Let me see.<|end|><|start|>assistant<|channel|>final<|message|>4",
     "Let me see.", "4"),
    (HARMONY, True, "Let me see.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>", "Let me see.", "4"),
    (HARMONY, False, "<|channel|>final<|message|>4", None, "4"),
]


@pytest.mark.parametrize(("parser", "opened", "text", "reasoning", "content"), CASES)
def test_split_streamed_or_not(parser, opened: bool, text: str, reasoning, content: str) -> None:
    assert parser.split(text, opened) == (reasoning, content)
    for pieces in chunkings(text, seeds=5, longest=6):
        stream = parser.stream(opened)
        outs = [stream.push(p) for p in pieces] + [stream.finish()]
        assert "".join(o.reasoning for o in outs) == (reasoning or "")
        assert "".join(o.content for o in outs) == content
        assert not any(m in o.content for o in outs for m in parser.markers)


def test_the_prompt_says_whether_the_thinking_is_open() -> None:
    assert QWEN3.opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not QWEN3.opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking=False
    assert not QWEN3.opens_thinking("<|im_start|>assistant\n")
    assert R1.opens_thinking("<|Assistant|>") and not R1.opens_thinking("<think></think>")


def test_detection_and_names() -> None:
    assert detect_reasoning_parser("{{ '<think>' }}x{{ '</think>' }}") is QWEN3
    assert detect_reasoning_parser("[THINK] ... [/THINK]") is MISTRAL
    assert detect_reasoning_parser("{{ '<｜Assistant｜>' }}{{ c.split('</think>')[-1] }}<think>") is R1
    assert detect_reasoning_parser("{{ messages }}") is None
    assert detect_reasoning_parser("<think></think>[THINK][/THINK]") is None  # two formats: not unambiguous
    with pytest.raises(ValueError, match="reasoning_parser='nope'.*known: \\['deepseek_r1', 'harmony', 'mistral', 'qwen3'\\]"):
        get_reasoning_parser("nope")
    assert resolve_reasoning_parser("none", None) is None and resolve_reasoning_parser(None, None) is None


class Tokens:
    """A tokenizer whose markers are single tokens: <think> 1, </think> 2, words 10+."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return {"<think>": [1], "</think>": [2]}[text]


def forced(processor, output_ids: list[int]) -> int | None:
    row = processor(output_ids, torch.zeros(16))
    return int(row.argmax()) if torch.isinf(row).any() else None


def test_the_budget_forces_the_end_marker_then_lets_go() -> None:
    closing = budget_processor(Tokens(), QWEN3, 3, opened=False)
    assert forced(closing, [10, 11]) is None  # not thinking
    assert forced(closing, [1, 10, 11]) is None  # 2 of 3
    assert forced(closing, [1, 10, 11, 12]) == 2  # 3 of 3: close
    assert forced(closing, [1, 10, 11, 12, 2, 13]) is None  # closed: the answer is free
    assert forced(closing, [1, 10, 2, 13]) is None  # closed by the model itself
    opened = budget_processor(Tokens(), QWEN3, 2, opened=True)
    assert forced(opened, [10]) is None and forced(opened, [10, 11]) == 2
    assert forced(budget_processor(Tokens(), QWEN3, 0, opened=True), []) == 2
    with pytest.raises(ValueError, match="thinking_token_budget"):
        budget_processor(Tokens(), QWEN3, -1, opened=False)


def test_reasoning_tokens_count_through_the_end_marker() -> None:
    assert reasoning_tokens(Tokens(), QWEN3, [1, 10, 11, 2, 12], opened=False) == 4
    assert reasoning_tokens(Tokens(), QWEN3, [10, 11], opened=False) == 0
    assert reasoning_tokens(Tokens(), QWEN3, [10, 2, 11], opened=True) == 2
    assert reasoning_tokens(Tokens(), QWEN3, [10, 11], opened=True) == 2  # unclosed: all thinking
