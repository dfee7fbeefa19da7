"""LoRA adapters per request: each request's greedy tokens equal the PEFT model's with that adapter active,
for a batch mixing the base and three adapters of different ranks and target modules (with chunked
prefill and preemption); the prefix cache keeps adapters apart; adapters come and go while requests
run; more distinct adapters than slots wait; bad adapters are refused with a clear error."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.engine import (
    assert_all_blocks_free,
    greedy,
    hf_greedy,
    mixed_prompts,
    run_to_completion,
)
from helpers.lora import peft_with_adapters
from helpers.models import build
from peft import IA3Config, LoraConfig, get_peft_model
from torch._dynamo.utils import counters

from paged_backend import (
    LLM,
    AsyncEngine,
    Engine,
    EngineConfig,
    LoRARequest,
    SamplingParams,
)
from paged_backend.entrypoints.beam_search import beam_search
from paged_backend.model.compiled.compilation import CompiledForward
from paged_backend.model.lora import LoRAWeights, portable_source, read_lora_layers

MAX_NEW = 8
NAMES = [None, "alpha", "beta", "gamma"]


def peft_greedy(model, prompt: list[int], adapter: str | None) -> list[int]:
    if adapter is None:
        with model.disable_adapter():
            return hf_greedy(model, prompt, MAX_NEW)
    model.set_adapter(adapter)
    return hf_greedy(model, prompt, MAX_NEW)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """The PEFT model with the three adapters, "alpha" also saved as a folder, prompts and references."""
    model = peft_with_adapters()
    folder = tmp_path_factory.mktemp("alpha")
    model.save_pretrained(folder, selected_adapters=["alpha"])
    prompts = mixed_prompts(8)
    names = [NAMES[i % 4] for i in range(len(prompts))]
    refs = [peft_greedy(model, p, n) for p, n in zip(prompts, names)]
    for i in range(1, 4):  # every adapter changes the answer, or the test could not fail
        assert peft_greedy(model, prompts[i], None) != refs[i]
    return model, folder / "alpha", prompts, names, refs


def lora_engine(case, **config) -> Engine:
    model, folder, *_ = case
    engine = Engine(build("llama"), None, EngineConfig(enable_lora=True, **config))
    engine.add_lora("alpha", str(folder))
    engine.add_lora("beta", model, adapter_name="beta")
    engine.add_lora("gamma", model, adapter_name="gamma")
    return engine


def run(engine: Engine, prompts, names) -> list:
    ids = [engine.add_request(p, greedy(MAX_NEW), lora=n) for p, n in zip(prompts, names)]
    finals = run_to_completion(engine)
    return [finals[rid].outputs[0].token_ids for rid in ids]


def test_mixed_batch_equals_peft_per_request_with_chunks_and_preemption(case):
    _, _, prompts, names, refs = case
    engine = lora_engine(case, max_loras=3, max_num_batched_tokens=24, num_kv_blocks=14, block_size=4)
    assert run(engine, prompts, names) == refs
    assert engine.stats()["num_preemptions"] > 0, "the small cache should have forced preemptions"
    assert_all_blocks_free(engine)
    assert engine.scheduler.lora.users == [0, 0, 0, 0]


def test_llm_generate_takes_one_adapter_per_prompt(case):
    model, folder, prompts, names, refs = case
    llm = LLM(build("llama"), enable_lora=True, max_loras=4, max_lora_rank=8, num_kv_blocks=64)
    llm.add_lora("alpha", str(folder))
    llm.add_lora("beta", model, adapter_name="beta")
    llm.add_lora("gamma", model, adapter_name="gamma")
    assert llm.list_loras() == ["alpha", "beta", "gamma"]
    outs = llm.generate(prompts[:4], greedy(MAX_NEW), use_tqdm=False, lora=names[:4])
    assert [o.outputs[0].token_ids for o in outs] == refs[:4]
    (only,) = llm.generate(prompts[1], greedy(MAX_NEW), use_tqdm=False, lora=LoRARequest("alpha"))
    assert only.outputs[0].token_ids == refs[1]


def test_lora_request_with_a_path_registers_on_first_use(case):
    _, folder, prompts, _, refs = case
    engine = Engine(build("llama"), None, EngineConfig(enable_lora=True, num_kv_blocks=32))
    rid = engine.add_request(prompts[1], greedy(MAX_NEW), lora=LoRARequest("alpha", str(folder)))
    assert engine.list_loras() == ["alpha"]
    assert run_to_completion(engine)[rid].outputs[0].token_ids == refs[1]


def test_an_adapter_as_plain_weights_runs_like_the_peft_model(case):
    """`portable_source` (what travels to Ray replicas): a folder as its absolute path, a PeftModel as
    LoRAWeights (config + state dict, picklable), read back like a folder."""
    import pickle

    model, folder, prompts, _, refs = case
    weights = pickle.loads(pickle.dumps(portable_source(model, "gamma")))
    assert isinstance(weights, LoRAWeights) and weights.config["r"] == 2
    assert portable_source(os.path.relpath(folder)) == str(folder)
    engine = Engine(build("llama"), None, EngineConfig(enable_lora=True, num_kv_blocks=32))
    engine.add_lora("gamma", weights)
    rid = engine.add_request(prompts[3], greedy(MAX_NEW), lora="gamma")
    assert run_to_completion(engine)[rid].outputs[0].token_ids == refs[3]


def test_async_engine_streams_with_an_adapter(case):
    _, _, prompts, _, refs = case
    aengine = AsyncEngine(lora_engine(case, num_kv_blocks=32))
    try:
        *_, final = aengine.stream(prompts[2], greedy(MAX_NEW), lora="beta")
        assert final.outputs[0].token_ids == refs[2]
        with pytest.raises(ValueError, match="known adapters"):
            aengine.stream(prompts[2], greedy(MAX_NEW), lora="nope").__next__()
    finally:
        aengine.shutdown()


def test_prefix_cache_keeps_adapters_apart(case):
    model, _, prompts, _, _ = case
    prompt = prompts[5]  # long enough for several full blocks
    engine = lora_engine(case, num_kv_blocks=64, block_size=4)
    expected = {n: peft_greedy(model, prompt, n) for n in (None, "alpha")}
    results = []
    for name in (None, "alpha", "alpha", None):
        rid = engine.add_request(prompt, greedy(MAX_NEW), lora=name)
        out = run_to_completion(engine)[rid]
        results.append((out.num_cached_tokens, out.outputs[0].token_ids == expected[name]))
    assert [ok for _, ok in results] == [True] * 4
    cached = [n for n, _ in results]
    assert cached[1] == 0, "the adapter must not reuse the base model's K/V"
    assert cached[2] > 0 and cached[3] > 0, "the same adapter (and the base) reuse their own blocks"
    assert_all_blocks_free(engine)


def test_adapters_come_and_go_while_requests_run(case):
    model, _, prompts, _, refs = case
    engine = lora_engine(case, num_kv_blocks=64, block_size=4)
    running = engine.add_request(prompts[2], greedy(MAX_NEW), lora="beta")
    engine.step()
    engine.remove_lora("beta")  # the running request keeps its adapter to the end
    with pytest.raises(ValueError, match=r"unknown LoRA adapter 'beta'.*\['alpha', 'gamma'\]"):
        engine.add_request(prompts[2], greedy(MAX_NEW), lora="beta")
    # The name comes back with other weights: no K/V of its predecessor is reused.
    engine.add_lora("beta", model, adapter_name="gamma")
    again = engine.add_request(prompts[2], greedy(MAX_NEW), lora="beta")
    finals = run_to_completion(engine)
    assert finals[running].outputs[0].token_ids == refs[2]
    assert finals[again].outputs[0].token_ids == peft_greedy(model, prompts[2], "gamma")
    assert finals[again].num_cached_tokens == 0
    assert_all_blocks_free(engine)


def test_more_adapters_than_slots_wait_instead_of_failing(case):
    _, _, prompts, names, refs = case
    engine = lora_engine(case, max_loras=1, num_kv_blocks=64)
    in_flight = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        in_flight.append({r.lora.name for r in batch.requests if r.lora is not None})
        return batch

    engine.scheduler.schedule = recording_schedule
    assert run(engine, prompts, names) == refs
    assert max(len(s) for s in in_flight) == 1
    assert set().union(*in_flight) == {"alpha", "beta", "gamma"}
    assert_all_blocks_free(engine)


def test_a_stream_for_one_adapter_does_not_starve_another_for_the_one_slot(case):
    """max_loras=1 and a new "alpha" request every step: the "beta" request still starts within a few
    steps (the alpha requests behind it wait), base requests are never held back, and every answer
    is PEFT's with its own adapter."""
    _, _, prompts, _, refs = case
    engine = lora_engine(case, max_loras=1, num_kv_blocks=256)
    alphas = [engine.add_request(prompts[1], greedy(MAX_NEW), lora="alpha")]
    engine.step()
    waiting = engine.add_request(prompts[2], greedy(MAX_NEW), lora="beta")
    bases, finals, steps = [], {}, 0
    while engine.scheduler.lora.loaded[1].name != "beta":
        steps += 1
        assert steps <= 2 * MAX_NEW, "beta never got the slot: the stream of alpha requests kept it busy"
        alphas.append(engine.add_request(prompts[5], greedy(MAX_NEW), lora="alpha"))
        bases.append(engine.add_request(prompts[0], greedy(MAX_NEW)))
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        assert engine.requests[bases[-1]].samples[0].num_computed_tokens > 0, "a base request waited for a slot"
    finals.update(run_to_completion(engine))
    assert finals[waiting].outputs[0].token_ids == refs[2]
    assert [finals[r].outputs[0].token_ids for r in alphas] == [refs[1]] + [refs[5]] * (len(alphas) - 1)
    assert all(finals[r].outputs[0].token_ids == refs[0] for r in bases)
    assert_all_blocks_free(engine)


