"""An fp32 model's LM head kept in the 16 bits its checkpoint has (model/quantized/half_head.py): replaced only where
every value is exactly an fp16 (else bf16) number, computing the same logits through the CPU kernel (or, switched
off, through the weight widened per call), taking a tied embedding along; the engine applies it to a folder it loads
(greedy tokens equal generate's on the fp32 model, eager and compiled) and leaves a caller's own model, LoRA engines
and every other head as they are."""

from __future__ import annotations

import pytest
import torch
from helpers.engine import assert_all_blocks_free, hf_greedy, mixed_prompts, one_thread  # noqa: F401
from helpers.models import CONFIGS, build, build_from_config
from transformers import AutoModelForCausalLM

from paged_backend import LLM, SamplingParams
from paged_backend.kernels import cpu_int8_matmul
from paged_backend.model.quantized.half_head import (
    CHECK_ROWS,
    HalfEmbedding,
    HalfLinear,
    exact_half,
    keep_head_in_half,
)

pytestmark = pytest.mark.skipif(
    not cpu_int8_matmul.serves_half(torch.zeros(1, 8), torch.zeros(8, 8, dtype=torch.bfloat16)),
    reason="no C compiler on this machine")

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)


def rounded(model: torch.nn.Module, dtype: torch.dtype = torch.float16) -> torch.nn.Module:
    """`model` with every weight rounded to `dtype`'s values (kept in fp32), as a 16-bit checkpoint loads."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
    return model


def logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def test_an_exact_fp16_head_is_kept_in_fp16_and_gives_the_same_logits() -> None:
    model = rounded(build("llama"))
    before = logits(model, mixed_prompts(1)[0])
    assert keep_head_in_half(model) == "float16"
    assert isinstance(model.lm_head, HalfLinear) and model.lm_head.weight16.dtype == torch.float16
    assert type(model.get_input_embeddings()) is torch.nn.Embedding  # not tied: the embedding keeps its own table
    torch.testing.assert_close(logits(model, mixed_prompts(1)[0]), before, rtol=1e-5, atol=1e-5)
    with cpu_int8_matmul.switched_off():  # the weight widened per call instead of the kernel: the same numbers
        torch.testing.assert_close(logits(model, mixed_prompts(1)[0]), before, rtol=1e-5, atol=1e-5)


def test_a_head_exact_in_bf16_alone_is_kept_in_bf16() -> None:
    model = rounded(build("llama"), torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight[0, 0] = 2.0**-30  # a bf16 number fp16 cannot hold
    assert keep_head_in_half(model) == "bfloat16"
    assert model.lm_head.weight16.dtype == torch.bfloat16


def test_a_head_no_16_bit_type_holds_exactly_stays_as_it_was() -> None:
    model = build("llama")
    head = model.lm_head
    assert keep_head_in_half(model) is None
    assert model.lm_head is head


def test_every_row_is_checked_past_the_first_chunk() -> None:
    weight = torch.randn(CHECK_ROWS + 5, 8).half().float()
    assert exact_half(weight).dtype == torch.float16
    weight[-1, -1] = 1 + 2.0**-20  # neither 16-bit type holds it
    assert exact_half(weight) is None


def test_a_tied_embedding_shares_the_16_bit_table_and_the_fp32_one_is_freed() -> None:
    def tied_llama():
        config = CONFIGS["llama"]()
        config.tie_word_embeddings = True
        return config

    model = rounded(build_from_config(tied_llama))
    assert model.lm_head.weight is model.get_input_embeddings().weight
    ids = mixed_prompts(1)[0]
    before = logits(model, ids)
    assert keep_head_in_half(model) == "float16"
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, HalfEmbedding) and embedding.weight16 is model.lm_head.weight16
    assert not [name for name, p in model.named_parameters() if p.shape == model.lm_head.weight16.shape]
    torch.testing.assert_close(logits(model, ids), before, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def fp16_folder(tmp_path_factory):
    """A tiny llama saved in fp16, as most checkpoints (and GPTQ/AWQ heads) are."""
    folder = tmp_path_factory.mktemp("fp16-llama")
    build("llama").half().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_engine_keeps_a_loaded_folders_head_in_16_bits_and_answers_as_generate(fp16_folder, compiled) -> None:
    reference = AutoModelForCausalLM.from_pretrained(fp16_folder, dtype=torch.float32)
    prompts = mixed_prompts(6)
    refs = [hf_greedy(reference, p, MAX_NEW) for p in prompts]
    llm = LLM(str(fp16_folder), dtype="float32", compile=compiled, num_kv_blocks=24, block_size=4,
              max_num_batched_tokens=16)
    assert isinstance(llm.model.lm_head, HalfLinear)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == refs
    assert_all_blocks_free(llm.engine)


def test_a_callers_model_and_a_lora_engine_keep_their_heads(fp16_folder) -> None:
    model = AutoModelForCausalLM.from_pretrained(fp16_folder, dtype=torch.float32)
    head = model.lm_head
    assert type(LLM(model, compile=False).model.lm_head) is torch.nn.Linear and model.lm_head is head
    llm = LLM(str(fp16_folder), dtype="float32", compile=False, enable_lora=True)
    assert type(llm.model.lm_head) is torch.nn.Linear


def test_a_draft_model_runs_beside_a_target_with_a_16_bit_head(fp16_folder) -> None:
    """The draft's vocabulary is checked against the target's head, which holds no `weight`."""
    reference = AutoModelForCausalLM.from_pretrained(fp16_folder, dtype=torch.float32)
    prompts = mixed_prompts(3)
    refs = [hf_greedy(reference, p, MAX_NEW) for p in prompts]
    draft = {"method": "draft_model", "model": build("llama", seed=1), "num_speculative_tokens": 2}
    llm = LLM(str(fp16_folder), dtype="float32", compile=False, num_kv_blocks=64, speculative_config=draft)
    assert isinstance(llm.model.lm_head, HalfLinear)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == refs
