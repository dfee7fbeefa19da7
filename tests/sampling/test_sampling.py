"""Sampling: seeded reproducibility, the filters, penalties, min_tokens, stop ids and logprobs."""

from __future__ import annotations

import pytest
import torch
from helpers.engine import greedy, hf_greedy, run_to_completion
from helpers.models import build
from helpers.tolerances import approx

from paged_backend import Engine, EngineConfig, SamplingParams
from paged_backend.sampling.sampler import ARGMAX_BLOCK, apply_penalties, argmax_rows, filter_logits

PROMPT = [5, 17, 42, 7]


@pytest.fixture(scope="module")
def model():
    return build("llama")


@pytest.fixture
def engine(model):
    return Engine(model, None, EngineConfig(num_kv_blocks=512))


def run_one(engine, prompt, params):
    rid = engine.add_request(prompt, params)
    return run_to_completion(engine)[rid].outputs[0]


def test_seeded_sampling_is_independent_of_the_batch(engine):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = run_one(engine, PROMPT, params).token_ids
    rid = engine.add_request(PROMPT, params)
    for i in range(10):  # neighbours of all kinds, seeded and not
        engine.add_request([i + 1] * (i + 2), SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12 - i,
                                                              seed=i if i % 2 else None, ignore_eos=True))
    crowded = run_to_completion(engine)[rid].outputs[0].token_ids
    assert alone == crowded
    other_seed = run_one(engine, PROMPT, SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True))
    assert other_seed.token_ids != alone


@pytest.mark.parametrize("kwargs", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_filters_that_keep_one_token_are_greedy(model, engine, kwargs):
    out = run_one(engine, PROMPT, SamplingParams(temperature=1.5, max_tokens=10, ignore_eos=True, **kwargs))
    assert out.token_ids == hf_greedy(model, PROMPT, 10)


def test_first_token_distribution_matches_softmax(model):
    engine = Engine(model, None, EngineConfig(num_kv_blocks=512, max_num_seqs=600, max_num_batched_tokens=4096))
    n, temperature = 600, 0.7
    for i in range(n):
        engine.add_request(PROMPT, SamplingParams(temperature=temperature, seed=i, max_tokens=1, ignore_eos=True))
    counts = torch.zeros(256)
    for out in run_to_completion(engine).values():
        counts[out.outputs[0].token_ids[0]] += 1
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([PROMPT])).logits[0, -1] / temperature, dim=-1)
    # Each of the most likely tokens is drawn at its probability, within 4.5 standard errors.
    for token in probs.topk(5).indices:
        p = probs[token].item()
        assert abs(counts[token].item() / n - p) < 4.5 * (p * (1 - p) / n) ** 0.5 + 1e-3


@pytest.mark.parametrize("vocab", [ARGMAX_BLOCK * 3, ARGMAX_BLOCK * 3 + 17, ARGMAX_BLOCK - 1, 49_152])
def test_greedy_argmax_by_blocks_is_torchs_argmax(vocab: int):
    """The first of equal maxima, whether they share a block, lie in two blocks or in a short last block."""
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab))
    top = logits.max() + 1
    logits[0, [5, 9]] = top  # a tie inside one block
    logits[1, [vocab - 1, ARGMAX_BLOCK // 2]] = top  # a tie across blocks (the last one short, when it is)
    logits[2, vocab - 1] = top  # the maximum in the last entry
    logits[3] = 0.0  # every entry equal
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    assert argmax_rows(logits[:0]).shape == (0,)  # a step that samples nothing (embeddings only)


def test_top_k_top_p_min_p_keep_the_right_sets():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    reqs = [fake_request(top_k=2), fake_request(top_p=0.8), fake_request(min_p=0.4)]
    kept = torch.isfinite(filter_logits(logits.clone(), reqs))
    assert kept.tolist() == [[True, True, False, False], [True, True, False, False], [True, True, False, False]]


def test_penalties_follow_their_definitions():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    req = fake_request(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    req.prompt_token_ids, req.output_token_ids = [0], [1, 3, 3]
    apply_penalties(logits, [req], [()])
    # token 0: prompt only -> 2/2; token 1: output once -> -2*2 - 0.5 - 0.25; token 3: twice -> 0.5/2 - 0.5 - 0.5
    assert torch.allclose(logits, torch.tensor([[1.0, -4.75, 1.0, -0.75]]))


def test_repetition_penalty_matches_hf(model, engine):
    out = run_one(engine, PROMPT, SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=12,
                                                 ignore_eos=True))
    with torch.no_grad():
        ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                             repetition_penalty=1.5)
    assert out.token_ids == ref[0, len(PROMPT):].tolist()


def test_stop_token_ids_and_min_tokens(model, engine):
    ref = hf_greedy(model, PROMPT, 8)
    stop_at = ref[2]
    out = run_one(engine, PROMPT, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at],
                                                 ignore_eos=True))
    assert out.token_ids == ref[: ref.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    banned = run_one(engine, PROMPT, SamplingParams(temperature=0, max_tokens=8, min_tokens=8,
                                                    stop_token_ids=[stop_at], ignore_eos=True))
    assert stop_at not in banned.token_ids and banned.finish_reason == "length"


def test_eos_stops_unless_ignored(model):
    model.generation_config.eos_token_id = hf_greedy(model, PROMPT, 3)[1]
    try:
        engine = Engine(model, None, EngineConfig(num_kv_blocks=64))
        out = run_one(engine, PROMPT, SamplingParams(temperature=0, max_tokens=8))
        assert len(out.token_ids) == 2 and out.finish_reason == "stop" and out.stop_reason is None
        assert len(run_one(engine, PROMPT, greedy(8)).token_ids) == 8
    finally:
        model.generation_config.eos_token_id = None


def test_logprobs_are_the_model_distribution(model, engine):
    out = run_one(engine, PROMPT, SamplingParams(temperature=0, max_tokens=3, logprobs=3, ignore_eos=True))
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0, -1], dim=-1)
    first = out.logprobs[0]
    token = out.token_ids[0]
    assert first[token].logprob == approx(ref[token].item())
    assert first[token].rank == 1
    top3 = ref.topk(3).indices.tolist()
    assert set(top3) <= set(first)
    assert out.cumulative_logprob == pytest.approx(sum(lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)))


