"""Beam search through the engine gives the same sequences as transformers' beam search."""

from __future__ import annotations

import pytest
import torch
from helpers.engine import assert_all_blocks_free, mixed_prompts
from helpers.models import build

from paged_backend import BeamSearchParams, Engine, EngineConfig
from paged_backend.entrypoints.beam_search import beam_search


def hf_beams(model, prompt, beams, max_new, **kwargs):
    """transformers' beam search; each row cut after its eos (the rest is padding)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), num_beams=beams, num_return_sequences=beams, do_sample=False,
                             max_new_tokens=max_new, **kwargs)
    eos = model.generation_config.eos_token_id or []
    eos = [eos] if isinstance(eos, int) else eos
    rows = []
    for row in out[:, len(prompt):].tolist():
        ends = [i for i, t in enumerate(row) if t in eos]
        rows.append(row[: ends[0] + 1] if ends else row)
    return rows


@pytest.fixture(scope="module")
def model():
    return build("llama", seed=3)


@pytest.mark.parametrize("beams", [2, 4])
def test_beam_search_without_eos_matches_hf(model, beams):
    model.config.eos_token_id = None
    prompts = mixed_prompts(3, seed=11)
    engine = Engine(model, None, EngineConfig(num_kv_blocks=256, block_size=4))
    outputs = beam_search(engine, prompts, BeamSearchParams(beam_width=beams, max_tokens=6, ignore_eos=True))
    for prompt, output in zip(prompts, outputs):
        assert [s.token_ids for s in output.sequences] == hf_beams(model, prompt, beams, 6)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("early_stopping, length_penalty", [(False, 1.0), (True, 1.0), ("never", 2.0), (False, -1.0)])
def test_beam_search_with_eos_matches_hf(model, early_stopping, length_penalty):
    prompts = mixed_prompts(4, seed=2)
    # Two eos tokens that beams of these prompts produce, so hypotheses finish at different lengths.
    model.generation_config.eos_token_id = [39, 15]
    try:
        engine = Engine(model, None, EngineConfig(num_kv_blocks=256, block_size=4))
        params = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=length_penalty,
                                  early_stopping=early_stopping)
        outputs = beam_search(engine, prompts, params)
        lengths = set()
        for prompt, output in zip(prompts, outputs):
            ref = hf_beams(model, prompt, 3, 8, length_penalty=length_penalty, early_stopping=early_stopping)
            assert [s.token_ids for s in output.sequences] == ref
            lengths |= {len(s.token_ids) for s in output.sequences}
        if early_stopping != "never":  # a strong positive length penalty rightly prefers the full-length beams
            assert len(lengths) > 1, "no hypothesis ended early: the eos tokens exercise nothing"
    finally:
        model.generation_config.eos_token_id = None


def test_beam_search_params_are_validated():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")