# ------------------------------------------------------------------------ refusals


def test_unknown_adapter_names_the_known_ones(case):
    engine = lora_engine(case, num_kv_blocks=16)
    with pytest.raises(ValueError, match=r"unknown LoRA adapter 'delta'; known adapters: \['alpha', 'beta', 'gamma'\]"):
        engine.add_request([1, 2, 3], greedy(2), lora="delta")
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="already registered"):
        engine.add_lora("alpha", case[1])


def test_lora_needs_enable_lora():
    engine = Engine(build("llama"), None, EngineConfig(num_kv_blocks=16))
    with pytest.raises(ValueError, match="enable_lora=True"):
        engine.add_request([1, 2, 3], greedy(2), lora="alpha")


def test_rank_above_max_lora_rank_is_refused(case):
    engine = Engine(build("llama"), None, EngineConfig(enable_lora=True, max_lora_rank=4, num_kv_blocks=16))
    with pytest.raises(ValueError, match="rank 8 .* above max_lora_rank=4"):
        engine.add_lora("beta", case[0], adapter_name="beta")
    assert engine.list_loras() == []


@pytest.mark.parametrize("arch, targets, message", [
    ("gpt2", ["c_attn"], "does not have"),  # another architecture: its modules are not in this model
    ("llama_wide", ["gate_proj"], "does not match the base model"),  # same names, other shapes
])
def test_adapter_for_another_base_is_refused(arch, targets, message):
    import transformers as tf
    from helpers.models import build_from_config

    if arch == "llama_wide":
        other = build_from_config(lambda: tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96,
                                                         num_hidden_layers=2, num_attention_heads=4,
                                                         num_key_value_heads=2))
    else:
        other = build(arch)
    adapter = get_peft_model(other, LoraConfig(r=4, target_modules=targets, fan_in_fan_out=arch == "gpt2"))
    if arch == "gpt2":  # fan_in_fan_out would be refused first: check the module lookup on its own
        adapter.peft_config["default"].fan_in_fan_out = False
    engine = Engine(build("llama"), None, EngineConfig(enable_lora=True, num_kv_blocks=16))
    with pytest.raises(ValueError, match=message):
        engine.add_lora("other", adapter)


