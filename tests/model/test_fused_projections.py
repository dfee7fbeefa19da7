"""Fused projections: an engine's steps multiply each layer's q/k/v and gate/up once, with the tokens of the
unfused engine and HF `generate`; the model stays the user's (state dict, saving, `generate`, in-place weight
updates); int4 layers share their codes; LoRA deltas still land; what cannot be fused says why."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers as tf
from helpers.engine import (
    check_against_hf,
    greedy,
    hf_case,
    hf_greedy,
    mixed_prompts,
    one_thread,
    run_to_completion,
)
from helpers.lora import peft_with_adapters, randomise_lora_b
from helpers.models import build, int4_llama
from peft import LoraConfig, get_peft_model

from paged_backend import Engine, EngineConfig
from paged_backend.model.quantized import fused_projections
from paged_backend.model.quantized.fused_projections import (
    DenseStack,
    fuse_projections,
    groups_of,
)
from paged_backend.model.quantized.int4_linear import Int4Linear, packed_rows_stack
from paged_backend.model.quantized.quantization import quantize_int4

__all__ = ["one_thread"]

MAX_NEW = 8
CONFIG = {"num_kv_blocks": 40, "block_size": 4, "max_num_batched_tokens": 24}


def engine_tokens(model, prompts: list[list[int]], **config) -> tuple[Engine, list[list[int]]]:
    engine = Engine(model, None, EngineConfig(**{**CONFIG, **config}))
    ids = [engine.add_request(p, greedy(MAX_NEW)) for p in prompts]
    finals = run_to_completion(engine)
    return engine, [finals[i].outputs[0].token_ids for i in ids]


# Llama-like layers of several families (qwen2: biased q/k/v; qwen2_moe: a shared expert's gate/up; stablelm: its
# attention adapter), each checked against HF generate with chunked prefill and late joiners; every other
# architecture runs fused through tests/test_engine_equivalence.py, fusion being on by default.
@pytest.mark.parametrize("arch, groups", [("llama", 4), ("qwen2", 4), ("qwen2_moe", 4), ("stablelm", 4), ("phi3", 0)])
def test_fused_engine_equals_hf(arch, groups):
    _, model, prompts, refs = hf_case(arch, build(arch), MAX_NEW)
    engine = check_against_hf(model, prompts, refs, EngineConfig(**CONFIG), MAX_NEW, late_from=6)
    assert len(groups_of(model)) == groups  # phi3's projections come fused already (qkv_proj): nothing to do
    assert engine.runner.fused == (groups > 0)


def test_each_group_multiplies_once_per_step(monkeypatch):
    model = build("llama")
    engine = Engine(model, None, EngineConfig(**CONFIG))
    calls = []
    original = DenseStack.__call__
    monkeypatch.setattr(DenseStack, "__call__", lambda self, x: calls.append(self) or original(self, x))
    engine.add_request([5, 6, 7, 8], greedy(3))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert len(calls) == steps * 4  # two groups in each of two layers, once each per step
    assert set(map(id, calls)) == {id(g.stack) for g in groups_of(model)}


def test_the_model_stays_the_users():
    model = build("llama")
    prompt = [3, 14, 15, 92, 65]
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    before_params = dict(model.named_parameters())
    before_tokens = hf_greedy(model, prompt, MAX_NEW)
    engine, [tokens] = engine_tokens(model, [prompt])
    assert tokens == before_tokens
    state = model.state_dict()
    assert state.keys() == before_state.keys()
    assert all(torch.equal(state[k], v) for k, v in before_state.items())
    assert all(p is before_params[name] for name, p in model.named_parameters())  # same Parameter objects
    assert hf_greedy(model, prompt, MAX_NEW) == before_tokens  # outside a step: the projections' own forward
    # No second copy: every projection's weight lies inside its group's stack.
    for group in groups_of(model):
        for member, start in zip(group.members, group.offsets):
            assert member.weight.untyped_storage().data_ptr() == group.stack.weight.untyped_storage().data_ptr()
            assert member.weight.data_ptr() == group.stack.weight[start].data_ptr()
    assert engine.runner.model_unchanged()


def test_a_fused_model_saves_and_loads(tmp_path):
    model = build("llama")
    Engine(model, None, EngineConfig(**CONFIG))
    model.save_pretrained(tmp_path)
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    assert hf_greedy(loaded, [1, 2, 3], MAX_NEW) == hf_greedy(model, [1, 2, 3], MAX_NEW)


def test_in_place_weight_updates_reach_the_fused_steps():
    model = build("llama")
    prompts = mixed_prompts(4)
    engine = Engine(model, None, EngineConfig(**CONFIG))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(-1.5)
            layer.mlp.up_proj.weight.add_(0.1)
    refs = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    ids = [engine.add_request(p, greedy(MAX_NEW)) for p in prompts]
    finals = run_to_completion(engine)
    assert [finals[i].outputs[0].token_ids for i in ids] == refs


def test_a_replaced_weight_unfuses_until_fused_again():
    model = build("llama")
    engine = Engine(model, None, EngineConfig(**CONFIG))
    q_proj = model.model.layers[1].self_attn.q_proj
    q_proj.weight = torch.nn.Parameter(torch.randn_like(q_proj.weight))  # a new tensor: not a view of the stack
    assert not fused_projections.fusion_intact(model)
    assert not engine.runner.model_unchanged()  # generate() builds a new engine for it
    prompts = mixed_prompts(4)
    refs = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    check_against_hf(model, prompts, refs, EngineConfig(**CONFIG), MAX_NEW)  # a new engine fuses it anew
    assert fused_projections.fusion_intact(model)


def test_fusion_can_be_turned_off(caplog):
    model = build("llama")
    with caplog.at_level(logging.INFO, logger="paged_backend.model.quantized.fused_projections"):
        engine = Engine(model, None, EngineConfig(fuse_projections=False, **CONFIG))
    assert "off (EngineConfig.fuse_projections=False)" in caplog.text
    assert not engine.runner.fused and groups_of(model) == []
    assert all("forward" not in vars(m) for m in model.modules())


def test_int4_projections_fuse_sharing_their_codes():
    model = int4_llama()
    prompts = mixed_prompts(6)  # up to 38 tokens: steps past the int4 rows run on the dense copies
    _, unfused = engine_tokens(model, prompts, fuse_projections=False)
    _, fused = engine_tokens(model, prompts)
    assert fused == unfused
    groups = groups_of(model)
    assert len(groups) == 4 and all(isinstance(g.stack, Int4Linear) for g in groups)
    for group in groups:
        for member, start in zip(group.members, group.offsets):
            for name in ("packed", "dense"):
                part, whole = getattr(member, name), getattr(group.stack, name)
                assert part.data_ptr() == whole[start].data_ptr()  # a view: the codes are held once
            columns = group.stack.scales_and_zeros[:, start:start + member.out_features]
            assert torch.equal(member.scales_and_zeros, columns)


def test_int4_sizes_the_kernel_cannot_stack_stay_unfused():
    """k and v have 32 output rows: half of one of torch's int4 packed blocks where it packs 64 rows at a time (as on
    AVX-512 CPUs), a whole number of blocks where it packs fewer (as on AVX2 ones). Whether they stack is found by
    packing on the CPU that runs, and so is the answer here."""
    model = build("llama")
    quantize_int4(model)
    report = fuse_projections(model)
    if packed_rows_stack([64, 32, 32], model.config.hidden_size):
        assert report.groups == 4 and not report.skipped  # q/k/v and gate/up of both layers
    else:
        assert report.groups == 2  # gate/up (128 rows each) stack; q/k/v do not
        assert all("packs rows in blocks" in why for why in report.skipped.values())
    _, model_refs = engine_tokens(model, mixed_prompts(3), fuse_projections=False)
    _, tokens = engine_tokens(model, mixed_prompts(3))
    assert tokens == model_refs


def test_lora_deltas_land_on_fused_projections():
    """alpha adapts q and v, beta every projection: each request's delta reaches its columns of the stack."""
    peft = peft_with_adapters()
    prompts = mixed_prompts(6)
    names = [None, "alpha", "beta", "alpha", "beta", None]
    refs = []
    for prompt, name in zip(prompts, names):
        if name is None:
            with peft.disable_adapter():
                refs.append(hf_greedy(peft, prompt, MAX_NEW))
        else:
            peft.set_adapter(name)
            refs.append(hf_greedy(peft, prompt, MAX_NEW))
    model = build("llama")
    engine = Engine(model, None, EngineConfig(enable_lora=True, **CONFIG))
    assert len(groups_of(model)) == 4
    for name in ("alpha", "beta"):
        engine.add_lora(name, peft, adapter_name=name)
    ids = [engine.add_request(p, greedy(MAX_NEW), lora=n) for p, n in zip(prompts, names)]
    finals = run_to_completion(engine)
    assert [finals[i].outputs[0].token_ids for i in ids] == refs


