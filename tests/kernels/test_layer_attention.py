"""LayerAttention: one frozen record of what a layer's attention computes, read by every backend."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paged_backend.kernels import LayerAttention


def test_a_record_is_frozen_and_the_same_record_by_identity() -> None:
    layer = LayerAttention(0.125, window=8, sinks=torch.zeros(4))
    with pytest.raises(dataclasses.FrozenInstanceError):
        layer.window = 16
    assert layer == layer and layer != LayerAttention(0.125, window=8, sinks=torch.zeros(4))  # tensors: no == bool


@pytest.mark.parametrize(("options", "masks_only"), [
    ({}, True), ({"window": 4, "chunk": 8}, True), ({"softcap": 30.0}, False),
    ({"alibi_slopes": torch.ones(2)}, False), ({"sinks": torch.ones(2)}, False),
])
def test_masks_only_says_whether_scores_stay_plain(options: dict, masks_only: bool) -> None:
    assert LayerAttention(1.0, **options).masks_only == masks_only


def test_hides_keys_once_a_sequence_outgrows_its_window_or_chunk() -> None:
    assert not LayerAttention(1.0).hides_keys(10_000)
    window, chunk = LayerAttention(1.0, window=8), LayerAttention(1.0, chunk=8)
    assert [window.hides_keys(n) for n in (8, 9)] == [False, True]
    assert [chunk.hides_keys(n) for n in (8, 9)] == [False, True]
