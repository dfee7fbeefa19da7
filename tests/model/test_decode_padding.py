"""Decode-only steps padded to fixed batch sizes over persistent buffers (the inputs a CUDA graph replays),
run on CPU with `pad_decode=True`: the same tokens as unpadded steps, padding rows that touch only the
scratch slot and are never returned, buffers that stay put. Capture itself needs CUDA."""

from __future__ import annotations

import pytest
import torch
from helpers.engine import (
    check_against_hf,
    greedy,
    hf_case,
    mixed_prompts,
    run_to_completion,
)
from helpers.models import build
from helpers.tolerances import approx

from paged_backend import Engine, EngineConfig, SamplingParams
from paged_backend.model.compiled import cuda_graphs

SMALL = dict(num_kv_blocks=20, block_size=4, max_num_batched_tokens=24)  # chunked prefill and preemption
PADDED = dict(pad_decode=True, cuda_graph_sizes=[1, 2, 4, 8])


@pytest.fixture(scope="module")
def case():
    return hf_case("llama", build("llama"), 10)


def record_padded_steps(engine: Engine) -> list[tuple[int, int]]:
    """(real sequences, padded size) of every padded step the engine runs."""
    steps = []
    pad = engine.runner.padding.pad
    engine.runner.padding.pad = lambda inputs, size: steps.append((inputs.metadata.num_seqs, size)) or pad(inputs,
                                                                                                           size)
    return steps


def test_graph_sizes_config():
    assert EngineConfig().cuda_graph_sizes == [1, 2, 4, 8, 16, 32, 64]  # max_num_seqs=64
    assert EngineConfig(max_num_seqs=100).cuda_graph_sizes == [1, 2, 4, 8, 16, 32, 64, 100]
    assert EngineConfig(max_num_seqs=512).cuda_graph_sizes[-1] == 256
    assert EngineConfig(cuda_graph_sizes=[8, 2, 2]).cuda_graph_sizes == [2, 8]
    assert EngineConfig(cuda_graph_sizes=[]).cuda_graph_sizes == []
    for bad in ([0], [1.5], "1,2", [True]):
        with pytest.raises(ValueError, match="cuda_graph_sizes"):
            EngineConfig(cuda_graph_sizes=bad)
    with pytest.raises(ValueError, match="pad_decode"):
        EngineConfig(pad_decode=True, cuda_graph_sizes=[])
    with pytest.raises(ValueError, match="pad_decode"):
        EngineConfig(pad_decode="yes")


def test_cpu_pads_only_when_asked():
    model = build("llama")
    plain = Engine(model, None, EngineConfig(num_kv_blocks=8))
    assert plain.runner.padding is None and plain.runner.graphs is None and plain.cache.num_blocks == 8
    padded = Engine(model, None, EngineConfig(num_kv_blocks=8, **PADDED))
    assert padded.runner.padding is not None and padded.runner.graphs is None
    assert padded.cache.num_blocks == 9 and padded.kv.pool.num_blocks == 8  # the scratch block is held back
    assert padded.runner.padding.scratch_block == 8


def test_padded_greedy_equals_hf(case):
    _, model, prompts, refs = case
    engine = check_against_hf(model, prompts, refs, EngineConfig(**SMALL, **PADDED), 10, late_from=5)
    assert engine.scheduler.num_preemptions > 0 and engine.runner.padding.num_padded_steps > 0


def test_decode_steps_pad_to_the_next_size_and_mixed_steps_do_not(case):
    _, model, prompts, _ = case
    engine = Engine(model, None, EngineConfig(**SMALL, **PADDED))
    padded = record_padded_steps(engine)
    num_steps = 0
    for p in prompts:
        engine.add_request(p, greedy(10))
    while engine.has_unfinished_requests():
        engine.step()
        num_steps += 1
    assert any(size > n for n, size in padded), "no step had padding rows"
    assert all(size == min(s for s in (1, 2, 4, 8) if s >= n) for n, size in padded)
    assert 0 < len(padded) < num_steps  # the prefill and mixed steps ran unpadded


