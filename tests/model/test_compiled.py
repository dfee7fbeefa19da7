"""The compiled engine: its greedy output equals HF `generate` (mixed batch, chunked prefill, preemption)
for several architectures, and steady state never recompiles. One compiled engine per architecture (compiling is the slow part)."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.adapters import build_adapted, random_baichuan_weights, write_baichuan
from helpers.engine import (
    assert_all_blocks_free,
    greedy,
    hf_case,
    mixed_prompts,
    run_to_completion,
)
from helpers.models import CONFIGS, build, build_from_config
from torch._dynamo.utils import counters

from paged_backend import Engine, EngineConfig
from paged_backend.model.compiled import compilation

# Slow tier: compiles models or runs a whole client suite; `-m "not slow"` leaves it out (CI runs it).
pytestmark = pytest.mark.slow

MAX_NEW = 10


def build_baichuan_13b(name: str):
    """Baichuan-13B's form (ALiBi, our own model class), loaded as a user's checkpoint would be."""
    import tempfile
    from pathlib import Path

    from paged_backend.model.loading.model_loader import load_model

    with tempfile.TemporaryDirectory() as tmp:  # the weights are read into memory
        model, _ = load_model(write_baichuan(Path(tmp) / name, "13b", random_baichuan_weights()), device="cpu")
    model.generation_config.eos_token_id = None
    return model


# Every family with an attention adapter (BLOOM, MPT, Falcon, Baichuan) runs its adapter's code compiled.
BUILDERS = {"llama": build, "qwen3": build, "gemma": build, "gpt2": build, "bloom": build_adapted,
            "mpt": build_adapted, "falcon-7b": build_adapted, "baichuan-13b": build_baichuan_13b}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def compiled_case(request):
    """(name, model, prompts, HF references, a compiled engine that preempts and chunks prefills)."""
    name, model, prompts, refs = hf_case(request.param, BUILDERS[request.param](request.param), MAX_NEW)
    # 20 blocks of 4 slots hold about two long requests; 24 tokens per step slice the longer prompts.
    engine = Engine(model, None, EngineConfig(num_kv_blocks=20, block_size=4, max_num_batched_tokens=24,
                                              compile=True))
    assert engine.runner.compiled
    return name, model, prompts, refs, engine


def test_compiled_greedy_equals_hf(compiled_case):
    _, _, prompts, refs, engine = compiled_case
    ids = [engine.add_request(p, greedy(MAX_NEW)) for p in prompts[:5]]
    finals = {o.request_id: o for _ in range(3) for o in engine.step() if o.finished}
    ids += [engine.add_request(p, greedy(MAX_NEW)) for p in prompts[5:]]  # join the running batch
    finals.update(run_to_completion(engine))
    assert [finals[rid].outputs[0].token_ids for rid in ids] == refs
    assert engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(engine)


def test_no_recompiles_in_steady_state(compiled_case):
    name, _, _, _, engine = compiled_case
    if name != "llama":
        pytest.skip("one architecture is enough to count recompiles")
    lengths = []
    forward = engine.runner.forward
    engine.runner.forward = lambda inputs: lengths.append(inputs.input_ids.shape[1]) or forward(inputs)
    graphs_before = counters["stats"]["unique_graphs"]
    prompts = iter(mixed_prompts(30, seed=3))
    for step in range(30):
        if step % 3 == 0:  # a new prompt every third step: prefill chunks, then decode of varying width
            engine.add_request(next(prompts), greedy(MAX_NEW))
        engine.step()
    engine.runner.forward = forward
    run_to_completion(engine)
    assert len(set(lengths)) >= 5 and 1 in lengths, lengths
    assert counters["stats"]["unique_graphs"] == graphs_before
    assert engine.runner.forward_model.eager_steps == 0, "a step fitted no compiled graph and ran eagerly"


def test_compile_defaults_on_cpu_where_it_can_build_kernels(monkeypatch):
    """compile=None compiles on CPU where a C++ compiler is installed, not on CUDA (its compiled steps diverged
    from eager on an H200); PAGED_BACKEND_COMPILE=0 turns the default off (the suite sets it: tests compile
    where they ask), never an explicit compile=True."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(compilation.ENV_COMPILE, raising=False)
    assert compilation.wants_compile(None, cpu) and not compilation.wants_compile(None, cuda)
    monkeypatch.setattr(compilation, "cpp_compiler", lambda: None)
    assert not compilation.wants_compile(None, cpu)
    monkeypatch.setenv(compilation.ENV_COMPILE, "0")
    monkeypatch.setattr(compilation, "cpp_compiler", lambda: "g++")
    assert not compilation.wants_compile(None, cpu)
    assert compilation.wants_compile(True, cpu) and compilation.wants_compile(True, cuda)
    assert not compilation.wants_compile(False, cpu)
    assert not Engine(build("llama"), None, EngineConfig(num_kv_blocks=8)).runner.compiled
    with pytest.raises(ValueError, match="compile"):
        EngineConfig(compile="yes")


def test_a_path_that_cannot_compile_runs_eagerly_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(compilation, "eager_reason", lambda: "tensor parallelism runs eagerly")
    with caplog.at_level(logging.INFO, logger="paged_backend.engine"):
        engine = Engine(build("llama"), None, EngineConfig(num_kv_blocks=8, compile=True))
    assert not engine.runner.compiled
    assert not engine.runner.compiled
    assert [r.message for r in caplog.records].count("compile: tensor parallelism runs eagerly") == 1