@pytest.mark.parametrize("config, message", [
    (LoraConfig(r=4, target_modules=["q_proj"], use_dora=True), "DoRA"),
    (LoraConfig(r=4, target_modules=["embed_tokens"]), "embedding LoRA is not supported"),
    (IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]), "only LoRA adapters"),
])
def test_unsupported_adapter_types_are_refused(config, message):
    adapter = get_peft_model(build("llama"), config)
    engine = Engine(build("llama"), None, EngineConfig(enable_lora=True, num_kv_blocks=16))
    with pytest.raises(ValueError, match=message):
        engine.add_lora("bad", adapter)


def test_engine_config_checks_lora_fields():
    with pytest.raises(ValueError, match="max_loras"):
        EngineConfig(enable_lora=True, max_loras=0)


@pytest.mark.slow  # compiles, or runs a whole suite or fuzzer: the slow tier
def test_compiled_steps_add_each_request_adapter_in_the_graph(case):
    """A compiled engine hooks every adaptable linear before compiling and gives each step a mask: steps with
    and without adapters, adapters loaded after start-up, chunked prefill and preemption all run the graphs
    warmed up at start-up, with the PEFT model's tokens per request."""
    _, _, prompts, names, refs = case
    engine = lora_engine(case, compile=True, max_loras=3, max_num_batched_tokens=24, num_kv_blocks=14, block_size=4)
    assert engine.runner.compiled and engine.runner.lora_slots.hooks_fixed
    graphs = counters["stats"]["unique_graphs"]
    base_only = [engine.add_request(p, greedy(MAX_NEW)) for p in prompts[:2]]
    finals = run_to_completion(engine)
    assert [finals[rid].outputs[0].token_ids for rid in base_only] == [peft_greedy(case[0], p, None)
                                                                      for p in prompts[:2]]
    assert run(engine, prompts, names) == refs
    assert engine.stats()["num_preemptions"] > 0, "the small cache should have forced preemptions"
    assert counters["stats"]["unique_graphs"] == graphs, "a step recompiled after start-up"
    assert CompiledForward.all_eager_steps == 0, "a step fitted no compiled graph and ran eagerly"
    assert engine.runner.compiled
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("as_folder", [True, False])
def test_an_adapter_on_the_output_embedding_is_refused(as_folder, tmp_path):
    """The output embedding sees only the step's kept rows, not every token the LoRA mask covers (a step
    used to fail on it); it is also the one linear a compiled engine leaves unhooked (adaptable_linears)."""
    model = get_peft_model(build("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head", "q_proj"]),
                           adapter_name="head")
    engine = Engine(build("llama"), None, EngineConfig(enable_lora=True, num_kv_blocks=16))
    with pytest.raises(ValueError, match="targets the output embedding"):
        if as_folder:
            model.save_pretrained(tmp_path, save_embedding_layers=False)  # the adapter only, not the tied weights
            engine.add_lora("head", str(tmp_path / "head"))
        else:  # PEFT's own layers, as generate(adapter_names=...) reads them
            read_lora_layers("head", model, "head", 8)
    assert engine.list_loras() == []


