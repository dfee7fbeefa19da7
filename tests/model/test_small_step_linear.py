"""Small CPU steps run their linears as `weight @ x^T` (model/quantized/small_step_linear.py): the same values as
F.linear, only for fp32 steps of 2-5 tokens, and the engine's greedy tokens still equal HF's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.engine import (
    assert_all_blocks_free,
    greedy,
    hf_greedy,
    mixed_prompts,
    run_to_completion,
)
from helpers.models import build
from helpers.tolerances import tolerance

from paged_backend import Engine, EngineConfig
from paged_backend.model.quantized import small_step_linear as ssl


@pytest.mark.parametrize("shape", [(3, 48), (1, 4, 48), (2, 2, 48)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_transposed_linear_equals_f_linear(shape, with_bias):
    torch.manual_seed(0)
    x, weight = torch.randn(shape), torch.randn(80, 48)
    bias = torch.randn(80) if with_bias else None
    got = ssl.linear_transposed(x, weight, bias)
    assert got.shape == F.linear(x, weight, bias).shape and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, weight, bias), **tolerance(x.dtype, "kernel"))


def count_transposed(monkeypatch) -> list[int]:
    rows: list[int] = []
    original = ssl.linear_transposed

    def counting(x, weight, bias):
        rows.append(x.numel() // x.shape[-1])
        return original(x, weight, bias)

    monkeypatch.setattr(ssl, "linear_transposed", counting)
    return rows


def test_only_fp32_cpu_steps_of_two_to_five_rows_are_rerouted(monkeypatch):
    rows = count_transposed(monkeypatch)
    weight = torch.randn(16, 8)
    with ssl.small_step_linear(3, torch.device("cpu")):
        for n in (1, 2, 5, 6):
            F.linear(torch.randn(n, 8), weight)
        F.linear(torch.randn(3, 8, dtype=torch.bfloat16), weight.bfloat16())
    with ssl.small_step_linear(1, torch.device("cpu")), ssl.small_step_linear(8, torch.device("cpu")):
        F.linear(torch.randn(3, 8), weight)
    assert rows == [2, 5]


def test_engine_steps_of_a_few_tokens_match_hf_greedy(monkeypatch):
    """Three requests decoding together make steps of three tokens, which take the transposed path."""
    model = build("llama")
    prompts = mixed_prompts(3)
    refs = [hf_greedy(model, p, 8) for p in prompts]
    rows = count_transposed(monkeypatch)
    engine = Engine(model, None, EngineConfig(num_kv_blocks=64, compile=False))
    ids = [engine.add_request(p, greedy(8)) for p in prompts]
    finals = run_to_completion(engine)
    assert [finals[i].outputs[0].token_ids for i in ids] == refs
    assert 3 in rows
    assert_all_blocks_free(engine)
