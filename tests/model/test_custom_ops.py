"""The paged attention custom op (a layer's cache write and attention in one): torch's op checks
(schema, fake implementation, autograd registration, dispatch under compile) and the step context it
reads."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paged_backend.model.paged.step_context import StepContext, step_context
from paged_backend.kernels import AttentionMetadata, LayerAttention, PagedCaches, paged_attention, write_kv_cache

from paged_backend.model.paged import custom_ops


def step_metadata(seq_lens: list[int], new_tokens: list[int], block_size: int = 4) -> AttentionMetadata:
    """Sequence i owns blocks i*8.. and its last `new_tokens[i]` positions are this step's queries."""
    blocks = torch.arange(len(seq_lens) * 8, dtype=torch.int32).view(len(seq_lens), 8)
    starts = [0]
    slots = []
    for i, (length, new) in enumerate(zip(seq_lens, new_tokens)):
        starts.append(starts[-1] + new)
        positions = torch.arange(length - new, length)
        slots.append(blocks[i, positions // block_size].long() * block_size + positions % block_size)
    return AttentionMetadata(
        slot_mapping=torch.cat(slots), block_tables=blocks, query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_size=block_size, query_start_loc_host=starts,
        seq_lens_host=list(seq_lens), max_query_len=max(new_tokens), max_seq_len=max(seq_lens))


def test_opcheck_and_the_op_writes_then_attends():
    torch.manual_seed(0)
    kv = torch.randn(2, 2, 2, 16 * 4, 8)  # 2 layers, 2 KV heads, 16 blocks of 4, head_dim 8
    metadata = step_metadata([5, 3], [2, 3])
    tokens = 5
    key, value = torch.randn(tokens, 2, 8), torch.randn(tokens, 2, 8)
    query = torch.randn(tokens, 4, 8)
    # The oracle: the kernels' separate write, then attention over what it wrote.
    expected_kv = kv.clone()
    write_kv_cache(key, value, expected_kv[1, 0], expected_kv[1, 1], metadata.slot_mapping)
    attention = LayerAttention(0.35)
    expected = paged_attention(query, PagedCaches(expected_kv[1, 0], expected_kv[1, 1]), metadata, attention)
    with step_context(StepContext(metadata, kv, attention=(LayerAttention(1.0), attention))):
        out = custom_ops.paged_attention(query, key, value, 1)
        layer = torch.tensor(1)  # the op takes the layer as a graph gives it (custom_ops.layer_operand)
        torch.library.opcheck(custom_ops.paged_attention_op, (query, key, value, layer))
    with step_context(StepContext(metadata, kv.clone(), attention=(None, LayerAttention(0.35, 2, 5.0)))):
        torch.library.opcheck(custom_ops.paged_attention_op, (query, key, value, layer))
    torch.testing.assert_close(out, expected)
    # The write reached layer 1 of the step's cache, at the slot mapping, and nothing else.
    assert torch.equal(kv[1, 0, :, metadata.slot_mapping].transpose(0, 1), key)
    assert torch.equal(kv[1, 1, :, metadata.slot_mapping].transpose(0, 1), value)
    assert torch.equal(kv, expected_kv)


def test_the_op_attends_with_the_record_the_step_holds_for_its_layer():
    """The op takes the layer's index alone; its window and scale come from the step context's record."""
    torch.manual_seed(1)
    kv = torch.randn(1, 2, 2, 16 * 4, 8)
    metadata = step_metadata([7, 6], [1, 6])
    key, value, query = torch.randn(7, 2, 8), torch.randn(7, 2, 8), torch.randn(7, 4, 8)
    outputs = []
    for attention in (LayerAttention(0.35), LayerAttention(0.35, window=2)):
        written = kv.clone()
        with step_context(StepContext(dataclasses.replace(metadata, derived={}), written, attention=(attention,))):
            outputs.append(custom_ops.paged_attention(query, key, value, 0))
        expected = paged_attention(query, PagedCaches(written[0, 0], written[0, 1]), metadata, attention)
        torch.testing.assert_close(outputs[-1], expected)
    assert not torch.allclose(*outputs)  # the window in the record changed the answer


def test_a_layer_without_a_record_is_refused_by_name():
    kv = torch.zeros(2, 2, 1, 16, 8)
    with step_context(StepContext(step_metadata([1], [1]), kv, attention=(LayerAttention(1.0),))):
        with pytest.raises(RuntimeError, match="layer 1 attended .* without an attention record"):
            custom_ops.paged_attention(torch.zeros(1, 2, 8), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), 1)


def test_the_op_refuses_to_run_outside_a_step():
    with pytest.raises(RuntimeError, match="outside an engine step"):
        custom_ops.paged_attention(torch.zeros(1, 2, 8), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), 0)


def test_an_eager_forward_calls_the_implementations_without_the_dispatcher(monkeypatch):
    from helpers.models import build

    from paged_backend import LLM, SamplingParams

    llm = LLM(build("llama"), compile=False, num_kv_blocks=16)

    def dispatched(*args, **kwargs):
        raise AssertionError("an eager step went through the registered op")

    monkeypatch.setattr(custom_ops, "paged_attention_op", dispatched)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
