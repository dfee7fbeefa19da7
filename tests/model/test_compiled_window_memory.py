"""A compiled engine frees window blocks too: on window models whose sequences grow far past their window
(mixed batch, chunked prefill of steps as long as the window, late arrivals, preemption), its greedy output
equals HF generate, each window group holds only its window, the pool holds fewer blocks than when every
block is kept, and no step runs eagerly. Compiling is the slow part: one compiled forward per model, shared
by the module (a second engine over the same model and cache layout reuses its graphs)."""

from __future__ import annotations

import pytest
from helpers.engine import assert_all_blocks_free, greedy, hf_greedy, one_thread  # noqa: F401
from helpers.models import build_from_config
from helpers.windows import (
    BLOCK,
    CONFIGS,
    MAX_NEW,
    assert_equal_to_hf,
    long_prompts,
    pages_in_use,
    run_checking_windows,
)

from paged_backend import Engine, EngineConfig
from paged_backend.model.compiled.compilation import CompiledForward

# Slow tier: compiles models or runs a whole client suite; `-m "not slow"` leaves it out (CI runs it).
pytestmark = pytest.mark.slow

# Budgets (blocks of every layer) small enough that 12 long requests preempt one another.
TIGHT_BLOCKS = {"gemma2": 48, "gemma3_text": 24, "mistral": 12}


class Case:
    """A window model, long prompts with HF's greedy answers, and its compiled engines: `tight` preempts,
    `roomy` holds every request at once (for the memory comparison); both over the same graphs."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.model = build_from_config(CONFIGS[name])
        self.prompts = long_prompts()
        self.answers: list[list[int]] = []
        # Steps of 32 tokens: as long as the window (transformers would build a window mask for them).
        self.tight = self.compiled(TIGHT_BLOCKS[name])
        self.roomy = self.compiled(256)
        assert self.roomy.runner.forward_model.new_graphs == 0, "the second engine compiled its own graphs"

    def refs(self, count: int) -> list[list[int]]:
        """HF's greedy answers to the first `count` prompts (computed once)."""
        self.answers += [hf_greedy(self.model, p, MAX_NEW) for p in self.prompts[len(self.answers):count]]
        return self.answers[:count]

    def compiled(self, blocks: int) -> Engine:
        engine = Engine(self.model, None, EngineConfig(num_kv_blocks=blocks, block_size=BLOCK,
                                                       max_num_batched_tokens=32, compile=True))
        assert engine.runner.compiled and engine.kv.groups.frees_blocks and engine.cache.grouped
        return engine


@pytest.fixture(scope="module")
def cases():
    """name -> Case, built on first use (one compile per model for the module)."""
    built: dict[str, Case] = {}

    def case(name: str) -> Case:
        if name not in built:
            built[name] = Case(name)
        return built[name]

    return case


def peak_pages(engine: Engine, prompts: list[list[int]]) -> tuple[float, list]:
    """Run `prompts` together; the most pages in use after any step (in blocks of every layer), and the outputs."""
    ids = [engine.add_request(p, greedy(MAX_NEW)) for p in prompts]
    peak, finals = 0.0, {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        peak = max(peak, pages_in_use(engine))
    return peak, [finals[i] for i in ids]


def check_compiled_window_engine(case: Case, prompts: int) -> None:
    eager_before = CompiledForward.all_eager_steps
    engine = case.tight
    preemptions = engine.scheduler.num_preemptions
    outputs = run_checking_windows(engine, case.prompts[:prompts], late_from=prompts // 2)
    assert_equal_to_hf(outputs, case.refs(prompts))
    assert engine.scheduler.num_preemptions - preemptions >= 2
    assert_all_blocks_free(engine)

    freed, outputs = peak_pages(case.roomy, case.prompts[:4])
    assert_equal_to_hf(outputs, case.refs(4))
    assert_all_blocks_free(case.roomy)
    # Which blocks are held does not depend on compiling: an eager engine keeping every block is the reference.
    keeping = Engine(case.model, None, EngineConfig(num_kv_blocks=256, block_size=BLOCK, max_num_batched_tokens=32,
                                                    compile=False, free_window_blocks=False))
    kept, outputs = peak_pages(keeping, case.prompts[:4])
    assert_equal_to_hf(outputs, case.refs(4))
    assert freed < 0.8 * kept

    assert engine.runner.forward_model.eager_steps == 0 and case.roomy.runner.forward_model.eager_steps == 0
    assert CompiledForward.all_eager_steps == eager_before


def test_compiled_gemma3_frees_window_blocks_and_matches_hf(cases):
    check_compiled_window_engine(cases("gemma3_text"), 6)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_compiled_window_models_free_window_blocks_and_match_hf(cases, name):
    check_compiled_window_engine(cases(name), 12)
