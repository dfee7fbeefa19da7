"""Tiny sliding-window models and prompts that grow far past their window, for the window-memory tests."""

from __future__ import annotations

import torch
import transformers as tf

from paged_backend import Engine

from .engine import greedy
from .models import VOCAB

WINDOW = 32
BLOCK = 8
MAX_NEW = 100  # new tokens per request: with long_prompts, sequences of up to 250 tokens (8x the window)


def common(layers: int) -> dict:
    return {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": layers,
            "max_position_embeddings": 1024, "num_attention_heads": 4, "num_key_value_heads": 2}


CONFIGS = {
    # Alternating window and full layers, soft-capped.
    "gemma2": lambda: tf.Gemma2Config(head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=5.0,
                                      final_logit_softcapping=10.0, query_pre_attn_scalar=16, **common(2)),
    # Gemma 3's ratio: five window layers to one full.
    "gemma3_text": lambda: tf.Gemma3TextConfig(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                               layer_types=["sliding_attention"] * 5 + ["full_attention"],
                                               **common(6)),
    # Every layer slides: one group, and a lone request's blocks never outgrow its window.
    "mistral": lambda: tf.MistralConfig(sliding_window=WINDOW, **common(2)),
}


def long_prompts(n: int = 12, seed: int = 0) -> list[list[int]]:
    """Prompts of 3 to about 150 tokens: with 100 new tokens, sequences of up to 250 (8x the window)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (3 + (29 * i) % 150,), generator=g).tolist() for i in range(n)]


def window_bound(step_tokens: int) -> int:
    """The most blocks a window group holds for one request: its window behind the step, and the step."""
    return -(-(WINDOW - 1 + step_tokens) // BLOCK) + 1


def assert_windows_held(engine: Engine) -> None:
    """No running request holds more of a window group than its window needs."""
    step_tokens = engine.config.max_num_batched_tokens
    for request in engine.scheduler.running:
        for g, group in enumerate(engine.kv.groups.groups):
            if group.spec.frees_blocks:
                table = request.block_tables[g]
                assert sum(b != engine.kv.null_block for b in table) <= window_bound(step_tokens)


def pages_in_use(engine: Engine) -> float:
    """The pool's pages in use, in units of one block of every layer, so that layouts compare."""
    used = engine.kv.pool.num_blocks - engine.kv.pool.num_free
    return used * engine.kv.groups.group_size / engine.kv.groups.num_layers


def run_checking_windows(engine: Engine, prompts: list[list[int]], late_from: int, params=None) -> list:
    """Run the prompts (those from `late_from` on joining after three steps); after every step, assert
    that no request holds more of a window group than its window needs. Returns the final outputs."""
    params = params or greedy(MAX_NEW)
    ids = [engine.add_request(p, params) for p in prompts[:late_from]]
    finals = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == 3:
            ids += [engine.add_request(p, params) for p in prompts[late_from:]]
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        steps += 1
        assert_windows_held(engine)
    return [finals[i] for i in ids]


def assert_equal_to_hf(outputs, refs) -> None:
    for i, (output, ref) in enumerate(zip(outputs, refs)):
        assert [c.token_ids for c in output.outputs] == [ref] * len(output.outputs), f"request {i} differs"
