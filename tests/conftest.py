"""Shared fixtures. The default real model is loaded once per test session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_llm():
    from paged_backend import LLM

    return LLM(None, num_kv_blocks=512)
