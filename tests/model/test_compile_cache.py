"""The compile cache: a second start of the same model loads the graphs the first compiled; a file that does not
load, or a folder that cannot be written, is a warning and a compile, never a crash or another model's graph."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.engine import greedy, mixed_prompts, run_to_completion
from helpers.models import build
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from paged_backend import Engine, EngineConfig
from paged_backend.model.compiled import compilation, compile_cache

# Slow tier: compiles models or runs a whole client suite; `-m "not slow"` leaves it out (CI runs it).
pytestmark = pytest.mark.slow

CONFIG = dict(num_kv_blocks=32, block_size=4, max_num_batched_tokens=24, compile=True)


@pytest.fixture
def cache_folder(tmp_path, monkeypatch) -> Path:
    """An empty project cache folder, and no graphs remembered by this process. TORCHINDUCTOR_CACHE_DIR holds
    torch's default folder, as importing torch's compiler leaves it when the user names none."""
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(default_cache_dir()))
    monkeypatch.setattr(compilation, "_graphs", {})
    return tmp_path


@pytest.fixture(scope="module")
def model():
    return build("llama", seed=2)


def tokens(engine: Engine) -> list[list[int]]:
    ids = [engine.add_request(p, greedy(6)) for p in mixed_prompts(4, seed=5)]
    finals = run_to_completion(engine)
    return [finals[i].outputs[0].token_ids for i in ids]


def graph_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("compiled/*/graph-*.pt"))


def test_graphs_are_saved_then_loaded_and_give_the_same_tokens(cache_folder, model):
    eager = tokens(Engine(model, None, EngineConfig(**{**CONFIG, "compile": False})))
    first = Engine(model, None, EngineConfig(**CONFIG))
    assert first.runner.compiled and not first.runner.forward_model.new_graphs == 0
    saved = graph_files(cache_folder)
    assert len(saved) == len(compilation.warm_up_shapes(model)) == len(first.runner.forward_model.graphs)
    assert list((cache_folder / "inductor").iterdir()), "inductor's kernels live beside the graphs"
    compilation._graphs.clear()  # as a new process: only the disk remembers
    second = Engine(model, None, EngineConfig(**CONFIG))
    assert second.runner.forward_model.new_graphs == 0, "the second start compiled instead of loading"
    # What /metrics says of each start: compiled, then loaded from the cache.
    assert (first.stats()["startup_graphs_loaded"], second.stats()["startup_graphs_loaded"]) == (0.0, 1.0)
    assert first.stats()["startup_compile_seconds"] > 0
    assert tokens(first) == tokens(second) == eager
    assert second.runner.forward_model.eager_steps == 0


def test_a_file_that_does_not_load_is_compiled_again(cache_folder, model, caplog):
    Engine(model, None, EngineConfig(**CONFIG))
    broken = graph_files(cache_folder)[0]
    broken.write_bytes(broken.read_bytes()[:100])  # what a process killed mid-write by another tool leaves
    compilation._graphs.clear()
    with caplog.at_level(logging.WARNING, logger="paged_backend.model.compiled.compile_cache"):
        engine = Engine(model, None, EngineConfig(**CONFIG))
    assert "does not load" in caplog.text
    assert engine.runner.forward_model.new_graphs == len(compilation.warm_up_shapes(model))
    assert tokens(engine) == tokens(Engine(model, None, EngineConfig(**{**CONFIG, "compile": False})))
    assert broken.stat().st_size > 100, "the compile wrote the graph back whole"


def test_a_folder_that_cannot_be_written_compiles_without_keeping(tmp_path, monkeypatch, model, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(blocker / "cache"))  # under a file: no folder can be made
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # kernels somewhere writable
    monkeypatch.setattr(compilation, "_graphs", {})
    with caplog.at_level(logging.WARNING, logger="paged_backend.model.compiled.compile_cache"):
        engine = Engine(model, None, EngineConfig(**CONFIG))
    assert engine.runner.compiled and "cannot be written" in caplog.text
    assert tokens(engine) == tokens(Engine(model, None, EngineConfig(**{**CONFIG, "compile": False})))


def test_the_key_follows_what_changes_a_graph(model):
    settings = {"shapes": ((1, 1), (3, 2)), "block_size": 16}
    key = compile_cache.graph_key(model, settings)
    assert compile_cache.graph_key(model, dict(settings)) == key
    assert compile_cache.graph_key(model, {**settings, "block_size": 8}) != key
    assert compile_cache.graph_key(build("llama", seed=3), settings) == key, "weights are inputs, not the key"
    assert compile_cache.graph_key(build("qwen3"), settings) != key
    assert compile_cache.graph_key(build("llama").to(torch.bfloat16), settings) != key
    handle = model.model.layers[0].mlp.register_forward_hook(lambda *args: None)
    try:
        assert compile_cache.graph_key(model, settings) != key, "a hook is traced into the graph"
    finally:
        handle.remove()


def test_the_cache_can_be_turned_off(cache_folder, model, monkeypatch):
    monkeypatch.setenv(compile_cache.ENV_CACHE, "0")
    assert Engine(model, None, EngineConfig(**CONFIG)).runner.compiled
    assert not graph_files(cache_folder)


START = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, {tests!r})
    from torch._dynamo.utils import counters
    from helpers.models import build
    from paged_backend import Engine, EngineConfig
    engine = Engine(build("llama", seed=2), None, EngineConfig(num_kv_blocks=32, block_size=4, compile=True))
    print(json.dumps({{"new_graphs": engine.runner.forward_model.new_graphs,
                      "traced": counters["stats"]["unique_graphs"]}}))
""")


