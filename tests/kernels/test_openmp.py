"""The OpenMP team of a thread that ran parallel work can be released, and AsyncEngine releases its caller's.

Each check runs in a fresh interpreter, whose threads are only its own: the count of OS threads is what tells
a team (one worker here, at two OpenMP threads) from none."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from paged_backend.kernels import openmp

pytestmark = pytest.mark.skipif(openmp.loaded_libgomp() is None, reason="torch runs no libgomp here")

COUNT_THREADS = """
import os, time, torch
torch.set_num_threads(2)

def threads(expected=None):
    # A released worker leaves the process a moment after the release returns.
    for _ in range(100):
        count = len(os.listdir("/proc/self/task"))
        if count == expected:
            break
        time.sleep(0.01)
    return count

def run_parallel_work():
    torch.ones(1 << 22).add_(1)  # big enough for ATen to start a parallel region
"""


def run(script: str) -> None:
    done = subprocess.run([sys.executable, "-c", COUNT_THREADS + script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_released_team_lets_its_worker_go_and_comes_back_with_the_next_parallel_work() -> None:
    run("""
from paged_backend.kernels import openmp
before = threads()
run_parallel_work()
with_team = threads()
assert with_team == before + 1, (before, with_team)
assert openmp.release_thread_team()
assert threads(before) == before
run_parallel_work()
assert threads(with_team) == with_team
""")


def test_async_engine_releases_the_team_of_the_thread_that_built_the_engine() -> None:
    run(f"""
__import__("sys").path.insert(0, {str(Path(__file__).parents[1])!r})
from helpers.models import build
from paged_backend import AsyncEngine, Engine, EngineConfig
engine = Engine(build("llama"), None, EngineConfig(num_kv_blocks=16, num_threads=2))
run_parallel_work()
with_team = threads()
aengine = AsyncEngine(engine)  # one thread more, the engine's; one less, this thread's worker
try:
    assert threads(with_team) == with_team, (with_team, threads())
finally:
    aengine.shutdown()
""")
