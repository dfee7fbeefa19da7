"""The compiled forward kept on disk, so a second start of the same model loads its graphs instead of compiling.

`torch.compile` keeps inductor's kernels on disk, but each new process still runs dynamo over the whole
model's Python and AOTAutograd over each graph before that cache can answer, at every start
(docs/compiled-steps.md has the cost). `aot_compile` (compilation.py) captures each graph whole, and
`save_compiled_function` writes its bytecode, guards and inductor output into one file; loading that file
skips dynamo and AOTAutograd. The C++ (or Triton) kernels the graphs call are not in the file: inductor
builds them into its own cache folder, so the engine points inductor at a folder beside the graphs while
it compiles and loads them.

Layout, under the project's cache folder (`PAGED_BACKEND_CACHE`):

    compiled/<key>/graph-<i>.pt   one file per warm-up shape, written whole (a temporary file, then renamed)
    compiled/<key>/.lock          held while a process compiles, so a second one waits (saying so) and then
                                  loads; the holder first removes what a killed write left (`tmp*` files)
    inductor/                     inductor's kernels, shared by every key

Each upgrade, edit or new model makes a new key, so the folders of old keys would pile up (docs/compiled-steps.md
has their size): after keeping new graphs, the engine removes the least recently used key folders past the newest
KEPT_KEYS (a load marks its folder used), skipping any whose lock another process holds.

`<key>` hashes what changes a graph: torch, transformers, Python and this package's source, the CPU's
instruction sets (inductor generates code for the one it runs on) or the GPU's compute capability, the
model's class, config, modules, parameters and hooks, and the engine's settings that reach the graph (the
cache's layout and dtype, the warm-up shapes). A file that does not load (truncated by a killed process,
written by another torch, unreadable) is a warning and a fresh compile; a folder that cannot be written
is a warning and a compile that is used but not kept. Never a crash, never another model's graph: a
loaded graph still checks its guards (the step inputs' dtypes, ranks and the shape conditions it was
traced under) before each call.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from paged_backend.cache_folder import cache_dir, cpu_flags

logger = logging.getLogger(__name__)

# Setting it to 0 turns the on-disk graphs off: every start compiles (compile itself: PAGED_BACKEND_COMPILE).
ENV_CACHE = "PAGED_BACKEND_COMPILE_CACHE"
GRAPH_FILE = "graph-{}.pt"
KEPT_KEYS = 16  # key folders kept under compiled/: models and settings in use stay, old versions' go


def enabled() -> bool:
    return os.environ.get(ENV_CACHE, "1") != "0"


def graphs_dir(key: str) -> Path:
    return cache_dir() / "compiled" / key


def inductor_dir() -> Path:
    return cache_dir() / "inductor"


def graph_key(model: torch.nn.Module, settings: dict) -> str:
    """The folder name of `model`'s graphs under `settings` (see the module docstring for what it covers)."""
    parts = {
        "versions": [torch.__version__, transformers_version(), sys.version, source_digest()],
        "machine": machine_kind(next(model.parameters()).device),
        "model": model_fingerprint(model),
        "settings": settings,
    }
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def transformers_version() -> str:
    import transformers

    return transformers.__version__


_source_digest: str | None = None


def source_digest() -> str:
    """A hash of this package's Python files: a traced graph inlines them (the attention function, the
    quantized layers), so an edited checkout must not load graphs traced from the old code."""
    global _source_digest
    if _source_digest is None:
        digest = hashlib.sha256()
        for root in source_roots():
            for path in sorted(root.rglob("*.py")):
                digest.update(str(path.relative_to(root)).encode())
                digest.update(path.read_bytes())
        _source_digest = digest.hexdigest()
    return _source_digest


def source_roots() -> list[Path]:
    """This package's folders: paged_backend/ and the integrations/ folder installed as its sub-package."""
    integrations = importlib.util.find_spec("paged_backend.integrations")
    return [Path(__file__).parents[1], *map(Path, integrations.submodule_search_locations or [])]


def machine_kind(device: torch.device) -> list:
    """What inductor generates code for: the CPU's vector instruction sets, or the GPU's architecture."""
    if device.type == "cuda":
        return ["cuda", torch.cuda.get_device_name(device), list(torch.cuda.get_device_capability(device))]
    return ["cpu", platform.machine(), torch.backends.cpu.get_cpu_capability(), cpu_flags()]


def model_fingerprint(model: torch.nn.Module) -> list:
    """The model as a graph sees it: its class and config, each module's class and hooks, each parameter and
    buffer's name, shape and dtype. Not the weights' values: the graphs take them as inputs at each call."""
    config = getattr(model, "config", None)
    modules = [(name, type(m).__qualname__, len(m._forward_hooks), len(m._forward_pre_hooks))
               for name, m in model.named_modules()]
    tensors = [(name, list(t.shape), str(t.dtype)) for name, t in
               [*model.named_parameters(), *model.named_buffers()]]
    return [type(model).__qualname__, config.to_json_string() if config is not None else None, modules, tensors]


@contextlib.contextmanager
def inductor_folder() -> Iterator[None]:
    """Inductor builds and finds its kernels under the project's cache folder while the engine compiles or
    loads, unless the user chose a folder for it (`chosen_inductor_folder`)."""
    if chosen_inductor_folder() is not None:
        yield
        return
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    with temporary_cache_dir(str(inductor_dir())):
        yield