@pytest.mark.slow
def test_a_second_process_traces_nothing(tmp_path):
    """Across processes, as a user restarts: the second traces no graph (dynamo's counter stays at 0)."""
    env = {**os.environ, "PAGED_BACKEND_CACHE": str(tmp_path)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    script = START.format(tests=str(Path(__file__).parents[1]))
    runs = [json.loads(subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True,
                                      text=True).stdout.strip().splitlines()[-1]) for _ in range(2)]
    assert runs[0]["new_graphs"] > 0 and runs[0]["traced"] > 0
    assert runs[1] == {"new_graphs": 0, "traced": 0}


def key_folders(root: Path, count: int) -> list[Path]:
    """`count` key folders under `root`, each with its lock file, used from oldest to newest."""
    folders = []
    for i in range(count):
        folder = root / f"key{i:02d}"
        folder.mkdir(parents=True)
        (folder / ".lock").touch()
        (folder / "graph-0.pt").write_bytes(b"graph")
        os.utime(folder, (1_000_000 + i, 1_000_000 + i))
        folders.append(folder)
    return folders


def test_old_key_folders_are_evicted_but_not_the_current_or_a_locked_one(tmp_path):
    import fcntl

    folders = key_folders(tmp_path / "compiled", 20)
    with open(folders[1] / ".lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a process compiling into the second oldest
        removed = compile_cache.evict_unused(tmp_path / "compiled", 16, keep=folders[0])
    assert removed == [folders[3], folders[2]]  # the least recently used, less the current and the locked
    assert [f.exists() for f in folders] == [True, True, False, False] + [True] * 16


def test_keeping_new_graphs_evicts_and_a_load_marks_its_folder_used(tmp_path, monkeypatch):
    root = tmp_path / "compiled"
    old, used, new = key_folders(root, 3)
    monkeypatch.setattr(compile_cache, "load_graphs", lambda folder, count: [object()] if folder == used else None)
    monkeypatch.setattr(compile_cache, "inductor_folder", contextlib.nullcontext)
    with compile_cache.graph_store(used, 1):
        pass
    assert used.stat().st_mtime > new.stat().st_mtime  # loaded just now: the most recently used
    monkeypatch.setattr(compile_cache, "KEPT_KEYS", 2)
    monkeypatch.setattr(compile_cache, "save_graph", lambda graph, folder, index: None)
    compile_cache.GraphStore(new, [], writable=True).keep([object()])
    assert not old.exists() and used.exists() and new.exists()
