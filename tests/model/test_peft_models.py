"""A PEFT model (LoRA layers inside a transformers model) runs on the engine through every entry point,
LoRA applied: `LLM`, `Engine`, LangChain's `ChatPaged(model=...)` and `generate(cache_implementation=
"paged")` give the PEFT model's own greedy tokens. Prompt-learning adapters are refused."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from helpers.engine import greedy, hf_greedy, mixed_prompts
from helpers.lora import randomise_lora_b
from helpers.models import build
from peft import LoraConfig, PrefixTuningConfig, get_peft_model

from paged_backend import LLM, Engine, EngineConfig, UnsupportedArchitectureError

MAX_NEW = 8


def lora_model(seed: int = 0):
    """A tiny Llama with LoRA on q/v whose B matrices are non-zero, so the adapter changes the output."""
    model = get_peft_model(build("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    randomise_lora_b(model, seed)
    return model.eval()


@pytest.fixture(scope="module")
def peft_case():
    model = lora_model()
    prompts = mixed_prompts(4)
    refs = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    with model.disable_adapter():
        assert [hf_greedy(model, p, MAX_NEW) for p in prompts] != refs, "LoRA should change the greedy output"
    return model, prompts, refs


def test_llm_and_engine_take_a_peft_model(peft_case):
    model, prompts, refs = peft_case
    outs = LLM(model, num_kv_blocks=32).generate(prompts, greedy(MAX_NEW), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
    engine = Engine(model, None, EngineConfig(num_kv_blocks=32))
    assert engine.model is model.get_base_model()


def test_a_peft_model_runs_eagerly_even_when_compile_is_asked(peft_case, caplog):
    """A compiled graph would keep PEFT's adapters as traced: switching them off afterwards must still count."""
    model, prompts, refs = peft_case
    with caplog.at_level(logging.INFO, logger="paged_backend.engine"):
        llm = LLM(model, num_kv_blocks=32, compile=True)
    assert not llm.engine.runner.compiled
    assert "PEFT tuner layers runs eagerly" in caplog.text
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(MAX_NEW), use_tqdm=False)] == refs
    with model.disable_adapter():
        base = [hf_greedy(model, p, MAX_NEW) for p in prompts]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(MAX_NEW), use_tqdm=False)] == base


def test_generate_on_a_peft_model(peft_case):
    model, prompts, refs = peft_case
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompts[0]]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                             do_sample=False, cache_implementation="paged")
    assert out[0, len(prompts[0]):].tolist() == refs[0]


def test_switching_peft_adapters_between_calls_never_reuses_the_other_setting_kv():
    """The prefix cache keys a PEFT model's blocks by its adapter setting: the same prompt after
    `set_adapter` or under `disable_adapter()` computes its own K/V (it used to get the previous call's)."""
    model = get_peft_model(build("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                           adapter_name="a")
    model.add_adapter("b", LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj", "o_proj"]))
    randomise_lora_b(model, seed=1)
    model.eval()
    prompt = mixed_prompts(3)[2]  # long enough for full blocks in the prefix cache
    answers = []
    for adapter in ["a", "b", None, "a"]:
        model.set_adapter(adapter or "a")
        with torch.no_grad(), (model.disable_adapter() if adapter is None else contextlib.nullcontext()):
            ref = hf_greedy(model, prompt, MAX_NEW)
            out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                                 do_sample=False, cache_implementation="paged")
        assert out[0, len(prompt):].tolist() == ref, adapter
        answers.append(ref)
    assert len({tuple(a) for a in answers}) == 3, "each setting should answer differently, or this could not fail"


def test_chat_paged_takes_a_peft_model(peft_case):
    """`ChatPaged(model=peft_model)` builds its engine on the LoRA model (token prompts: no tokenizer here)."""
    from paged_backend.integrations.langchain import ChatPaged

    model, prompts, refs = peft_case
    aengine = ChatPaged(model=model, engine_config={"num_kv_blocks": 32}).async_engine
    assert aengine.engine.model is model.get_base_model()
    *_, final = aengine.stream(prompts[1], greedy(MAX_NEW))
    assert final.outputs[0].token_ids == refs[1]


def test_prompt_learning_adapter_is_refused():
    model = get_peft_model(build("llama"), PrefixTuningConfig(num_virtual_tokens=4, task_type="CAUSAL_LM"))
    with pytest.raises(UnsupportedArchitectureError, match="prompt-learning"):
        LLM(model, num_kv_blocks=8)