def test_dynamic_rope_runs_eagerly_and_says_so(caplog):
    """Dynamic NTK rope decides per forward, in Python, whether to recompute its frequencies: the engine runs it
    eagerly (a whole-graph trace failed at start-up), with HF's tokens."""
    _, model, prompts, refs = hf_case("llama_dynamic_rope", build("llama_dynamic_rope"), MAX_NEW)
    with caplog.at_level(logging.INFO, logger="paged_backend.engine"):
        engine = Engine(model, None, EngineConfig(num_kv_blocks=64, compile=True))
    assert not engine.runner.compiled
    assert any("dynamic NTK rope runs eagerly" in r.message for r in caplog.records)
    ids = [engine.add_request(p, greedy(MAX_NEW)) for p in prompts]
    finals = run_to_completion(engine)
    assert [finals[rid].outputs[0].token_ids for rid in ids] == refs


def test_a_forward_that_fails_to_compile_runs_eagerly_and_says_so(monkeypatch, caplog):
    """A model whose forward does not trace starts eagerly with a warning naming the error, not a crash."""
    def fail(*args):
        raise RuntimeError("data-dependent branch\nmore detail")

    monkeypatch.setattr(compilation, "compile_forward", fail)
    _, model, prompts, refs = hf_case("llama", build("llama"), MAX_NEW)
    with caplog.at_level(logging.WARNING, logger="paged_backend.model.runner_start"):
        engine = Engine(model, None, EngineConfig(num_kv_blocks=64, compile=True))
    assert not engine.runner.compiled
    assert [r.message for r in caplog.records] == [
        "compile: the model forward failed to compile (RuntimeError: data-dependent branch); it runs eagerly"]
    ids = [engine.add_request(p, greedy(MAX_NEW)) for p in prompts]
    finals = run_to_completion(engine)
    assert [finals[rid].outputs[0].token_ids for rid in ids] == refs


def test_models_of_one_class_compile_apart():
    """The compiled forward drops torch's guards on the model's modules, so two llamas of the same shapes
    whose activation differs must not share graphs: each gives its own HF tokens."""
    def gelu():
        config = CONFIGS["llama"]()
        config.hidden_act = "gelu"
        return config

    for model in (build("llama", seed=2), build_from_config(gelu, seed=2)):
        _, _, prompts, refs = hf_case("llama", model, MAX_NEW)
        engine = Engine(model, None, EngineConfig(num_kv_blocks=40, block_size=4, compile=True))
        ids = [engine.add_request(p, greedy(MAX_NEW)) for p in prompts]
        finals = run_to_completion(engine)
        assert [finals[i].outputs[0].token_ids for i in ids] == refs


def test_a_changed_model_compiles_anew():
    """A module changed after compiling (here a hook added) makes the compiled forward stale: the runner
    says so, and the next engine over the model compiles a forward that runs the change."""
    model = build("llama", seed=3)
    engine = Engine(model, None, EngineConfig(num_kv_blocks=40, block_size=4, compile=True))
    assert engine.runner.model_unchanged()
    handle = model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: out * 3)
    try:
        assert not engine.runner.model_unchanged()
        _, _, prompts, refs = hf_case("llama", model, MAX_NEW)
        again = Engine(model, None, EngineConfig(num_kv_blocks=40, block_size=4, compile=True))
        assert not {id(g) for g in again.runner.forward_model.graphs} & {id(g) for g in engine.runner.forward_model.graphs}
        ids = [again.add_request(p, greedy(MAX_NEW)) for p in prompts]
        finals = run_to_completion(again)
        assert [finals[i].outputs[0].token_ids for i in ids] == refs
    finally:
        handle.remove()
    assert engine.runner.model_unchanged()


def test_start_up_traces_each_graph_once(tmp_path, monkeypatch):
    """Module floats (norm epsilons, attention scales) compile as constants: as symbols, torch traced each
    graph, failed to make them tensors and traced it again (a quarter of the default model's start-up)."""
    from torch._dynamo import utils as dynamo_utils

    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(tmp_path))  # nothing saved by an earlier run to load
    monkeypatch.setattr(compilation, "_graphs", {})
    dynamo_utils.clear_compilation_metrics()
    assert Engine(build("llama", seed=4), None, EngineConfig(num_kv_blocks=8, compile=True)).runner.compiled
    ours = dynamo_utils.get_compilation_metrics()  # ahead-of-time captures record no code name: all are ours
    assert len(ours) >= 2 and all(not m.restart_reasons for m in ours), [m.restart_reasons for m in ours]


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: a sliding window and soft-capped logits
def test_one_token_steps_attend_inside_the_graph(arch, monkeypatch):
    """A lone stream's steps of one token write and attend in the compiled graph (torch_single_row.py),
    never through the opaque op, and give HF's tokens. Freed blocks rejoin the pool tail first, so from the
    second request on a stream's blocks are not in order."""
    from paged_backend.model.paged import custom_ops

    model = build(arch, seed=5)
    _, _, prompts, refs = hf_case(arch, model, MAX_NEW)
    # Every block kept: a window model's cache of layer groups keeps one-token steps on the op (model_runner.single_row).
    engine = Engine(model, None, EngineConfig(num_kv_blocks=40, block_size=4, compile=True, free_window_blocks=False))
    assert engine.runner.single_row
    rows = []
    opaque = custom_ops.write_and_attend
    monkeypatch.setattr(custom_ops, "write_and_attend",
                        lambda query, *args: rows.append(query.shape[0]) or opaque(query, *args))
    for prompt, ref in zip(prompts, refs):  # one at a time: every decode step is a step of one token
        rid = engine.add_request(prompt, greedy(MAX_NEW))
        assert run_to_completion(engine)[rid].outputs[0].token_ids == ref
    assert rows and 1 not in rows, rows  # prompts went through the op, no one-token step did
    assert_all_blocks_free(engine)
