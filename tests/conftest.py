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


# Set at import, before any test starts a process: Ray replicas, tensor-parallel workers and command-line
# runs inherit it, so they pick the dtype the test process picks (fp32_default_on_cpu below).
os.environ["PAGED_BACKEND_CPU_BF16"] = "0"
# The engine compiles its forward by default; a test compiles where it says compile=True, or every engine of the
# suite would compile (a minute each for the real model). Inherited by the processes tests start, like the above.
os.environ["PAGED_BACKEND_COMPILE"] = "0"
# Under pytest-xdist (the README's command runs two workers), each worker computes on one thread, and so do the
# processes it starts: two workers of two threads each on two cores would wait on each other's threads.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def fp32_default_on_cpu():
    """The suite's equality tests are written for fp32 weights, so `dtype=None`/"auto" means fp32 on CPU
    in every test and every process it starts, on every machine: a CPU with native bf16 (where the engine
    would pick bf16) runs the same tests as one without. test_precision.py tests the choice itself by
    patching it back."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("paged_backend.model.loading.precision.cpu_has_native_bf16", lambda: False)
        yield


@pytest.fixture(scope="session")
def default_llm():
    """The default model with its exact fp32 weights: a dtype named, so `quantization="auto"` keeps them (left
    to the engine on a CPU without native bf16, they would run as int4 codes; test_int4.py covers that)."""
    import torch

    from paged_backend import LLM

    return LLM(None, dtype=torch.float32, num_kv_blocks=512)
