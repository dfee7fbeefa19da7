"""`generate_batch` with a paged generation config (TRL's continuous-batching rollout path) runs on the engine:
HF-identical greedy tokens, transformers' keys and order, sampled-token logprobs, live weights."""

from __future__ import annotations

import pytest
import torch
from helpers.engine import hf_greedy, mixed_prompts, one_thread  # noqa: F401  (autouse: one thread)
from helpers.models import build
from paged_backend.integrations import generate_batch as gb
from paged_backend.integrations import hooks
from paged_backend.integrations import transformers_generate as tg
from transformers import GenerationConfig, GenerationMixin
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from paged_backend import EngineConfig
from paged_backend.model.paged.attention import ATTENTION_NAME

MAX_NEW = 8


@pytest.fixture(scope="module", autouse=True)
def enabled():
    was_enabled = tg.is_enabled()
    hooks.enable()
    yield
    if not was_enabled:
        hooks.disable()


def paged_config(**options) -> GenerationConfig:
    return GenerationConfig(cache_implementation="paged", max_new_tokens=MAX_NEW, **options)


def test_greedy_rollouts_equal_hf_generate_in_transformers_order() -> None:
    model = build("llama")
    prompts = mixed_prompts(6)
    results = model.generate_batch(prompts, generation_config=paged_config(do_sample=False))
    assert list(results) == [f"req_{i}" for i in range(len(prompts))]
    for prompt, output in zip(prompts, results.values()):
        assert output.prompt_ids == prompt and output.is_finished() and output.error is None
        assert output.generated_tokens == hf_greedy(model, prompt, MAX_NEW)


def test_logprobs_are_those_of_the_sampled_tokens() -> None:
    model = build("qwen3")
    prompts = mixed_prompts(3)
    results = model.generate_batch(prompts, generation_config=paged_config(do_sample=False),
                                   continuous_batching_config=ContinuousBatchingConfig(return_logprobs=True))
    for prompt, output in zip(prompts, results.values()):
        with torch.no_grad():
            scores = model(torch.tensor([prompt + output.generated_tokens])).logits[0, len(prompt) - 1:-1]
        expected = torch.log_softmax(scores, -1).gather(1, torch.tensor(output.generated_tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(output.logprobs), expected, atol=1e-4)


def test_batch_invariant_rollout_logprobs_do_not_depend_on_the_batch() -> None:
    """With `EngineConfig(batch_invariant=True)` each rollout's logprobs are bit for bit those of its prompt run
    alone, and within fp32 rounding of the trainer's forward (the model's own, dense)."""
    model = build("llama")
    tg.engine_for(model, EngineConfig(batch_invariant=True, max_num_batched_tokens=16))
    prompts = mixed_prompts(6)
    logprobs = ContinuousBatchingConfig(return_logprobs=True)
    batched = model.generate_batch(prompts, generation_config=paged_config(do_sample=False),
                                   continuous_batching_config=logprobs)
    for prompt, output in zip(prompts, batched.values()):
        alone = model.generate_batch([prompt], generation_config=paged_config(do_sample=False),
                                     continuous_batching_config=logprobs)["req_0"]
        assert (alone.generated_tokens, alone.logprobs) == (output.generated_tokens, output.logprobs)
        with torch.no_grad():
            scores = model(torch.tensor([prompt + output.generated_tokens])).logits[0, len(prompt) - 1:-1]
        dense = torch.log_softmax(scores, -1).gather(1, torch.tensor(output.generated_tokens)[:, None])[:, 0]
        assert (torch.tensor(output.logprobs) - dense).abs().max() < 1e-5


def test_samples_of_one_prompt_are_keyed_children_first() -> None:
    model = build("llama")
    results = model.generate_batch(mixed_prompts(2), generation_config=paged_config(
        do_sample=True, temperature=0.8, top_k=20, num_return_sequences=3))
    assert list(results) == ["req_0__child#0", "req_0__child#1", "req_0", "req_1__child#0", "req_1__child#1", "req_1"]
    assert all(len(output.generated_tokens) == MAX_NEW for output in results.values())


def test_rollouts_follow_an_optimizer_step() -> None:
    """The engine generates from the weights the optimizer updates: no stale copy after a step."""
    model = build("llama")
    prompt = mixed_prompts(1)[0]
    before = model.generate_batch([prompt], generation_config=paged_config(do_sample=False))["req_0"]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.tensor([prompt]), labels=torch.tensor([prompt])).loss.backward()
    optimizer.step()
    model.eval()
    after = model.generate_batch([prompt], generation_config=paged_config(do_sample=False))["req_0"]
    expected = hf_greedy(model, prompt, MAX_NEW)
    assert after.generated_tokens == expected and before.generated_tokens != expected


def test_other_configs_go_to_transformers_and_bad_arguments_are_refused(monkeypatch) -> None:
    model = build("llama")
    calls = []
    monkeypatch.setattr(gb, "ORIGINAL_GENERATE_BATCH", lambda *args, **kwargs: calls.append(args) or {})
    assert model.generate_batch([[1, 2, 3]], generation_config=GenerationConfig(max_new_tokens=2)) == {}
    assert len(calls) == 1
    with pytest.raises(NotImplementedError, match="record_timestamps"):
        model.generate_batch([[1, 2, 3]], generation_config=paged_config(), record_timestamps=True)
    with pytest.raises(TypeError, match="temperature"):
        model.generate_batch([[1, 2, 3]], generation_config=paged_config(), temperature=0.5)


def test_transformers_own_generate_batch_runs_on_a_model_the_engine_ran() -> None:
    """transformers' continuous batching refuses the engine's attention implementation: a model the engine ran gets
    its own back for that call, and the engine's again after it."""
    model = build("llama")
    prompts = mixed_prompts(2)
    model.generate_batch(prompts, generation_config=paged_config(do_sample=False))
    assert model.config._attn_implementation == ATTENTION_NAME
    plain = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    results = model.generate_batch(prompts, generation_config=plain)
    assert [out.generated_tokens for out in results.values()] == [hf_greedy(model, p, MAX_NEW) for p in prompts]
    assert model.config._attn_implementation == ATTENTION_NAME
    paged = model.generate_batch(prompts, generation_config=paged_config(do_sample=False))
    assert [out.generated_tokens for out in paged.values()] == [hf_greedy(model, p, MAX_NEW) for p in prompts]


def test_disable_gives_a_model_the_engine_ran_its_own_attention_back() -> None:
    model = build("llama")
    model.set_attn_implementation("eager")
    model.generate(torch.tensor([[1, 2, 3]]), cache_implementation="paged", max_new_tokens=2)
    assert model.config._attn_implementation == ATTENTION_NAME
    hooks.disable()
    try:
        assert model.config._attn_implementation == "eager"
    finally:
        hooks.enable()
    out = model.generate(torch.tensor([[1, 2, 3]]), cache_implementation="paged", max_new_tokens=2, do_sample=False)
    assert model.config._attn_implementation == ATTENTION_NAME
    assert out[0, 3:].tolist() == hf_greedy(model, [1, 2, 3], 2)


def test_disable_gives_generate_batch_back() -> None:
    hooks.disable()
    try:
        assert "generate_batch" not in GenerationMixin.__dict__
    finally:
        hooks.enable()
    assert GenerationMixin.__dict__["generate_batch"] is gb.generate_batch
