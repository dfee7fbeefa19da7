"""Head sizes: the Triton kernel serves every size from 16 to 256, powers of two or not (the tile is
padded and the padding masked); the dispatcher sends smaller heads, which `tl.dot` cannot compile
(the interpreter does not check this), and larger ones to the PyTorch path instead of failing."""

from __future__ import annotations

import helpers.triton_interpret  # noqa: F401  (must precede every Triton kernel import)
import pytest
import torch
from helpers.kernels import check_attention, make_batch
from paged_backend.kernels import dispatch, triton_attention

CUDA = torch.device("cuda")  # a device object only: routing is decided from it, nothing runs there


@pytest.mark.parametrize("head_dim", [16, 32, 48, 80, 96, 112, 256])
def test_triton_serves_head_sizes_from_16_to_256(head_dim: int) -> None:
    assert dispatch.select_backend(CUDA, torch.bfloat16, head_dim) == "triton"


@pytest.mark.parametrize("head_dim", [4, 8, 15, 320])
def test_other_head_sizes_go_to_pytorch_even_when_triton_is_forced(head_dim: int) -> None:
    assert dispatch.select_backend(CUDA, torch.bfloat16, head_dim) == "torch"
    with dispatch.use_backend("triton"):
        assert dispatch.select_backend(CUDA, torch.bfloat16, head_dim) == "torch"


@pytest.mark.parametrize("head_dim", [32, 48, 80, 96])
def test_kernel_matches_oracle_for_head_size(head_dim: int) -> None:
    """Decode, chunk on context and fresh prefill at once, GQA 2, fp32 in the interpreter."""
    check_attention(make_batch([1, 3, 4], [9, 7, 4], group=2, head_dim=head_dim, block_size=4))


def test_engine_with_head_size_8_runs_on_pytorch_under_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """A qwen2 model with 8 heads in a 64-wide hidden size (head_dim 8): with Triton asked for, every
    request still equals HF generate, and the Triton attention kernel is never called."""
    import transformers as tf
    from helpers.engine import greedy, hf_greedy, mixed_prompts, run_to_completion
    from helpers.models import _common, build_from_config

    from paged_backend import Engine, EngineConfig

    model = build_from_config(lambda: tf.Qwen2Config(num_attention_heads=8, num_key_value_heads=4, **_common()))
    prompts = mixed_prompts(4)
    expected = [hf_greedy(model, p, 5) for p in prompts]
    monkeypatch.setattr(triton_attention, "paged_attention", lambda *a, **k: pytest.fail("Triton got head_dim 8"))
    with dispatch.use_backend("triton"):
        engine = Engine(model, config=EngineConfig(block_size=4, max_num_batched_tokens=16, num_kv_blocks=32))
        ids = [engine.add_request(p, greedy(5)) for p in prompts]
        finals = run_to_completion(engine)
    assert engine.cache.shape.head_dim == 8
    assert [finals[i].outputs[0].token_ids for i in ids] == expected