def fake_request(**kwargs):
    from paged_backend.core.outputs import RequestMetrics
    from paged_backend.core.request import Request

    params = SamplingParams(**kwargs)
    return Request("x", None, [], params, 16, frozenset(), RequestMetrics(0.0))


def test_per_request_logits_processor(model, engine):
    ref = hf_greedy(model, PROMPT, 6)
    banned = ref[0]

    def ban(output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        seen.append(list(output_ids))
        row[banned] = float("-inf")
        return row

    seen: list[list[int]] = []

    rid = engine.add_request(PROMPT, greedy(6), logits_processor=ban)
    plain = engine.add_request(PROMPT, greedy(6))  # its neighbour is not affected
    finals = run_to_completion(engine)
    tokens = finals[rid].outputs[0].token_ids
    assert banned not in tokens
    assert seen == [tokens[:i] for i in range(6)]  # each call saw the request's output so far
    assert finals[plain].outputs[0].token_ids == ref


def test_failing_logits_processor_fails_only_its_step(model, engine):
    rid = engine.add_request(PROMPT, greedy(4), logits_processor=lambda ids, row: 1 / 0)
    out = run_to_completion(engine)[rid]
    assert out.outputs[0].finish_reason == "abort" and "ZeroDivisionError" in out.error
    assert run_one(engine, PROMPT, greedy(4)).token_ids == hf_greedy(model, PROMPT, 4)


def all_negative(output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
    """Shifts a logits row below zero, so the repetition penalty works on negative logits only."""
    return row - row.max() - 1.0


def reference_penalised_greedy(model, prompt: list[int], steps: int, params: SamplingParams,
                               shift=None) -> list[int]:
    """Greedy decoding with the bare model and the penalties written out from their definitions:
    repetition (prompt + output, divide a positive logit, multiply a negative one), then presence and
    frequency (output only)."""
    ids, out = list(prompt), []
    for _ in range(steps):
        with torch.no_grad():
            row = model(torch.tensor([ids])).logits[0, -1].float()
        if shift is not None:
            row = shift(out, row)
        for token in set(ids):
            value = row[token].item()
            row[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
        for token in set(out):
            row[token] -= params.frequency_penalty * out.count(token) + params.presence_penalty
        token = int(row.argmax())
        ids.append(token)
        out.append(token)
    return out


@pytest.mark.parametrize("kwargs, shift", [
    ({"frequency_penalty": 0.5}, None),
    ({"presence_penalty": 0.8}, None),
    ({"repetition_penalty": 1.3}, None),
    ({"repetition_penalty": 1.3}, all_negative),
    ({"frequency_penalty": 0.3, "presence_penalty": 0.2, "repetition_penalty": 1.2}, all_negative),
], ids=["frequency", "presence", "repetition", "repetition-negative", "all-negative"])
def test_penalties_over_many_greedy_steps_match_a_bare_model_loop(model, engine, kwargs, shift):
    """40 greedy steps, so penalties built from earlier output tokens decide later ones."""
    steps = 40
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, **kwargs)
    ref = reference_penalised_greedy(model, PROMPT, steps, params, shift)
    plain = hf_greedy(model, PROMPT, steps)
    assert ref != plain  # the penalties change the answer
    rid = engine.add_request(PROMPT, params, logits_processor=shift)
    neighbour = engine.add_request(PROMPT, greedy(steps))  # batched with an unpenalised row
    finals = run_to_completion(engine)
    assert finals[rid].outputs[0].token_ids == ref
    assert finals[neighbour].outputs[0].token_ids == plain


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs exist on a CUDA device only")
def test_sampler_waits_for_the_device_once():
    """Per-row values go to the device without a wait; sampled ids and logprobs come back in one wait,
    which CUDA's sync debug mode does not count (an explicit stream synchronize)."""
    from types import SimpleNamespace

    from paged_backend.sampling.sampler import sample

    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.01, logprobs=2, seed=1),
              SamplingParams(temperature=0.0, logprobs=1, repetition_penalty=1.2)]
    requests = [SimpleNamespace(params=p, generator=torch.Generator("cuda").manual_seed(1), logits_processor=None,
                                output_token_ids=[3], prompt_token_ids=[1, 2], penalty_state=None,
                                num_output_tokens=1, stop_ids=frozenset({0}), wants_logprob=True) for p in params]
    logits = torch.randn(2, 64, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sample(logits, requests)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(out.token_ids) == 2 and len(out.top_ids[0]) == 2
