"""The exponential race's noise (race_noise.py): its distribution, and a seeded row's independence of everything
but its generator: other rows, the batch's shape, a prefix-cache hit."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.engine import run_to_completion
from helpers.models import build

from paged_backend import Engine, EngineConfig, SamplingParams
from paged_backend.sampling.race_noise import race_noise, skip_rows


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_noise_is_exponential():
    torch.manual_seed(0)
    noise = race_noise(torch.Size([4, 50_000]), [None, seeded(1), None, seeded(2)], [True] * 4, torch.device("cpu"))
    assert noise.dtype == torch.float32 and bool((noise > 0).all()) and bool(noise.isfinite().all())
    for row in noise:
        # Exp(1): mean 1 and variance 1 (standard error of the mean 0.0045), and P(q > t) = exp(-t).
        assert row.mean().item() == pytest.approx(1.0, abs=0.025)
        assert row.var().item() == pytest.approx(1.0, abs=0.06)
        for t in (0.1, 1.0, 3.0):
            assert (row > t).float().mean().item() == pytest.approx(math.exp(-t), abs=0.01)
    assert not torch.equal(noise[0], noise[2])  # unseeded rows are drawn apart


def test_a_seeded_row_depends_on_its_generator_alone():
    alone = race_noise(torch.Size([1, 1000]), [seeded(7)], [True], torch.device("cpu"))
    crowded = race_noise(torch.Size([3, 1000]), [None, seeded(7), seeded(8)], [True] * 3, torch.device("cpu"))
    assert torch.equal(crowded[1], alone[0])
    assert not torch.equal(crowded[2], alone[0])


def test_rows_not_drawn_hold_one_and_leave_their_generator():
    generator = seeded(3)
    state = generator.get_state()
    noise = race_noise(torch.Size([2, 100]), [generator, None], [False, True], torch.device("cpu"))
    assert bool((noise[0] == 1).all()) and not bool((noise[1] == 1).all())
    assert torch.equal(generator.get_state(), state)


def test_skip_rows_advances_as_drawing_does():
    drawn, skipped = seeded(5), seeded(5)
    for _ in range(3):
        race_noise(torch.Size([1, 257]), [drawn], [True], torch.device("cpu"))
    skip_rows(skipped, 3, 257)
    assert torch.equal(drawn.get_state(), skipped.get_state())


def test_seeded_samples_survive_a_prefix_cache_hit_and_a_crowd():
    """A seeded request's tokens are the same cold, with its prompt's blocks cached (their K/V computed in another
    step, so its logits may differ in the last bits) and among other requests."""
    engine = Engine(build("llama"), None, EngineConfig(num_kv_blocks=256, block_size=8, enable_prefix_caching=True))
    prompt = [(i * 37) % 200 + 3 for i in range(41)]
    params = SamplingParams(temperature=1.3, seed=11, max_tokens=24, ignore_eos=True)

    def run(neighbours: int = 0):
        rid = engine.add_request(prompt, params)
        for i in range(neighbours):
            engine.add_request(prompt[: 9 + i], SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True))
        return run_to_completion(engine)[rid]

    cold, warm, crowded = run(), run(), run(neighbours=6)
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens >= 32
    assert cold.outputs[0].token_ids == warm.outputs[0].token_ids == crowded.outputs[0].token_ids
