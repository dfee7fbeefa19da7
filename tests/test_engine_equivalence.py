"""The correctness oracle: greedy engine output equals HF `generate`, request by request, whatever
else shares the batch, through chunked prefill, preemption and requests joining mid-run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from engine_helpers import check_against_hf, greedy, hf_case
from tiny_models import CONFIGS, build

from paged_backend import Engine, EngineConfig

MAX_NEW = 12


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def arch_case(request):
    return hf_case(request.param, build(request.param), MAX_NEW)


def check_engine(model, prompts, refs, config: EngineConfig, late_from: int | None = None) -> Engine:
    return check_against_hf(model, prompts, refs, config, MAX_NEW, late_from)


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
MT_BENCH = Path(os.environ.get("PAGED_BACKEND_DATA", Path(__file__).resolve().parents[1] / "benchmarks" / "data"))


@pytest.mark.slow
def test_default_model_mt_bench(default_llm):
    """The real model, real chat template, real EOS: every answer equals HF generate's."""
    questions = [json.loads(line) for line in (MT_BENCH / "mt_bench_questions.jsonl").open()][:6]
    tok = default_llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for q in questions]
    outs = default_llm.generate(prompts, greedy(24).__class__(temperature=0, max_tokens=24), use_tqdm=False)
    model = default_llm.model
    import torch
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