def test_samples_and_speculation_keep_their_adapter(case):
    """n > 1 samples share their request's adapter (and its prefix blocks); n-gram proposals run with it too."""
    _, _, prompts, names, refs = case
    engine = lora_engine(case, num_kv_blocks=64, block_size=4,
                         speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                                             "prompt_lookup_min": 1})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, n=2)
    ids = [engine.add_request(p, params, lora=n) for p, n in zip(prompts[:4], names[:4])]
    finals = run_to_completion(engine)
    for rid, ref in zip(ids, refs[:4]):
        assert [c.token_ids for c in finals[rid].outputs] == [ref, ref]
    assert engine.stats()["spec_num_draft_tokens"] > 0, "random prompts should still give some n-gram proposals"
    assert_all_blocks_free(engine)


def test_beam_search_with_an_adapter_equals_peft_beams(case):
    from paged_backend import BeamSearchParams

    model, _, prompts, _, _ = case
    engine = lora_engine(case, num_kv_blocks=128, block_size=4)
    model.set_adapter("beta")
    with torch.no_grad():
        out = model.generate(torch.tensor([prompts[1]]), num_beams=2, num_return_sequences=2, do_sample=False,
                             max_new_tokens=5, min_new_tokens=5)
    (result,) = beam_search(engine, [prompts[1]], BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True),
                            lora="beta")
    assert [s.token_ids for s in result.sequences] == out[:, len(prompts[1]):].tolist()
    (base,) = beam_search(engine, [prompts[1]], BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True))
    assert [s.token_ids for s in base.sequences] != out[:, len(prompts[1]):].tolist()
    assert_all_blocks_free(engine)


def test_two_lora_engines_on_one_model_keep_their_own_adapters(case):
    """Each engine hooks the shared linears: a step applies only its own engine's slots."""
    model, _, prompts, _, refs = case
    base = build("llama")
    first = Engine(base, None, EngineConfig(enable_lora=True, num_kv_blocks=32))
    second = Engine(base, None, EngineConfig(enable_lora=True, num_kv_blocks=32))
    first.add_lora("alpha", model, adapter_name="alpha")
    second.add_lora("other", model, adapter_name="beta")
    a = first.add_request(prompts[1], greedy(MAX_NEW), request_id="a", lora="alpha")
    b = second.add_request(prompts[2], greedy(MAX_NEW), request_id="b", lora="other")
    finals: dict = {}
    while first.has_unfinished_requests() or second.has_unfinished_requests():
        for engine in (first, second):
            finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals[a].outputs[0].token_ids == refs[1]
    assert finals[b].outputs[0].token_ids == refs[2]