def chosen_inductor_folder() -> str | None:
    """The folder the user set in TORCHINDUCTOR_CACHE_DIR, or None. Torch's compiler writes its own default
    (a folder of the system's temporary one) into that variable as soon as it is imported, so that value
    is no choice: taken as one, the kernels would go where a cleaned /tmp loses them."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if folder is None or os.path.abspath(folder) == os.path.abspath(default_cache_dir()):
        return None
    return folder


@contextlib.contextmanager
def compile_lock(folder: Path) -> Iterator[bool]:
    """Hold `folder`'s lock while compiling into it, so a second process that starts the same model waits and
    then loads what the first wrote. Yields whether the folder is writable (a read-only or full cache
    compiles all the same, without keeping the result)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = open(folder / ".lock", "a+")  # noqa: SIM115 (held for the duration of the compile)
    except OSError as exc:
        logger.warning("compile cache: %s cannot be written (%s); compiling without keeping the graphs", folder, exc)
        yield False
        return
    with handle:
        wait_for_lock(handle, folder)
        try:
            remove_leftovers(folder)
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def wait_for_lock(handle, folder: Path) -> None:
    """Take `folder`'s lock, saying so when another process holds it: its compile takes minutes, which
    would otherwise pass without a word."""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        logger.info("compile cache: another process is compiling into %s; waiting for it, then loading its graphs",
                    folder)
        fcntl.flock(handle, fcntl.LOCK_EX)


def remove_leftovers(folder: Path) -> None:
    """Remove the temporary files of graph writes a killed process cut short (torch writes `tmp*` beside the
    graph, then renames it): each is megabytes no one would ever read. Only called under the folder's lock,
    the only time any process writes there."""
    for path in folder.glob("tmp*"):
        with contextlib.suppress(OSError):
            path.unlink()


def load_graphs(folder: Path, count: int) -> list | None:
    """The `count` graphs saved in `folder`, or None when any is missing or does not load."""
    paths = [folder / GRAPH_FILE.format(i) for i in range(count)]
    if not all(path.is_file() for path in paths):
        return None
    graphs = []
    for path in paths:
        try:
            # Loaded as the steps run, in inference mode: a graph's guards on its input tensors take their
            # expected dispatch keys from the mode they are loaded in.
            with open(path, "rb") as handle, torch.inference_mode():
                graph = torch.compiler.load_compiled_function(handle)
            graph.disable_guard_check()  # CompiledForward checks the guards itself, once, before each call
            graphs.append(graph)
        except Exception as exc:  # noqa: BLE001 (any failure to load means: compile again)
            logger.warning("compile cache: %s does not load (%s: %s); compiling again", path,
                           type(exc).__name__, exc)
            return None
    return graphs


def save_graph(graph, folder: Path, index: int) -> None:
    """Write one compiled graph; torch writes a temporary file and renames it, so a killed process leaves the
    old file or none, never half of one. A failure to write is a warning: the graph still serves this process."""
    try:
        graph.save_compiled_function(str(folder / GRAPH_FILE.format(index)))
    except Exception as exc:  # noqa: BLE001 (disk full, read-only, unserialisable: the graph is kept in memory)
        logger.warning("compile cache: could not write graph %d to %s (%s: %s)", index, folder,
                       type(exc).__name__, exc)


class GraphStore:
    """The graphs of one key's folder: those loaded (`graphs`), and `keep(new)` to save those compiled since."""

    def __init__(self, folder: Path, graphs: list, writable: bool) -> None:
        self.folder, self.graphs, self.writable = folder, graphs, writable

    def keep(self, new: list) -> None:
        if self.writable:
            for i, graph in enumerate(new, start=len(self.graphs)):
                save_graph(graph, self.folder, i)
            if new:
                evict_unused(self.folder.parent, KEPT_KEYS, keep=self.folder)


def mark_used(folder: Path) -> None:
    """A key folder's modification time is when it was last compiled into or loaded from."""
    with contextlib.suppress(OSError):  # a read-only cache: nothing is evicted from it either
        os.utime(folder)


def evict_unused(root: Path, kept: int, keep: Path) -> list[Path]:
    """Remove the key folders under `root` past the `kept` most recently used (never `keep`, nor a folder whose
    lock a process holds: it is compiling there); return those removed. Failures leave a folder in place."""
    try:
        folders = sorted((f for f in root.iterdir() if f.is_dir()), key=lambda f: f.stat().st_mtime, reverse=True)
    except OSError:
        return []
    removed = []
    for folder in folders[kept:]:
        if folder != keep and remove_unlocked(folder):
            removed.append(folder)
    if removed:
        logger.info("compile cache: removed %d unused graph folders from %s", len(removed), root)
    return removed


def remove_unlocked(folder: Path) -> bool:
    """Remove `folder` when no process holds its lock (taken for the removal, so none starts compiling there)."""
    try:
        with open(folder / ".lock", "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(folder)
            return True
    except OSError:  # locked (BlockingIOError), or it cannot be removed
        return False


@contextlib.contextmanager
def graph_store(folder: Path, count: int) -> Iterator[GraphStore]:
    """The saved graphs of `folder` when all `count` are there and load; else none, under the folder's lock (a
    second process starting the same model waits, then loads what this one keeps). Inductor works in the
    project's cache folder throughout (inductor_folder), since the graphs' kernels live there."""
    with inductor_folder():
        if not enabled():
            yield GraphStore(folder, [], writable=False)
            return
        graphs = load_graphs(folder, count)
        if graphs is not None:
            mark_used(folder)
            yield GraphStore(folder, graphs, writable=False)
            return
        with compile_lock(folder) as writable:
            graphs = (load_graphs(folder, count) if writable else None) or []  # compiled while this one waited
            yield GraphStore(folder, graphs, writable and not graphs)
