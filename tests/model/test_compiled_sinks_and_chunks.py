"""The compiled engine on CPU for a model with attention sinks (gpt-oss): its one-token steps write and attend
inside the graph (torch_single_row.py, which honours sinks and chunks), and every answer equals HF `generate`.
Compiling takes tens of seconds, so that runs in the slow tier; the one-token path's arithmetic, sinks and
chunks included, is checked fast in tests/kernels/test_sinks_and_chunks.py. Llama 4 (chunked attention) runs
eagerly even when asked to compile (model_loader.EAGER_TYPES)."""

from __future__ import annotations

import logging

import pytest
from helpers.engine import assert_all_blocks_free, greedy, hf_case, run_to_completion
from helpers.models import build

from paged_backend import Engine, EngineConfig
from paged_backend.model.paged import custom_ops

# Slow tier: compiles models or runs a whole client suite; `-m "not slow"` leaves it out (CI runs it).
pytestmark = pytest.mark.slow

MAX_NEW = 10


@pytest.mark.slow
def test_one_token_steps_with_sinks_attend_inside_the_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build("gpt_oss", seed=5)
    _, _, prompts, refs = hf_case("gpt_oss", model, MAX_NEW)
    # Every block kept: gpt-oss has window layers, and a cache of layer groups keeps one-token steps on the op.
    engine = Engine(model, None, EngineConfig(num_kv_blocks=40, block_size=4, compile=True, free_window_blocks=False))
    assert engine.runner.single_row
    rows = []
    opaque = custom_ops.write_and_attend
    monkeypatch.setattr(custom_ops, "write_and_attend",
                        lambda query, *args: rows.append(query.shape[0]) or opaque(query, *args))
    for prompt, ref in zip(prompts[:6], refs):  # one at a time: every decode step is a step of one token
        rid = engine.add_request(prompt, greedy(MAX_NEW))
        assert run_to_completion(engine)[rid].outputs[0].token_ids == ref
    assert rows and 1 not in rows, rows  # prompts went through the op, no one-token step did
    assert_all_blocks_free(engine)


def test_llama4_runs_eagerly_when_asked_to_compile(caplog: pytest.LogCaptureFixture) -> None:
    """Its forward fails to compile under the engine's dynamic shapes: the engine says so and runs it eagerly,
    with HF's tokens."""
    model = build("llama4_text")
    _, _, prompts, refs = hf_case("llama4_text", model, MAX_NEW)
    with caplog.at_level(logging.INFO, logger="paged_backend.engine"):
        engine = Engine(model, None, EngineConfig(num_kv_blocks=40, block_size=4, compile=True))
    assert not engine.runner.compiled and "runs eagerly" in caplog.text
    ids = [engine.add_request(p, greedy(MAX_NEW)) for p in prompts[:4]]
    finals = run_to_completion(engine)
    assert [finals[i].outputs[0].token_ids for i in ids] == refs[:4]
