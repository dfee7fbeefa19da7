"""Compiled steps in the paths that share the model runner: prompt logprobs, prefix-cache hits, n > 1 and
best_of, beam search and speculative decoding each give the same tokens (and logprobs) compiled as eager,
and none of them makes the compiled forward recompile.

One tiny model serves the whole module: torch compiles a model's forward once, and every later engine
over the same model reuses those graphs, so each test builds its engines for free after the first."""

from __future__ import annotations

import pytest
from helpers.engine import (
    assert_all_blocks_free,
    greedy,
    mixed_prompts,
    run_to_completion,
)
from helpers.models import build
from helpers.tolerances import approx
from torch._dynamo.utils import counters

from paged_backend import BeamSearchParams, Engine, EngineConfig, SamplingParams
from paged_backend.entrypoints.beam_search import beam_search
from paged_backend.model.compiled.compilation import CompiledForward

# Slow tier: compiles models or runs a whole client suite; `-m "not slow"` leaves it out (CI runs it).
pytestmark = pytest.mark.slow

# Small blocks and a small cache: prompts are chunked, the batch preempts, blocks are shared.
CONFIG = dict(num_kv_blocks=40, block_size=4, max_num_batched_tokens=24)


@pytest.fixture(scope="module")
def model():
    return build("llama", seed=1)


@pytest.fixture(scope="module")
def graphs(model) -> int:
    """Compiles the model (the first compiled engine pays it); the number of graphs torch holds after that."""
    assert Engine(model, None, EngineConfig(compile=True, **CONFIG)).runner.compiled
    return counters["stats"]["unique_graphs"]


def eager_and_compiled(model, graphs: int, **config) -> tuple[Engine, Engine]:
    config = {**CONFIG, **config}
    compiled = Engine(model, None, EngineConfig(compile=True, **config))
    assert compiled.runner.compiled and counters["stats"]["unique_graphs"] == graphs
    return Engine(model, None, EngineConfig(compile=False, **config)), compiled


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list:
    ids = [engine.add_request(p, params) for p in prompts]
    finals = run_to_completion(engine)
    assert_all_blocks_free(engine)
    return [finals[i] for i in ids]


def assert_no_recompiles(graphs: int) -> None:
    assert counters["stats"]["unique_graphs"] == graphs, "a path made the compiled forward recompile"
    assert CompiledForward.all_eager_steps == 0, "a step fitted no compiled graph and ran eagerly"


def test_prompt_logprobs_and_logprobs(model, graphs):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=3)
    prompts = mixed_prompts(6, seed=4)
    eager, compiled = (run(e, prompts, params) for e in eager_and_compiled(model, graphs))
    for a, b in zip(eager, compiled):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for entry_a, entry_b in zip(a.prompt_logprobs[1:] + a.outputs[0].logprobs,
                                    b.prompt_logprobs[1:] + b.outputs[0].logprobs):
            assert {t: lp.rank for t, lp in entry_a.items()} == {t: lp.rank for t, lp in entry_b.items()}
            assert [lp.logprob for lp in entry_b.values()] == approx([lp.logprob for lp in entry_a.values()])
    assert_no_recompiles(graphs)


def test_prefix_cache_hits(model, graphs):
    system = (mixed_prompts(1, seed=7)[0] * 3)[:30]
    prompts = [system + tail for tail in mixed_prompts(6, seed=8)]
    for_both = []
    for engine in eager_and_compiled(model, graphs):
        cold, warm = run(engine, prompts, greedy(8)), run(engine, prompts, greedy(8))
        assert sum(o.num_cached_tokens for o in warm) > sum(o.num_cached_tokens for o in cold) > 0
        for_both.append([o.outputs[0].token_ids for o in cold + warm])
    assert for_both[0] == for_both[1]
    assert_no_recompiles(graphs)


@pytest.mark.parametrize("params", [
    SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=8, ignore_eos=True),
    SamplingParams(n=2, best_of=4, temperature=1.0, top_k=20, seed=9, max_tokens=6, ignore_eos=True),
], ids=["n3", "best_of"])
def test_parallel_sampling(model, graphs, params):
    prompts = mixed_prompts(4, seed=6)
    eager, compiled = ([[c.token_ids for c in o.outputs] for o in run(e, prompts, params)]
                       for e in eager_and_compiled(model, graphs))
    assert eager == compiled
    assert all(len(samples) == params.n for samples in compiled)
    assert_no_recompiles(graphs)


def test_beam_search(model, graphs):
    prompts = mixed_prompts(3, seed=11)
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    eager, compiled = ([[s.token_ids for s in out.sequences] for out in beam_search(e, prompts, params)]
                       for e in eager_and_compiled(model, graphs))
    assert eager == compiled
    assert_no_recompiles(graphs)


def test_speculative_decoding(model, graphs):
    # Repetitive prompts, so n-gram lookup proposes and some proposals are accepted.
    prompts = [(p * 4)[:24] for p in mixed_prompts(5, seed=12)]
    eager = [o.outputs[0].token_ids for o in run(Engine(model, None, EngineConfig(**CONFIG)), prompts, greedy(12))]
    _, compiled = eager_and_compiled(model, graphs, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1})
    assert [o.outputs[0].token_ids for o in run(compiled, prompts, greedy(12))] == eager
    assert compiled.stats()["spec_num_draft_tokens"] > 0
    assert_no_recompiles(graphs)


def test_padded_decode_steps(model, graphs):
    """Decode-only steps padded to fixed sizes (what CUDA graphs replay; here on CPU, nothing captured)."""
    prompts = mixed_prompts(9, seed=13)
    eager = [o.outputs[0].token_ids for o in run(Engine(model, None, EngineConfig(**CONFIG)), prompts, greedy(10))]
    _, compiled = eager_and_compiled(model, graphs, pad_decode=True, cuda_graph_sizes=[1, 2, 4, 8])
    assert [o.outputs[0].token_ids for o in run(compiled, prompts, greedy(10))] == eager
    assert compiled.runner.padding.num_padded_steps > 0
    assert_no_recompiles(graphs)
