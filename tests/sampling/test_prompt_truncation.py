"""truncate_prompt_tokens: the engine keeps only a prompt's last k tokens, at its request intake, so every
front end that passes the option gets the same truncation."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.engine import assert_all_blocks_free, greedy, run_to_completion
from helpers.models import build

from paged_backend import Engine, EngineConfig, SamplingParams

PROMPT = [(7 * i) % 250 + 1 for i in range(40)]


@pytest.fixture(scope="module")
def engine():
    return Engine(build("llama"), None, EngineConfig(num_kv_blocks=64, block_size=4, max_model_len=64))


def answer(engine: Engine, prompt: list[int], params: SamplingParams):
    request_id = engine.add_request(prompt, params)
    return run_to_completion(engine)[request_id]


def test_the_output_is_that_of_the_truncated_prompt(engine):
    kept = answer(engine, PROMPT, dataclasses.replace(greedy(6), truncate_prompt_tokens=9))
    alone = answer(engine, PROMPT[-9:], greedy(6))
    assert kept.prompt_token_ids == PROMPT[-9:]
    assert kept.outputs[0].token_ids == alone.outputs[0].token_ids
    full = answer(engine, PROMPT, greedy(6))
    assert full.prompt_token_ids == PROMPT  # without the option nothing is cut
    assert answer(engine, PROMPT[:5], dataclasses.replace(greedy(2), truncate_prompt_tokens=9)).prompt_token_ids \
        == PROMPT[:5]  # a shorter prompt is kept whole
    assert_all_blocks_free(engine)


def test_minus_one_keeps_what_the_context_holds(engine):
    """A prompt longer than the context, refused as it is, runs with its last max_model_len - 1 tokens."""
    long_prompt = PROMPT * 2  # 80 tokens, context 64
    with pytest.raises(ValueError, match="context length is 64"):
        engine.add_request(long_prompt, greedy(1))
    kept = answer(engine, long_prompt, dataclasses.replace(greedy(1), truncate_prompt_tokens=-1))
    assert kept.prompt_token_ids == long_prompt[-63:] and len(kept.outputs[0].token_ids) == 1
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("value", [0, -2, 2.5, True, "8"])
def test_an_invalid_value_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=value)
