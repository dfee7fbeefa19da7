"""The correctness oracle: greedy engine output equals HF `generate`, request by request, whatever
else shares the batch, through chunked prefill, preemption and requests joining mid-run."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.engine import (
    MAX_NEW,
    MT_BENCH,
    check_engine,
    greedy,
    hf_case,
    mixed_prompts,
)
from helpers.models import CONFIGS, build
from helpers.tolerances import tolerance

from paged_backend import Engine, EngineConfig
from paged_backend.model.loading.model_loader import SUPPORTED

# Each of these runs the three scenarios below apart; every other type runs them together, in one test.
CORE = ("gemma", "gpt2", "gpt_bigcode", "gpt_neox", "gptj", "llama", "mistral", "opt", "phi3", "qwen2", "qwen3")


@pytest.fixture(scope="module", params=CORE)
def arch_case(request):
    return hf_case(request.param, build(request.param), MAX_NEW)


def test_plain_batch(arch_case):
    _, model, prompts, refs = arch_case
    check_engine(model, prompts, refs, EngineConfig(num_kv_blocks=64))


def test_chunked_prefill_and_late_arrivals(arch_case):
    _, model, prompts, refs = arch_case
    check_engine(model, prompts, refs, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=16), late_from=5)


def test_preemption(arch_case):
    _, model, prompts, refs = arch_case
    # 20 blocks of 4 slots hold about two long requests: the rest must wait or be preempted and recomputed.
    engine = check_engine(model, prompts, refs, EngineConfig(num_kv_blocks=20, block_size=4,
                                                             max_num_batched_tokens=24))
    assert engine.scheduler.num_preemptions > 0


# The repository carries its prompts (benchmarks/data), so a fresh clone runs this test.
@pytest.mark.parametrize("name", sorted(set(CONFIGS) - set(CORE)))
def test_mixed_batch_with_chunks_and_preemption(name):
    """A mixed batch of 12, chunked prefill (24-token budget, prompts up to 40), late arrivals and
    preemptions (20 blocks of 4, at least two): every request equals HF generate."""
    _, model, prompts, refs = hf_case(name, build(name), MAX_NEW)
    engine = check_engine(model, prompts, refs, EngineConfig(num_kv_blocks=20, block_size=4,
                                                             max_num_batched_tokens=24), late_from=5)
    assert engine.scheduler.num_preemptions >= 2


def test_every_supported_type_has_a_test():
    """A type without a tiny model here (or an adapter case in test_adapters.py) is not in SUPPORTED."""
    from helpers.adapters import ADAPTED_CONFIGS

    tested = {CONFIGS[name]().model_type for name in CONFIGS}
    tested |= {ADAPTED_CONFIGS[name]().model_type for name in ADAPTED_CONFIGS} | {"baichuan"}  # Baichuan: checkpoints
    assert tested == SUPPORTED


@pytest.mark.parametrize(("name", "own"), [("gemma2", "eager"), ("gpt_oss", "eager"), ("llama4_text", "sdpa")])
def test_softcap_sinks_and_chunks_outside_the_engine_are_the_models_own(name, own):
    """A model switched to the paged attention and run without an engine soft-caps (Gemma 2) and adds its
    attention sinks (gpt-oss) as transformers' eager attention does (SDPA has neither), and chunks its
    attention (Llama 4) through the model's own chunked mask, so the caller's own generate keeps working."""
    model = build(name)
    model.set_attn_implementation(own)
    ids = torch.tensor([mixed_prompts(1)[0] * 3])  # longer than the sliding window
    with torch.no_grad():
        eager = model(ids).logits
        Engine(model, None, EngineConfig(num_kv_blocks=16))
        assert model.config._attn_implementation == "paged_backend"
        torch.testing.assert_close(model(ids).logits, eager, **tolerance(torch.float32, "forward"))


def test_longrope_context_is_capped_at_the_original_length():
    """LongRoPE switches to its long factors past original_max_position_embeddings (64 here): the engine
    runs exactly up to it and refuses longer contexts with the usable length in the message."""
    model = build("phi3_longrope")
    engine = Engine(model, None, EngineConfig(num_kv_blocks=64))
    assert engine.max_model_len == 64
    with pytest.raises(ValueError, match="original_max_position_embeddings=64"):
        engine.add_request(list(range(1, 70)), greedy(4))
    with pytest.raises(ValueError, match="max_model_len=128.*original_max_position_embeddings=64"):
        Engine(model, None, EngineConfig(num_kv_blocks=64, max_model_len=128))


@pytest.mark.slow
def test_default_model_mt_bench(default_llm):
    """The real model, real chat template, real EOS: every answer equals HF generate's."""
    questions = [json.loads(line) for line in (MT_BENCH / "mt_bench_questions.jsonl").open()][:6]
    tok = default_llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for q in questions]
    outs = default_llm.generate(prompts, greedy(24).__class__(temperature=0, max_tokens=24), use_tqdm=False)
    model = default_llm.model
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
