"""The compile cache's folders. Inductor keeps the compiled kernels under the project's cache folder
(PAGED_BACKEND_CACHE), beside the graphs that call them, unless the user named a folder in
TORCHINDUCTOR_CACHE_DIR; importing torch's compiler writes torch's own default folder into that variable, and
that is not the user's choice. A key folder's lock: its holder removes what a killed write left there, and a
process that waits for it says so."""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

from paged_backend.model.compiled import compile_cache


def test_torchs_default_folder_is_not_taken_for_the_users_choice(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(default_cache_dir()))  # as torch's import leaves it
    with compile_cache.inductor_folder():
        assert cache_dir() == str(tmp_path / "inductor")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.abspath(default_cache_dir())


def test_a_folder_the_user_names_is_kept(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(tmp_path / "project"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    with compile_cache.inductor_folder():
        assert cache_dir() == str(tmp_path / "mine")


FRESH = textwrap.dedent("""
    import paged_backend
    from paged_backend.model.compiled import compile_cache
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    with compile_cache.inductor_folder():
        print(cache_dir())
""")


@pytest.mark.slow  # compiles in a fresh process: the slow tier
def test_a_fresh_process_keeps_its_kernels_under_the_project_cache(tmp_path) -> None:
    """As a user starts the server: nothing set but PAGED_BACKEND_CACHE, torch's compiler imported on the way."""
    env = {**os.environ, "PAGED_BACKEND_CACHE": str(tmp_path)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    run = subprocess.run([sys.executable, "-c", FRESH], env=env, check=True, capture_output=True, text=True)
    assert Path(run.stdout.strip().splitlines()[-1]) == tmp_path / "inductor"


def test_the_lock_holder_removes_what_a_killed_write_left(tmp_path) -> None:
    (tmp_path / "graph-0.pt").write_bytes(b"kept")
    (tmp_path / "tmpk3x9_q2a").write_bytes(b"half a graph")  # torch's temporary name, never renamed
    with compile_cache.compile_lock(tmp_path) as writable:
        assert writable
    assert sorted(path.name for path in tmp_path.iterdir()) == [".lock", "graph-0.pt"]


def test_a_process_waiting_for_anothers_compile_says_so(tmp_path, caplog) -> None:
    with open(tmp_path / ".lock", "a+") as other:  # another process compiling (flock: per open file)
        fcntl.flock(other, fcntl.LOCK_EX)
        threading.Timer(0.3, fcntl.flock, (other, fcntl.LOCK_UN)).start()
        with caplog.at_level(logging.INFO, logger="paged_backend.model.compiled.compile_cache"):
            with compile_cache.compile_lock(tmp_path) as writable:
                assert writable
    assert "another process is compiling into" in caplog.text and str(tmp_path) in caplog.text
