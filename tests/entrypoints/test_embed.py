"""LLM.embed and Engine.add_pooling_request: a prompt's final hidden states pooled (last token or mean)
and L2-normalised, equal to the HF model's own forward (`output_hidden_states`), whatever runs beside
them (generation, chunked prefill, preemption), leaving no KV behind."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from helpers.engine import (
    assert_all_blocks_free,
    greedy,
    hf_greedy,
    mixed_prompts,
    run_to_completion,
)
from helpers.models import CONFIGS, build, build_from_config

from paged_backend import LLM, Engine, EngineConfig
from paged_backend.core.pooling import PoolingParams

pytestmark = pytest.mark.timeout(180)


def hf_embedding(model, prompt: list[int], pooling: str = "last", dimensions: int | None = None) -> torch.Tensor:
    """The reference: the model's last hidden states from its own forward, pooled and normalised."""
    with torch.no_grad():
        hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
    vector = hidden[-1] if pooling == "last" else hidden.mean(0)
    return torch.nn.functional.normalize(vector[:dimensions], dim=-1)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_the_hf_forward(arch: str, pooling: str) -> None:
    reference, prompts = build(arch), mixed_prompts(8)
    expected = [hf_embedding(reference, p, pooling) for p in prompts]
    llm = LLM(build(arch), num_kv_blocks=64, max_num_batched_tokens=48)  # long prompts run in chunks
    outputs = llm.embed(prompts, PoolingParams(pooling=pooling), use_tqdm=False)
    for output, want in zip(outputs, expected):
        assert output.finished and output.error is None
        assert output.embedding.dtype == torch.float32 and output.embedding.shape == want.shape
        torch.testing.assert_close(output.embedding, want, atol=2e-5, rtol=1e-4)
        assert abs(float(output.embedding.norm()) - 1.0) < 1e-5
    assert_all_blocks_free(llm.engine)


def test_pooling_in_mixed_batches_with_generation_and_preemption() -> None:
    reference, prompts = build("llama"), mixed_prompts(12)
    expected = {i: hf_embedding(reference, p, "mean" if i % 2 else "last") for i, p in enumerate(prompts[:6])}
    tokens = {i: hf_greedy(reference, p, 12) for i, p in enumerate(prompts[6:], start=6)}
    # Few blocks and a small step: requests are chunked, share steps, and some are preempted.
    engine = Engine(build("llama"), config=EngineConfig(num_kv_blocks=12, block_size=8, max_num_batched_tokens=40))
    for i, prompt in enumerate(prompts):
        if i < 6:
            engine.add_pooling_request(prompt, PoolingParams(pooling="mean" if i % 2 else "last"), request_id=str(i))
        else:
            engine.add_request(prompt, greedy(12), request_id=str(i))
    finals = run_to_completion(engine)
    assert engine.scheduler.num_preemptions > 0
    for i, want in expected.items():
        assert finals[str(i)].outputs[0].token_ids == []
        torch.testing.assert_close(finals[str(i)].embedding, want, atol=2e-5, rtol=1e-4)
    for i, want in tokens.items():
        assert finals[str(i)].outputs[0].token_ids == want and finals[str(i)].embedding is None
    assert_all_blocks_free(engine)


def test_pooling_requests_neither_use_nor_fill_the_prefix_cache() -> None:
    prompt = mixed_prompts(12)[4]  # 31 tokens: three full blocks of 8
    engine = Engine(build("llama"), config=EngineConfig(num_kv_blocks=32, block_size=8))
    engine.add_pooling_request(prompt, request_id="embed")
    run_to_completion(engine)
    engine.add_request(prompt, greedy(2), request_id="after")
    assert run_to_completion(engine)["after"].num_cached_tokens == 0  # nothing was registered
    engine.add_pooling_request(prompt, request_id="again")  # the generation's blocks are cached now
    again = run_to_completion(engine)["again"]
    assert again.num_cached_tokens == 0
    torch.testing.assert_close(again.embedding, hf_embedding(build("llama"), prompt), atol=2e-5, rtol=1e-4)


