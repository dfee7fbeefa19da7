"""Shared helpers for engine tests: HF reference generation and running an engine to completion."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch

from paged_backend import Engine, EngineConfig, RequestOutput, SamplingParams


def mixed_prompts(n: int = 12, vocab: int = 256, seed: int = 0) -> list[list[int]]:
    """Prompts of different lengths (3 to about 40 tokens), deterministic."""
    g = torch.Generator().manual_seed(seed)
    lengths = [3 + (7 * i) % 38 for i in range(n)]
    return [torch.randint(1, vocab, (length,), generator=g).tolist() for length in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The reference: plain `generate`, greedy, forced to run `max_new_tokens` (eos banned)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


FP32_DECODE_SDPA = "sdpa_fp32_decode"


def sdpa_fp32_decode(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, with the rows of a bf16/fp16 model that the engine's CPU attention computes in
    fp32 computed in fp32 and rounded back: one-query (decode) rows (torch_attention.py), and, where the compiled
    kernel is built, every row of a bf16 sequence of at most SHORT_SEQUENCE tokens (cpu_paged_attention.py)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from paged_backend.kernels import cpu_paged_attention

    short = (query.dtype == torch.bfloat16 and key.shape[2] <= cpu_paged_attention.SHORT_SEQUENCE
             and cpu_paged_attention.library() is not None)
    if (query.shape[2] != 1 and not short) or query.dtype not in (torch.bfloat16, torch.float16):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
    return out.to(query.dtype), weights


def hf_greedy_fp32_decode_attention(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """hf_greedy with the engine's fp32 attention rows (sdpa_fp32_decode): the reference for bf16/fp16 models."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(FP32_DECODE_SDPA, sdpa_fp32_decode)
    AttentionMaskInterface.register(FP32_DECODE_SDPA, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(FP32_DECODE_SDPA)
    try:
        return hf_greedy(model, prompt, max_new_tokens)
    finally:
        model.set_attn_implementation(previous)


def run_to_completion(engine: Engine) -> dict[str, RequestOutput]:
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return finals


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def assert_all_blocks_free(engine: Engine) -> None:
    pool = engine.kv.pool
    assert pool.num_free == pool.num_blocks, f"{pool.num_blocks - pool.num_free} KV blocks leaked"
    assert all(count == 0 for count in pool.ref_counts)


def hf_case(name: str, model, max_new: int) -> tuple:
    """(name, model, the mixed prompts, HF generate's greedy answer to each): an architecture's test case."""
    prompts = mixed_prompts()
    return name, model, prompts, [hf_greedy(model, p, max_new) for p in prompts]


def check_against_hf(model, prompts: list[list[int]], refs: list[list[int]], config, max_new: int,
                     late_from: int | None = None) -> Engine:
    """Run `prompts` greedily through a new engine (those from `late_from` on joining after a few steps)
    and assert each equals its HF reference, finishes on length, and every block comes back."""
    engine = Engine(model, None, config)
    late_from = len(prompts) if late_from is None else late_from
    ids = [engine.add_request(p, greedy(max_new)) for p in prompts[:late_from]]
    finals: dict[str, RequestOutput] = {}
    for _ in range(3):  # a few steps with the first requests alone, then the rest join the running batch
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    ids += [engine.add_request(p, greedy(max_new)) for p in prompts[late_from:]]
    finals.update(run_to_completion(engine))
    for i, rid in enumerate(ids):
        assert finals[rid].outputs[0].token_ids == refs[i], f"request {i} differs"
        assert finals[rid].outputs[0].finish_reason == "length"
    assert_all_blocks_free(engine)
    return engine


@contextlib.contextmanager
def peak_in_flight(engine: Engine):
    """Records, before every engine step, the most requests the engine held at once."""
    peaks = [0]
    original = engine.step

    def step():
        peaks[0] = max(peaks[0], len(engine.requests))
        return original()

    engine.step = step
    try:
        yield peaks
    finally:
        del engine.step


MAX_NEW = 12


def check_engine(model, prompts, refs, config: EngineConfig, late_from: int | None = None) -> Engine:
    return check_against_hf(model, prompts, refs, config, MAX_NEW, late_from)


MT_BENCH = Path(os.environ.get("PAGED_BACKEND_DATA", Path(__file__).resolve().parents[2] / "benchmarks" / "data"))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from a second intra-op thread, and lose a lot when the cores are shared.
    Autouse in each module that imports it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
