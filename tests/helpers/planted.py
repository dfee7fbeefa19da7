"""Planted faults in the compiled forward only: what the start-up check (fast_path_check.py) and gpu_check's
localisation must catch. Each patches `CompiledForward.__call__` for the test (monkeypatch undoes it); the traced
graphs are untouched, so nothing wrong reaches the compile cache."""

from __future__ import annotations

import pytest

from paged_backend.model.compiled.compilation import CompiledForward


def scale_in_compiled_steps(monkeypatch: pytest.MonkeyPatch, layer: int, projection: str, factor: float) -> None:
    """Every compiled step runs layer `layer`'s attention projection `projection` (q_proj, v_proj, o_proj, ...)
    `factor` times too large; eager steps run the model as it is."""
    call = CompiledForward.__call__

    def off(self, **kwargs):
        weight = getattr(self.model.model.layers[layer].self_attn, projection).weight
        weight.mul_(factor)
        try:
            return call(self, **kwargs)
        finally:
            weight.div_(factor)

    monkeypatch.setattr(CompiledForward, "__call__", off)


def lose_cache_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every compiled step gives back the cache as it found it: what it wrote is lost for the next step."""
    call = CompiledForward.__call__

    def forgetful(self, **kwargs):
        kv = kwargs["cache"].kv
        before = kv.clone()
        try:
            return call(self, **kwargs)
        finally:
            kv.copy_(before)

    monkeypatch.setattr(CompiledForward, "__call__", forgetful)
