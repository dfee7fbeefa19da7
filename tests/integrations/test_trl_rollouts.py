"""TRL's GRPO trainer makes its rollouts on the engine, through either of its transformers routes: the plain
`generate` path (`cache_implementation="paged"`) and the continuous-batching one (`generate_batch`). Three steps
train (the weights move) with TRL's defaults, bf16 autocast included, with and without a LoRA adapter."""

from __future__ import annotations

import datasets
import peft
import pytest
import torch
import trl
from helpers.server import build_chat_tokenizer, tiny_llama
from paged_backend.integrations import transformers_generate as tg

from paged_backend import EngineConfig
from paged_backend.engine import Engine


PROMPTS = ["count the apples", "name a color", "say hello", "pick a number"]


def prompt_dataset():
    """The prompts as a `datasets.Dataset`. Its fingerprint is given: datasets 5.1-5.2 fail to hash an in-memory
    table (pickling pyarrow's MonthDayNano type) when left to compute it."""
    import pyarrow

    return datasets.Dataset(pyarrow.table({"prompt": PROMPTS}), fingerprint="trl-rollout-prompts")


def reward_length(completions, **kwargs) -> list[float]:
    return [len(completion) / 10 for completion in completions]


@pytest.mark.parametrize("route, lora, batch_invariant", [
    ("generate", False, False), ("generate", True, False), ("generate_batch", False, False),
    ("generate_batch", True, False), ("generate", True, True), ("generate_batch", True, True),
], ids=["generate-full", "generate-lora", "generate_batch-full", "generate_batch-lora", "generate-lora-invariant",
        "generate_batch-lora-invariant"])
def test_grpo_steps_generate_on_the_engine(route: str, lora: bool, batch_invariant: bool, tmp_path,
                                           monkeypatch) -> None:
    torch.manual_seed(0)
    tokenizer = build_chat_tokenizer(PROMPTS + ["one two three four five six seven eight nine ten"])
    model = tiny_llama(tokenizer)
    config = EngineConfig(compile=False, num_kv_blocks=64, batch_invariant=batch_invariant)
    tg.engine_for(model, config)  # the engine TRL's calls will find
    steps, engines = [], []
    original_step, original_init = Engine.step, Engine.__init__
    monkeypatch.setattr(Engine, "step", lambda self: steps.append(self.config) or original_step(self))
    monkeypatch.setattr(Engine, "__init__", lambda self, *a, **k: engines.append(1) or original_init(self, *a, **k))
    route_options = {"use_transformers_continuous_batching": True} if route == "generate_batch" else {}
    args = trl.GRPOConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, num_generations=2,
                          max_completion_length=8, use_cpu=True, report_to=[], save_strategy="no",
                          learning_rate=1e-2, cache_implementation="paged", **route_options)
    peft_config = None
    if lora:
        peft_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward_length, args=args, processing_class=tokenizer,
                              train_dataset=prompt_dataset(), peft_config=peft_config)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert trainer.state.global_step == 3
    assert steps and all(c == config for c in steps), "the rollouts ran on an engine of another config"
    # The engine and its KV pool persist across rollouts; TRL's generate_batch route casts the model to bf16
    # before its first rollout, which builds one engine for the bf16 weights.
    assert len(engines) == (1 if route == "generate_batch" else 0)
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(before[name], after[name].detach()) for name in before)  # it trained
