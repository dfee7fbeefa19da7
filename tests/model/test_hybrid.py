"""Hybrid models (attention beside recurrent layers): the state slots each running request holds, what the
engine turns off or refuses for them, and the self-check of their recurrent path. Their greedy output against
HF generate on the mixed batch is in test_engine_equivalence.py (lfm2, granitemoehybrid, falcon_h1, qwen3_next, the
Qwen3.5 types)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.engine import (
    MAX_NEW,
    assert_all_blocks_free,
    greedy,
    hf_greedy,
    mixed_prompts,
    one_thread,  # noqa: F401  (autouse fixture)
    run_to_completion,
)
from helpers.models import CONFIGS, build, spread_weights
from transformers import AutoModelForImageTextToText

from paged_backend import BeamSearchParams, Engine, EngineConfig, SamplingParams
from paged_backend.core.state_slots import StateSlots
from paged_backend.entrypoints.beam_search import beam_search
from paged_backend.errors import UnsupportedArchitectureError
from paged_backend.model.adapters import lfm2
from paged_backend.model.paged.paged_cache import KVShape
from paged_backend.model.paged.recurrent_state import SlotView
from paged_backend.model.paged.step_context import current_step


@pytest.fixture(scope="module")
def model():
    return build("lfm2")


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(6)


@pytest.fixture(scope="module")
def refs(model, prompts):
    return [hf_greedy(model, p, MAX_NEW) for p in prompts]


def recurrent_layers(shape: KVShape) -> list[int]:
    """The layers whose spec keeps a state slot, not rows in the pages."""
    return [layer for layer, spec in enumerate(shape.layers) if spec.needs_state_slot and not spec.keeps_blocks]


def assert_all_slots_free(engine: Engine) -> None:
    slots = engine.kv.state_slots
    assert slots.num_free == slots.num_slots, f"{slots.num_slots - slots.num_free} state slots leaked"


def test_state_slots_hand_out_each_slot_once():
    slots = StateSlots(2)
    first, second = slots.allocate(), slots.allocate()
    assert {first, second} == {0, 1} and slots.num_free == 0
    with pytest.raises(RuntimeError, match="state slots are in use"):
        slots.allocate()
    slots.free(first)
    with pytest.raises(ValueError, match="not in use"):
        slots.free(first)
    assert slots.allocate() == first
    with pytest.raises(ValueError, match="num_slots=0"):
        StateSlots(0)


def test_a_slot_is_held_with_the_blocks_and_freed_by_preemption_finish_and_abort(model, prompts, refs):
    engine = Engine(model, None, EngineConfig(num_kv_blocks=20, block_size=4, max_num_batched_tokens=24,
                                              max_num_seqs=4))
    assert engine.kv.state_slots.num_slots == 4  # one per request that can run at once
    ids = [engine.add_request(p, greedy(MAX_NEW)) for p in prompts]
    doomed = engine.add_request(prompts[0], greedy(MAX_NEW))
    finals = {}
    for step in range(200):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        held = [r for r in engine.scheduler.running if r.state_slot is not None]
        assert len(held) == len(engine.scheduler.running)  # every running request has its slot
        assert len({r.state_slot for r in held}) == len(held)  # and no two share one
        assert all(r.state_slot is None for r in engine.scheduler.waiting)  # preempted ones gave theirs back
        if step == 2:
            engine.abort_request(doomed)
    assert engine.scheduler.num_preemptions >= 2
    assert finals[doomed].outputs[0].finish_reason == "abort"
    for rid, ref in zip(ids, refs):
        assert finals[rid].outputs[0].token_ids == ref
    assert_all_blocks_free(engine)
    assert_all_slots_free(engine)


def test_prefix_caching_is_off_and_said_so(model, prompts, refs):
    """A cached K/V prefix has no recurrent state to go with it: repeated prompts are computed again, and right."""
    engine = Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=4))
    assert engine.config.enable_prefix_caching and not engine.kv.enable_prefix_caching
    ids = [engine.add_request(prompts[5], greedy(MAX_NEW)) for _ in range(2)]
    finals = run_to_completion(engine)
    assert [finals[rid].outputs[0].token_ids for rid in ids] == [refs[5], refs[5]]
    stats = engine.stats()
    assert stats["prefix_caching_enabled"] == 0 and stats["prefix_cache_hit_tokens"] == 0
    assert stats["recurrent_slots_total"] == engine.config.max_num_seqs
    assert stats["recurrent_slots_free"] == stats["recurrent_slots_total"]
    assert stats["recurrent_state_bytes"] == engine.recurrent.nbytes > 0


def test_samples_each_compute_their_own_state(model, prompts, refs):
    """n > 1: every sample holds a slot of its own and recomputes the prompt into it (no prefix to share)."""
    engine = Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=4))
    rid = engine.add_request(prompts[3], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, n=3))
    finals = run_to_completion(engine)
    assert [c.token_ids for c in finals[rid].outputs] == [refs[3]] * 3
    assert_all_slots_free(engine)


def test_beam_search_equals_generate_beams(model, prompts):
    """Each beam step is a fresh request that recomputes its whole sequence into its own slot."""
    prompt = prompts[2]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), num_beams=2, num_return_sequences=2, do_sample=False,
                             max_new_tokens=5, min_new_tokens=5)
    engine = Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=4))
    (result,) = beam_search(engine, [prompt], BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True))
    assert [s.token_ids for s in result.sequences] == out[:, len(prompt):].tolist()
    assert_all_slots_free(engine)


def test_speculative_decoding_is_refused(model):
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="EngineConfig.speculative_config: lfm2 is a hybrid model"):
        Engine(model, None, EngineConfig(num_kv_blocks=16, speculative_config=spec))


@pytest.mark.parametrize(("arch", "mixers"), [("granitemoehybrid", "Mamba-2 mixers"), ("falcon_h1", "Mamba-2 mixers"),
                                             ("qwen3_next", "gated delta-net layers"),
                                             ("qwen3_5_moe_text", "gated delta-net layers")])
def test_lora_is_refused_where_mixers_project_per_sequence(arch, mixers):
    with pytest.raises(ValueError, match=f"EngineConfig.enable_lora: {arch}'s {mixers}"):
        Engine(build(arch), None, EngineConfig(num_kv_blocks=16, enable_lora=True))


def test_compile_and_padded_decode_stay_off(model, prompts, refs, caplog):
    """Its type is in EAGER_TYPES (the mixers loop over the step's sequences), and padding rows would need state
    slots: asked for both, the engine runs eagerly and unpadded, and says so."""
    with caplog.at_level("INFO"):
        engine = Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=4, compile=True, pad_decode=True))
    assert not engine.runner.compiled and engine.runner.padding is None
    assert "short-convolution layers" in caplog.text and "decode steps unpadded" in caplog.text
    rid = engine.add_request(prompts[1], greedy(MAX_NEW))
    assert run_to_completion(engine)[rid].outputs[0].token_ids == refs[1]


@pytest.mark.parametrize("name", ["lfm2", "granitemoehybrid", "qwen3_next"])
def test_self_check_refuses_a_mixer_that_forgets_its_state(name, monkeypatch):
    """The load-time self-check runs a chunk that continues a state and a decode step that advances one: a mixer
    that restarts every sequence from zeros is refused, and the model is left as it came."""
    if name == "lfm2":
        def forgetful():
            context = current_step()
            step = context.recurrent_step
            return dataclasses.replace(context, recurrent_step=dataclasses.replace(step, starts=(0,) * len(step.starts)))

        monkeypatch.setattr(lfm2, "current_step", forgetful)
    else:
        monkeypatch.setattr(SlotView, "get_recurrent_state", lambda self, layer_idx, state_idx=0: None)
    model = build(name)
    with pytest.raises(UnsupportedArchitectureError, match="logits differ"):
        Engine(model, None, EngineConfig(num_kv_blocks=16))
    assert not any(hasattr(m, "_paged_original_forward") for m in model.modules())


def test_recurrent_layers_keep_no_kv(model):
    """The pages hold the attention layer alone: a K/V budget buys blocks of one layer, not of three."""
    engine = Engine(model, None, EngineConfig(kv_cache_bytes=1 << 20, block_size=4))
    shape = engine.cache.shape
    assert recurrent_layers(shape) == [0, 2] and engine.cache.kv.shape[0] == 1
    per_block = 2 * shape.num_kv_heads * 4 * shape.head_dim * 4  # K and V of one layer, fp32
    assert shape.bytes_per_block(4, torch.float32) == per_block
    assert engine.kv.pool.num_blocks == (1 << 20) // per_block
    # Each recurrent layer's spec knows its state: one slot of every layer is what the state holds per request.
    per_slot = sum(spec.bytes_per_slot(torch.float32) for spec in shape.specs)
    assert per_slot > 0 and engine.recurrent.nbytes == engine.recurrent.num_slots * per_slot


@pytest.mark.parametrize("arch", ["granitemoehybrid", "falcon_h1"])
def test_mamba2_batches_equal_chunks_and_decodes(arch):
    """Prompts of one length run through a Mamba-2 mixer as one batch (their states gathered from their slots and
    stored back), chunk by chunk, then their decode tokens together: each still equals generate alone."""
    model = build(arch)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (12,), generator=g).tolist() for _ in range(4)] + [[5, 6, 7, 8, 9]]
    # 24 tokens a step: two 12-token prompts per step, or chunks of them; the 5-token one runs beside.
    engine = Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=24))
    # Falcon-H1 runs its Mamba-2 beside every layer's attention: each layer keeps K/V, and the mixers' specs still
    # hold a state slot per request and share no prefix.
    shape = engine.cache.shape
    assert shape.needs_state_slots and not shape.prefix_caching and not engine.plan.prefix_caching
    assert (recurrent_layers(shape) == []) == (arch == "falcon_h1") and bool(shape.parallel) == (arch == "falcon_h1")
    ids = [engine.add_request(p, greedy(MAX_NEW)) for p in prompts]
    finals = run_to_completion(engine)
    assert [finals[i].outputs[0].token_ids for i in ids] == [hf_greedy(model, p, MAX_NEW) for p in prompts]
    assert_all_slots_free(engine)


@pytest.mark.parametrize("name", ["granitemoehybrid_attention", "lfm2_attention"])
def test_a_hybrid_type_with_attention_layers_only_runs_as_an_attention_model(name):
    """Granite 4.0 Micro (a granitemoehybrid whose layers are all attention) and an all-attention LFM2 have no
    recurrent layer for their family's adapter to take: accepted as attention models (not refused as built by
    other code), with no state slots, K/V in every layer, prefix caching on, and generate's tokens."""
    model = build(name)
    assert not any(isinstance(m, lfm2.Lfm2ShortConv) or "Mamba" in type(m).__name__ for m in model.modules())
    prompt = mixed_prompts(2)[1]
    ref = hf_greedy(model, prompt, MAX_NEW)
    engine = Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=4))
    assert engine.recurrent is None and engine.kv.state_slots is None
    assert recurrent_layers(engine.cache.shape) == [] and engine.cache.shape.prefix_caching
    assert "recurrent_slots_total" not in engine.stats()
    assert model.config._attn_implementation == "paged_backend"
    first = engine.add_request(prompt, greedy(MAX_NEW))
    assert run_to_completion(engine)[first].outputs[0].token_ids == ref
    again = engine.add_request(prompt, greedy(MAX_NEW))  # its prefix is cached, as any attention model's
    assert run_to_completion(engine)[again].outputs[0].token_ids == ref
    assert engine.kv.hit_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["granitemoehybrid_attention", "lfm2_attention"])