def test_peft_tuner_layers_fuse_their_base_layers():
    """A tuner layer adds its adapters' deltas to its base layer's output: the base layers of q/k/v and gate/up
    stack, with the PEFT model's tokens whether its adapter is on or off."""
    peft = get_peft_model(build("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    randomise_lora_b(peft, seed=0)
    peft.eval()
    prompts = mixed_prompts(4)
    report = fuse_projections(peft.get_base_model())
    assert report.groups == 4 and not report.skipped
    with peft.disable_adapter():
        base = [hf_greedy(peft, p, MAX_NEW) for p in prompts]
        assert engine_tokens(peft, prompts)[1] == base
    adapted = [hf_greedy(peft, p, MAX_NEW) for p in prompts]
    assert adapted != base
    engine, tokens = engine_tokens(peft, prompts)
    assert tokens == adapted and engine.runner.fused


def test_a_base_layer_fused_before_peft_wrapped_it_is_fused_anew_when_the_model_is_cast():
    """A trainer wraps the engine's model with PEFT, then casts it (TRL: `model.to(torch.bfloat16)` before each
    rollout): the stale fp32 stacks under the tuner layers are dropped and the bf16 weights stacked anew."""
    model = build("llama")
    engine_tokens(model, mixed_prompts(2))
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    randomise_lora_b(peft, seed=0)
    peft.eval().to(torch.bfloat16)
    assert not fused_projections.fusion_intact(model)
    prompts = mixed_prompts(4)
    _, unfused = engine_tokens(peft, prompts, fuse_projections=False)
    _, fused = engine_tokens(peft, prompts)
    assert fused == unfused
    assert {group.stack.weight.dtype for group in groups_of(model)} == {torch.bfloat16}


def test_torchao_int8_projections_fuse_sharing_their_codes():
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = build("llama")
    quantize_(model, Int8WeightOnlyConfig())
    before = {k: v.dequantize() if hasattr(v, "dequantize") else v.clone() for k, v in model.state_dict().items()}
    prompts = mixed_prompts(6)
    _, unfused = engine_tokens(model, prompts, fuse_projections=False)
    engine, fused = engine_tokens(model, prompts)
    assert fused == unfused and len(groups_of(model)) == 4
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(v.dequantize() if hasattr(v, "dequantize") else v, before[k]) for k, v in after.items())
    for group in groups_of(model):
        for member, start in zip(group.members, group.offsets):
            assert member.weight.qdata.data_ptr() == group.stack.weight.qdata[start].data_ptr()
    assert engine.runner.model_unchanged()



def test_tensor_parallel_engines_leave_projections_unfused(monkeypatch, caplog):
    model = build("llama")
    monkeypatch.setattr(fused_projections.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(fused_projections.dist, "get_world_size", lambda: 2)
    with caplog.at_level(logging.INFO, logger="paged_backend.model.quantized.fused_projections"):
        assert not fused_projections.fuse_for_engine(model)
    assert "not under tensor parallelism" in caplog.text and groups_of(model) == []
