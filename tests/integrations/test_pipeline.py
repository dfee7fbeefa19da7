"""PagedTextGenerationPipeline against the stock text-generation pipeline: the same outputs for every input
form, with all inputs of a call in the engine together. A tiny random Llama with the default model's
vocabulary gives real tokenization and a real chat template at tiny-model speed."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.engine import one_thread  # noqa: F401  (autouse: this module runs on one thread)
from paged_backend.integrations import transformers_generate as tg
from paged_backend.integrations.pipeline import PagedTextGenerationPipeline, pipeline
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig
from transformers.pipelines.pt_utils import KeyDataset

from paged_backend import EngineConfig
from paged_backend.model.loading.default_model import default_model_path

PROMPTS = ["The capital of France is", "Once upon a time", "def fib(n):", "Hello"]
CHATS = [[{"role": "user", "content": "What is 2+2?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]]
GREEDY = {"max_new_tokens": 8, "do_sample": False}


def tiny_llama(tokenizer) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # spread the logits so greedy has no near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture(scope="module")
def stock(tokenizer):
    return transformers.pipeline("text-generation", model=tiny_llama(tokenizer), tokenizer=tokenizer)


@pytest.fixture(scope="module")
def paged(tokenizer):
    return transformers.pipeline("text-generation", model=tiny_llama(tokenizer), tokenizer=tokenizer,
                                 pipeline_class=PagedTextGenerationPipeline,
                                 engine_config=EngineConfig(num_kv_blocks=128, max_num_seqs=64))


@pytest.mark.parametrize("inputs", [PROMPTS, PROMPTS[0], CHATS, CHATS[0]], ids=["strings", "string", "chats", "chat"])
def test_input_forms_match_stock(stock, paged, inputs):
    assert isinstance(paged, PagedTextGenerationPipeline)
    assert paged(inputs, **GREEDY) == stock(inputs, **GREEDY)


@pytest.mark.parametrize("options", [
    {"return_full_text": False},
    {"return_tensors": True},
    {"max_new_tokens": 3},
    {"stop_sequence": "PLACEHOLDER"},
], ids=["new_text", "tensors", "max_new_tokens", "stop_sequence"])
def test_options_match_stock(stock, paged, options):
    if "stop_sequence" in options:  # a word the model writes, so the stop really happens
        text = stock(PROMPTS[1], return_full_text=False, **GREEDY)[0]["generated_text"]
        options = {"stop_sequence": text.split()[1]}
    assert paged(PROMPTS, **GREEDY | options) == stock(PROMPTS, **GREEDY | options)


def test_continue_final_message(stock, paged):
    chat = CHATS[0] + [{"role": "assistant", "content": "The answer is"}]
    assert paged(chat, **GREEDY) == stock(chat, **GREEDY)
    assert paged(chat, continue_final_message=False, **GREEDY) == stock(chat, continue_final_message=False, **GREEDY)


def test_num_return_sequences(stock, paged):
    # top_k=1 sampling is deterministic, so the copies must equal the stock ones.
    options = {"do_sample": True, "top_k": 1, "num_return_sequences": 2, "max_new_tokens": 6}
    out = paged(PROMPTS[:2], **options)
    assert out == stock(PROMPTS[:2], **options)
    assert [len(records) for records in out] == [2, 2]


def test_generator_and_dataset_inputs_stream_in_order(stock, paged):
    expected = stock(PROMPTS, **GREEDY)
    pulled = []

    def prompts():
        for p in PROMPTS * 3:
            pulled.append(p)
            yield p

    paged.max_rows = 2
    try:
        iterator = paged(prompts(), **GREEDY)
        first = next(iterator)
        assert len(pulled) < len(PROMPTS) * 3  # inputs are consumed lazily
        assert [first, *iterator] == expected * 3
    finally:
        paged.max_rows = tg.DEFAULT_MAX_ROWS
    dataset = KeyDataset([{"text": p} for p in PROMPTS], "text")
    assert list(paged(dataset, **GREEDY)) == expected


def test_thirty_two_prompts_make_one_engine_submission(paged, stock):
    engine = tg.engine_for(paged.model)
    events = []
    add, step = engine.add_request, engine.step

    def spy_add(*args, **kwargs):
        events.append("add")
        return add(*args, **kwargs)

    def spy_step():
        events.append("step")
        return step()

    engine.add_request, engine.step = spy_add, spy_step
    try:
        prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(32)]
        out = paged(prompts, max_new_tokens=3, do_sample=False)
    finally:
        del engine.add_request, engine.step
    assert events[:32] == ["add"] * 32 and "add" not in events[32:]
    assert out == stock(prompts, max_new_tokens=3, do_sample=False, batch_size=8)


def test_streamer_with_several_inputs_is_refused(paged, tokenizer):
    with pytest.raises(NotImplementedError, match="streamer"):
        paged(PROMPTS, streamer=transformers.TextStreamer(tokenizer), **GREEDY)


def test_pipeline_helper(tokenizer):
    pipe = pipeline(model=tiny_llama(tokenizer), tokenizer=tokenizer,
                    engine_config=EngineConfig(num_kv_blocks=32))
    assert isinstance(pipe, PagedTextGenerationPipeline)
    assert pipe.task == "text-generation"
    assert pipe(PROMPTS[0], max_new_tokens=2)[0]["generated_text"].startswith(PROMPTS[0])
    with pytest.raises(ValueError, match="text-generation"):
        pipeline("summarization", model=pipe.model, tokenizer=tokenizer)