def test_a_hybrid_type_with_attention_layers_only_compiles(name):
    """Its type runs eagerly for the recurrent layers (EAGER_TYPES); without any, the model compiles as an attention
    model does and still gives generate's tokens through chunked prefill and preemption."""
    model = build(name)
    prompts = mixed_prompts(6)
    refs = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    engine = Engine(model, None, EngineConfig(num_kv_blocks=20, block_size=4, max_num_batched_tokens=24,
                                              compile=True))
    assert engine.runner.compiled
    ids = [engine.add_request(p, greedy(MAX_NEW)) for p in prompts]
    finals = run_to_completion(engine)
    assert [finals[i].outputs[0].token_ids for i in ids] == refs
    assert engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_moe_text"])
def test_gated_delta_net_chunked_prefill_crosses_the_delta_rule_chunks(name):
    """Qwen3-Next, Qwen3.5: prompts longer than the chunked gated delta rule's chunk (64 tokens), prefilled in 48-token
    engine chunks, so each continuation starts inside a delta-rule chunk from its slot's convolution window and fp32
    state; three of one length run as one batch, beside decode tokens of the others: every sequence equals generate."""
    model = build(name)
    chunk = 64  # torch_chunk_gated_delta_rule's default, which Qwen3NextGatedDeltaNet calls it with
    g = torch.Generator().manual_seed(5)
    lengths = [2 * chunk + 30, chunk + 1, chunk + 17, chunk + 17, chunk + 17, 9]
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in lengths]
    engine = Engine(model, None, EngineConfig(num_kv_blocks=128, block_size=4, max_num_batched_tokens=48))
    conv, state = engine.recurrent.layer(0)
    assert recurrent_layers(engine.cache.shape) == [0] and list(engine.recurrent.tensors) == [0]
    assert conv.shape[1:] == (2 * 2 * 16 + 4 * 16, 4) and conv.dtype == torch.float32
    assert state.shape[1:] == (4, 16, 16) and state.dtype == torch.float32
    ids = [engine.add_request(p, greedy(MAX_NEW)) for p in prompts]
    finals = run_to_completion(engine)
    assert [finals[i].outputs[0].token_ids for i in ids] == [hf_greedy(model, p, MAX_NEW) for p in prompts]
    assert_all_slots_free(engine)



def test_qwen3_5_multimodal_model_runs_on_text():
    """A Qwen3.5 checkpoint's own class (Qwen3_5ForConditionalGeneration, config type qwen3_5) passed as it is: its
    language model's delta nets take the adapter, the state layout comes from its text config, and on token ids it
    gives generate's tokens (its multimodal rotary sections are plain rotary on text)."""
    config = CONFIGS["qwen3_5"]()
    config.vision_config = type(config.vision_config)(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                      out_hidden_size=64)
    torch.manual_seed(0)
    model = spread_weights(AutoModelForImageTextToText.from_config(config, dtype=torch.float32))
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration" and model.config.model_type == "qwen3_5"
    prompts = mixed_prompts(6)
    refs = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    engine = Engine(model, None, EngineConfig(num_kv_blocks=20, block_size=4, max_num_batched_tokens=24))
    assert list(engine.recurrent.tensors) == [1] and recurrent_layers(engine.cache.shape) == [1]
    ids = [engine.add_request(p, greedy(MAX_NEW)) for p in prompts]
    finals = run_to_completion(engine)
    assert [finals[i].outputs[0].token_ids for i in ids] == refs
    assert engine.scheduler.num_preemptions > 0
    assert_all_slots_free(engine)
