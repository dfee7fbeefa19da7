"""The Triton kernels over a cache whose window layers freed their old blocks: the block tables of a
window group point at the null block before the window, and the kernel (here through its interpreter)
still equals HF generate, as the PyTorch path does."""

from __future__ import annotations

import helpers.triton_interpret  # noqa: F401  (must precede every Triton kernel import)
import pytest
import transformers as tf
from helpers.engine import assert_all_blocks_free, greedy, hf_greedy, run_to_completion
from helpers.models import VOCAB, build_from_config

from paged_backend import Engine, EngineConfig
from paged_backend.kernels import dispatch

WINDOW = 8


def common() -> dict:
    return {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "max_position_embeddings": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


CONFIGS = {
    "mistral": lambda: tf.MistralConfig(sliding_window=WINDOW, **common()),
    "gemma3_text": lambda: tf.Gemma3TextConfig(sliding_window=WINDOW, query_pre_attn_scalar=16,
                                               layer_types=["sliding_attention", "full_attention"], **common()),
}


@pytest.mark.slow  # compiles, or runs a whole suite or fuzzer: the slow tier
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_triton_attention_over_freed_window_blocks_matches_hf(name: str) -> None:
    model = build_from_config(CONFIGS[name])
    prompts = [[(7 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate((30, 5, 19))]
    expected = [hf_greedy(model, p, 10) for p in prompts]
    with dispatch.use_backend("triton"):
        # A small pool: freed window blocks are soon reused for other requests' tokens.
        engine = Engine(model, config=EngineConfig(block_size=4, max_num_batched_tokens=16, num_kv_blocks=14))
        ids = [engine.add_request(p, greedy(10)) for p in prompts]
        finals = run_to_completion(engine)
    assert engine.cache.grouped and engine.kv.groups.frees_blocks
    assert [finals[i].outputs[0].token_ids for i in ids] == expected
    assert_all_blocks_free(engine)