def test_bad_input_is_refused_before_anything_runs() -> None:
    llm = LLM(build("llama"), num_kv_blocks=8, block_size=8)  # a 64-token context
    context = llm.engine.max_model_len
    assert llm.embed([[1] * context], use_tqdm=False)[0].embedding.shape == (64,)  # the whole context fits
    with pytest.raises(ValueError, match=r"prompt 1: .*maximum context length is 64 tokens.*\(65 in the input\)"):
        llm.embed([[1, 2], [1] * (context + 1)], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 0: the input is empty"):
        llm.embed([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.embed([[10**6]], use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions=16: .* not trained to be truncated"):
        llm.embed([[1, 2]], PoolingParams(dimensions=16), use_tqdm=False)
    with pytest.raises(ValueError, match="pooling must be one of"):
        PoolingParams(pooling="cls")
    assert not llm.engine.has_unfinished_requests()
    assert llm.embed([[1, 2]], PoolingParams(dimensions=64), use_tqdm=False)[0].embedding.shape == (64,)


def test_matryoshka_models_truncate_then_normalise() -> None:
    def config():
        made = CONFIGS["llama"]()
        made.matryoshka_dimensions = [16, 32]
        return made

    prompt = mixed_prompts(3)[2]
    want = hf_embedding(build_from_config(config), prompt, dimensions=16)
    llm = LLM(build_from_config(config), num_kv_blocks=16)
    got = llm.embed([prompt], PoolingParams(dimensions=16), use_tqdm=False)[0].embedding
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match=r"dimensions=8: this model supports \[16, 32\]"):
        llm.embed([prompt], PoolingParams(dimensions=8), use_tqdm=False)


def test_unnormalised_last_token_is_the_raw_hidden_state() -> None:
    reference, prompt = build("llama"), mixed_prompts(2)[1]
    with torch.no_grad():
        raw = reference(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1]
    got = LLM(build("llama"), num_kv_blocks=16).embed([prompt], PoolingParams(normalize=False), use_tqdm=False)
    torch.testing.assert_close(got[0].embedding, raw, atol=2e-5, rtol=1e-4)


def test_decoder_hidden_states_are_what_hf_reports_last() -> None:
    """The engine reads the decoder's output; HF's `hidden_states[-1]` is the same tensor (normed)."""
    model = build("llama")
    ids = torch.tensor([mixed_prompts(2)[1]])
    with torch.no_grad():
        assert torch.equal(model.get_decoder()(ids).last_hidden_state,
                           model(ids, output_hidden_states=True).hidden_states[-1])
    assert isinstance(model.get_decoder(), tf.LlamaModel)


@pytest.mark.slow  # compiles, or runs a whole suite or fuzzer: the slow tier
def test_a_compiled_engine_pools_eagerly_and_keeps_generating_compiled() -> None:
    reference, prompts = build("llama"), mixed_prompts(4)
    expected = [hf_embedding(reference, p, "mean") for p in prompts[:2]]
    tokens = [hf_greedy(reference, p, 6) for p in prompts[2:]]
    engine = Engine(build("llama"), config=EngineConfig(num_kv_blocks=32, compile=True))
    assert engine.runner.compiled
    for i, prompt in enumerate(prompts):
        if i < 2:
            engine.add_pooling_request(prompt, PoolingParams(pooling="mean"), request_id=str(i))
        else:
            engine.add_request(prompt, greedy(6), request_id=str(i))
    finals = run_to_completion(engine)
    for i, want in enumerate(expected):
        torch.testing.assert_close(finals[str(i)].embedding, want, atol=2e-5, rtol=1e-4)
    assert [finals[str(i)].outputs[0].token_ids for i in (2, 3)] == tokens
    assert engine.runner.forward_model is not engine.model  # pooling left the compiled forward in place


async def test_async_engine_embeds_concurrently_and_a_cancelled_call_frees_its_blocks() -> None:
    import asyncio

    from paged_backend import AsyncEngine

    reference, prompts = build("llama"), mixed_prompts(6)
    aengine = AsyncEngine(Engine(build("llama"), config=EngineConfig(num_kv_blocks=32)))
    try:
        outputs = await asyncio.gather(*(aengine.embed(p) for p in prompts))
        for output, prompt in zip(outputs, prompts):
            torch.testing.assert_close(output.embedding, hf_embedding(reference, prompt), atol=2e-5, rtol=1e-4)
        with pytest.raises(ValueError, match="the input is empty"):
            await aengine.embed([])
        task = asyncio.ensure_future(aengine.embed([1] * 200, request_id="gone"))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if not aengine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.05)
        assert_all_blocks_free(aengine.engine)
    finally:
        aengine.shutdown()
