"""Where inductor keeps the compiled kernels: under the project's cache folder (PAGED_BACKEND_CACHE), beside the
graphs that call them, unless the user named a folder in TORCHINDUCTOR_CACHE_DIR. Importing torch's compiler
writes torch's own default folder into that variable; that is not the user's choice."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

from paged_backend.model import compile_cache


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
    from paged_backend.model import compile_cache
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    with compile_cache.inductor_folder():
        print(cache_dir())
""")


def test_a_fresh_process_keeps_its_kernels_under_the_project_cache(tmp_path) -> None:
    """As a user starts the server: nothing set but PAGED_BACKEND_CACHE, torch's compiler imported on the way."""
    env = {**os.environ, "PAGED_BACKEND_CACHE": str(tmp_path)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    run = subprocess.run([sys.executable, "-c", FRESH], env=env, check=True, capture_output=True, text=True)
    assert Path(run.stdout.strip().splitlines()[-1]) == tmp_path / "inductor"
