"""LoRA adapters through the integrations: LangChain's ChatPaged and PagedLLM answer with their `lora`
(or a `bind(lora=...)` override) exactly as the PEFT model with that adapter active; a PEFT model's
`generate(..., adapter_names=[...], cache_implementation="paged")` equals PEFT's own mixed batch."""

from __future__ import annotations

import pytest
import torch
from helpers.lora import (
    MAX_NEW,
    PROMPT,
    peft_text,
    peft_with_adapters,
    saved_peft_model,
)
from helpers.server import tiny_llama
from langchain_core.messages import HumanMessage
from paged_backend.integrations.langchain import ChatPaged, PagedLLM
from paged_backend.integrations.transformers_generate import engine_for

from paged_backend import LLM, LoRARequest

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tokenizer, model, folder = saved_peft_model(tmp_path_factory)
    llm = LLM(tiny_llama(tokenizer), tokenizer=tokenizer, enable_lora=True, num_kv_blocks=64)
    llm.add_lora("french", model, adapter_name="french")
    return llm, model, tokenizer, folder


def test_chat_paged_answers_with_its_adapter_and_bind_overrides_it(setup):
    llm, model, tokenizer, folder = setup
    chat = ChatPaged(model=llm, lora="french", temperature=0.0, max_tokens=MAX_NEW)
    messages = [HumanMessage("say hello")]
    ids = chat.encode(chat.prepare(messages, None, {}))
    refs = {name: peft_text(model, tokenizer, ids, name) for name in (None, "french", "legal")}
    assert len(set(refs.values())) == 3, "each adapter should change the answer"
    assert chat.invoke(messages).content == refs["french"]
    assert "".join(c.content for c in chat.stream(messages)) == refs["french"]
    assert chat.bind(lora=None).invoke(messages).content == refs[None]
    legal = LoRARequest("legal", str(folder))  # registered on first use
    assert chat.bind(lora=legal).invoke(messages).content == refs["legal"]
    with pytest.raises(ValueError, match="unknown LoRA adapter 'german'"):
        chat.bind(lora="german").invoke(messages)


async def test_paged_llm_takes_a_lora_per_call(setup):
    llm, model, tokenizer, _ = setup
    completer = PagedLLM(model=llm, temperature=0.0, max_tokens=MAX_NEW)
    ids = tokenizer(PROMPT)["input_ids"]
    assert completer.invoke(PROMPT, lora="french") == peft_text(model, tokenizer, ids, "french")
    assert await completer.ainvoke(PROMPT) == peft_text(model, tokenizer, ids, None)


def test_peft_generate_with_adapter_names_per_row():
    model = peft_with_adapters()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 11, 12, 13, 14], [0, 15, 16, 17, 18, 19]])
    mask = (torch.arange(6) >= torch.tensor([[0], [2], [1]])).long()
    names = ["alpha", "__base__", "gamma"]
    options = {"attention_mask": mask, "max_new_tokens": MAX_NEW, "min_new_tokens": MAX_NEW, "do_sample": False}
    with torch.no_grad():
        expected = model.generate(input_ids=ids, adapter_names=names, **options)
        paged = model.generate(input_ids=ids, adapter_names=names, cache_implementation="paged", **options)
        assert len({tuple(row[6:].tolist()) for row in expected}) == 3
        assert paged.tolist() == expected.tolist()
        engine = engine_for(model.get_base_model())  # the rows ran on the engine, with its adapters
        assert engine.config.enable_lora and engine.list_loras() == ["__base__alpha", "__base__gamma"]
        # Afterwards PEFT's own state is as it was: a plain call runs the active adapter on every row.
        model.set_adapter("beta")
        plain = model.generate(input_ids=ids, cache_implementation="paged", **options)
        assert plain.tolist() == model.generate(input_ids=ids, **options).tolist()
    assert not any(hook for m in model.modules() for hook in m._forward_pre_hooks.values())