def test_padded_sampling_and_logprobs_equal_unpadded(case):
    _, model, prompts, _ = case
    params = SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=8, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)
    outputs = []
    for extra in ({}, PADDED):
        engine = Engine(model, None, EngineConfig(**SMALL, **extra))
        ids = [engine.add_request(p, params) for p in prompts[:6]]
        finals = run_to_completion(engine)
        outputs.append([finals[i] for i in ids])
    for plain, padded in zip(*outputs):
        assert [c.token_ids for c in plain.outputs] == [c.token_ids for c in padded.outputs]
        for a, b in zip(plain.outputs[0].logprobs + plain.prompt_logprobs[1:],
                        padded.outputs[0].logprobs + padded.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            assert [lp.logprob for lp in b.values()] == approx([lp.logprob for lp in a.values()])


def test_padding_rows_write_only_the_scratch_slot_and_are_never_returned():
    engine = Engine(build("llama"), None, EngineConfig(num_kv_blocks=16, block_size=4, cuda_graph_sizes=[4],
                                                       pad_decode=True, max_num_seqs=4))
    engine.cache.kv.zero_()
    for p in mixed_prompts(3, seed=2):
        engine.add_request(p, greedy(4))
    engine.step()  # the three prompts, unpadded
    seen = []
    execute = engine.runner.execute
    engine.runner.execute = lambda batch: seen.append(execute(batch)) or seen[-1]
    before = engine.cache.kv.clone()
    engine.step()  # three decoding sequences, padded to 4
    logits, inputs = seen[0]
    assert inputs.real_rows == 3 and inputs.input_ids.shape == (1, 4)
    assert logits.shape[0] == 3 == len(inputs.sampling_requests)
    changed = (engine.cache.kv != before).flatten(0, 2).any(dim=0).any(dim=-1).nonzero()[:, 0].tolist()
    scratch = engine.runner.padding.scratch_slot
    assert set(changed) == set(inputs.metadata.slot_mapping[:3].tolist()) | {scratch}
    assert scratch == 16 * 4  # the first slot past the blocks the pool owns


def test_buffers_are_persistent(case):
    _, model, prompts, _ = case
    engine = Engine(model, None, EngineConfig(**SMALL, **PADDED))
    pointers = set()
    forward = engine.runner.forward

    def record(inputs):
        if inputs.real_rows is not None:
            md = inputs.metadata
            pointers.add(tuple(t.data_ptr() for t in (inputs.input_ids, inputs.position_ids, inputs.logits_indices,
                                                       md.slot_mapping, md.block_tables, md.seq_lens,
                                                       md.query_start_loc)))
        return forward(inputs)

    engine.runner.forward = record
    for p in prompts:
        engine.add_request(p, greedy(6))
    run_to_completion(engine)
    assert len(pointers) == 1, "a padded step's inputs moved"


def test_capture_refusals():
    cuda = torch.device("cuda")
    assert cuda_graphs.refusal(torch.device("cpu"), torch.float32, 64, False, False) == "CUDA graphs need a CUDA device"
    assert "tensor parallelism" in cuda_graphs.refusal(cuda, torch.bfloat16, 64, True, False)
    assert "LoRA" in cuda_graphs.refusal(cuda, torch.bfloat16, 64, False, True)
    assert "head size 8" in cuda_graphs.refusal(cuda, torch.bfloat16, 8, False, False)
    assert cuda_graphs.refusal(cuda, torch.bfloat16, 64, False, False) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA device")
def test_captured_decode_equals_uncaptured():
    model = build("qwen3").cuda()  # head_dim 16: served by the Triton kernels
    prompts = mixed_prompts(10, seed=1)
    tokens = []
    for sizes in ([], [1, 2, 4, 8]):
        engine = Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=4, cuda_graph_sizes=sizes))
        assert (engine.runner.graphs is not None) == bool(sizes)
        ids = [engine.add_request(p, greedy(10)) for p in prompts]
        finals = run_to_completion(engine)
        tokens.append([finals[i].outputs[0].token_ids for i in ids])
    assert tokens[0] == tokens[1]
