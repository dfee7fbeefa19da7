"""Shared fixtures. The default real model is loaded once per test session.

Hypothesis runs derandomized and without an example database by default, so a property test gives
the same verdict on every run and machine; `HYPOTHESIS_PROFILE=explore` draws fresh random examples.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def default_llm():
    from paged_backend import LLM

    return LLM(None, num_kv_blocks=512)