def test_padded_decode_is_off_with_lora(case):
    """Padded (CUDA-graph) decode steps would leave the per-step LoRA hooks out of a captured step."""
    _, _, prompts, names, refs = case
    engine = lora_engine(case, num_kv_blocks=64, pad_decode=True)
    assert engine.runner.padding is None
    assert run(engine, prompts[:4], names[:4]) == refs[:4]


def with_adapter_added_by_hand(model, peft_model, adapter: str | None):
    """Forward hooks adding `adapter`'s delta, x A^T B^T * scaling, to `model`'s layers as PEFT computes it
    (none for the base): the reference for a base PEFT cannot wrap (int4 layers)."""
    handles = []
    for name, module in peft_model.named_modules():
        if adapter is None or adapter not in (getattr(module, "lora_A", None) or {}):
            continue
        a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
        scale = module.scaling[adapter]
        target = model.get_submodule(name.removeprefix("base_model.model."))
        handles.append(target.register_forward_hook(
            lambda _m, args, out, a=a, b=b, scale=scale: out + (args[0] @ a.T @ b.T) * scale))
    return handles


def greedy_with_adapter(model, peft_model, prompt: list[int], adapter: str | None) -> list[int]:
    """generate's greedy answer on `model` with `adapter`'s delta added by hand (none for the base)."""
    handles = with_adapter_added_by_hand(model, peft_model, adapter)
    try:
        return hf_greedy(model, prompt, MAX_NEW)
    finally:
        for handle in handles:
            handle.remove()


def test_adapters_over_an_int4_base_add_their_deltas_to_its_layers(case):
    """quantization="int4" with adapters: every request equals generate on the same int4 model with its
    adapter's delta added by hand, in a mixed, chunked batch; and the adapters change the answers."""
    from paged_backend.model.quantized.int4_linear import Int4Linear
    from paged_backend.model.quantized.quantization import quantize_weights

    peft_model, _, prompts, names, _ = case
    reference = build("llama")
    quantize_weights(reference, "int4")
    refs = [greedy_with_adapter(reference, peft_model, prompt, name) for prompt, name in zip(prompts, names)]
    assert sum(ref != hf_greedy(reference, p, MAX_NEW) for p, ref in zip(prompts, refs)) >= 4

    llm = LLM(build("llama"), quantization="int4", enable_lora=True, max_loras=3, max_lora_rank=8,
              num_kv_blocks=64, max_num_batched_tokens=24, compile=False)
    assert isinstance(llm.model.model.layers[0].self_attn.q_proj, Int4Linear)
    for name in NAMES[1:]:
        llm.add_lora(name, peft_model, adapter_name=name)
    outs = llm.generate(prompts, greedy(MAX_NEW), use_tqdm=False, lora=names)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("fmt, options", [("gptq", dict(bits=4, group_size=32)), ("awq", dict(group_size=32)),
                                          ("ct-w4a16", dict(group_size=32)), ("ct-w8a16", dict(strategy="channel")),
                                          ("ct-fp8", dict(strategy="channel"))])
def test_adapters_over_a_quantized_checkpoint_add_their_deltas_to_its_layers(case, tmp_path, fmt, options):
    """A GPTQ, AWQ or compressed-tensors base with adapters: every request equals generate on the same loaded
    model with its adapter's delta added by hand, in a mixed, chunked batch."""
    from helpers.quantized_checkpoints import write_quantized
    from transformers import AutoModelForCausalLM

    from paged_backend.model.quantized.quantized_linear import QuantizedLinear

    peft_model, _, prompts, names, _ = case
    write_quantized(build("llama"), tmp_path, fmt, **options)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    refs = [greedy_with_adapter(reference, peft_model, prompt, name) for prompt, name in zip(prompts, names)]
    llm = LLM(str(tmp_path), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8, num_kv_blocks=64,
              max_num_batched_tokens=24, compile=False)
    assert isinstance(llm.model.model.layers[0].self_attn.q_proj, QuantizedLinear)
    for name in NAMES[1:]:
        llm.add_lora(name, peft_model, adapter_name=name)
    # End of sequence banned until the last token, as generate's min_new_tokens bans it (some answers pick it).
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    outs = llm.generate(prompts, params, use_tqdm=False, lora=names)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert_all_blocks_free(llm.engine)
