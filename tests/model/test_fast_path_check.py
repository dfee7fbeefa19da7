"""The start-up check of the compiled forward against the eager one (fast_path_check.py): a right compiled
forward passes and is used; a planted wrong one (a step that loses its cache writes, or a layer whose output
is off) is caught, dropped, and the engine gives the eager engine's tokens."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.engine import greedy, hf_case, run_to_completion
from helpers.models import build, int4_llama
from helpers.planted import lose_cache_writes, scale_in_compiled_steps

from paged_backend import Engine, EngineConfig
from paged_backend.model.compiled import fast_path_check

# Slow tier: compiles models or runs a whole client suite; `-m "not slow"` leaves it out (CI runs it).
pytestmark = pytest.mark.slow

MAX_NEW = 8
CONFIG = dict(num_kv_blocks=32, block_size=4, max_num_batched_tokens=24, compile=True)


def answers(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    ids = [engine.add_request(p, greedy(MAX_NEW)) for p in prompts]
    finals = run_to_completion(engine)
    return [finals[rid].outputs[0].token_ids for rid in ids]


def test_a_right_compiled_forward_passes_and_is_used(caplog):
    _, model, prompts, refs = hf_case("llama", build("llama"), MAX_NEW)
    with caplog.at_level(logging.INFO, logger="paged_backend.model.runner_start"):
        engine = Engine(model, None, EngineConfig(**CONFIG))
    check = engine.runner_start.fast_path_check
    assert engine.runner.compiled and check.passed and 0 <= check.worst < check.allowed
    assert any("matches the eager one on the start-up probe" in r.message for r in caplog.records)
    stats = engine.stats()
    assert stats["compiled_check_passed"] == 1.0 and stats["compiled_check_max_kl"] == check.worst
    assert answers(engine, prompts) == refs
    assert engine.runner.forward_model.eager_steps == 0


def test_the_probe_reaches_every_graph_of_an_int4_model():
    """The int4 layers' large-step graph, the general one and the one-token one each serve a probe step (none
    runs eagerly), in bf16 where the bound is the loosest."""
    engine = Engine(int4_llama(), None, EngineConfig(num_kv_blocks=32, compile=True))
    forward = engine.runner.forward_model
    served = []
    call = forward.graph_for
    forward.by_tokens.clear()
    forward.graph_for = lambda kwargs: served.append(call(kwargs)) or served[-1]
    check = fast_path_check.check_compiled(engine.runner)
    assert check.passed and forward.eager_steps == 0
    assert {id(graph) for graph in served} == {id(graph) for graph in forward.graphs}
    assert len(forward.graphs) == 3


def perturb_a_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every compiled step runs the first layer's output projection 2 % too large."""
    scale_in_compiled_steps(monkeypatch, 0, "o_proj", 1.02)


@pytest.mark.parametrize("plant", [lose_cache_writes, perturb_a_layer])
def test_a_wrong_compiled_forward_is_caught_and_the_engine_runs_eagerly(monkeypatch, caplog, plant):
    _, model, prompts, refs = hf_case("llama", build("llama"), MAX_NEW)
    plant(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="paged_backend.model.runner_start"):
        engine = Engine(model, None, EngineConfig(**CONFIG))
    check = engine.runner_start.fast_path_check
    assert not check.passed and not check.worst <= check.allowed  # a lost write may read NaN from unwritten slots
    assert not engine.runner.compiled
    assert [r.message for r in caplog.records if "start-up probe" in r.message] == [
        "compile: the compiled forward's next-token distributions differ from the eager forward's by a KL "
        f"divergence of {check.worst:.4g} (bound {check.allowed:.4g}) on the start-up probe, so the engine runs "
        "eagerly"]
    assert engine.stats()["compiled_check_passed"] == 0.0
    assert answers(engine, prompts) == refs


def test_the_check_is_skipped_with_the_self_check(monkeypatch):
    lose_cache_writes(monkeypatch)
    engine = Engine(build("llama"), None, EngineConfig(**CONFIG, self_check=False))
    assert engine.runner.compiled and engine.runner_start.fast_path_check is None
    assert "compiled_check_passed" not in engine.stats()


def test_the_probe_fits_a_cache_smaller_than_itself():
    """Two blocks of four slots hold less than the probe's sequences: it reuses them, and still passes."""
    engine = Engine(build("llama"), None, EngineConfig(num_kv_blocks=2, block_size=4, compile=True))
    assert engine.runner_start.fast_path_check.passed
    lengths, _ = fast_path_check.probe_schedule(None)
    assert sum(lengths) > 2 * 4
    assert torch.isfinite(engine.cache.kv).all()
