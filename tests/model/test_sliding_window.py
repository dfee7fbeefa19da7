"""Sliding-window models end to end: engine greedy output equals HF generate when the window is
shorter than the prompts, so keys outside the window must be masked in prefill, chunks and decode."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from helpers.engine import check_against_hf, hf_greedy, mixed_prompts
from helpers.models import VOCAB, build_from_config
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    sliding_window_causal_mask_function,
)

from paged_backend.model.paged.step_context import StepContext, step_context
from paged_backend import EngineConfig
from paged_backend.model.paged import attention

WINDOW = 8
MAX_NEW = 12


def common() -> dict:
    return {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "max_position_embeddings": 512, "num_attention_heads": 4, "num_key_value_heads": 2}


CONFIGS = {
    # Every layer slides.
    "mistral": lambda: tf.MistralConfig(sliding_window=WINDOW, **common()),
    # Layer 0 attends to everything, layer 1 slides: both kinds in one model.
    "qwen2": lambda: tf.Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **common()),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request):
    model = build_from_config(CONFIGS[request.param])
    prompts = mixed_prompts(8)
    assert max(len(p) for p in prompts) > 3 * WINDOW
    return model, prompts, [hf_greedy(model, p, MAX_NEW) for p in prompts]


def test_the_window_changes_the_answer(case):
    """Guards the test itself: the same weights without a window answer differently."""
    model, prompts, refs = case
    config = model.config.to_dict()
    config.update(sliding_window=None, use_sliding_window=False)
    config.pop("layer_types", None)
    full = build_from_config(lambda: type(model.config).from_dict(config))
    assert [hf_greedy(full, p, MAX_NEW) for p in prompts] != refs


@pytest.mark.parametrize("config", [
    {"num_kv_blocks": 128, "block_size": 4},
    {"num_kv_blocks": 128, "block_size": 4, "max_num_batched_tokens": 16},  # prompts prefilled in chunks
], ids=["whole-prompts", "chunked"])
def test_engine_matches_hf_with_a_window_shorter_than_the_prompts(case, config):
    model, prompts, refs = case
    check_against_hf(model, prompts, refs, EngineConfig(**config), MAX_NEW, late_from=5)


def test_no_mask_is_built_inside_an_engine_step():
    """The paged attention masks by position and reads no mask: inside a step the mask function builds none
    (transformers would build one for a window layer's step of a window or more: in a compiled forward, a
    shape condition of its own), while outside the engine the model still gets transformers' mask."""
    attention.register()
    mask = ALL_MASK_ATTENTION_FUNCTIONS[attention.ATTENTION_NAME]
    step = {"batch_size": 1, "q_length": 2 * WINDOW, "kv_length": 2 * WINDOW, "local_size": WINDOW,
            "mask_function": sliding_window_causal_mask_function(WINDOW), "device": torch.device("cpu")}
    outside = mask(**step)
    assert outside is not None and outside.shape == (1, 1, 2 * WINDOW, 2 * WINDOW)
    assert not outside[0, 0, -1, 0]  # the window masks the first key from the last query
    with step_context(StepContext(None, torch.empty(0))):
        assert mask(**step) is None
