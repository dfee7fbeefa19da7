"""Compiling the model forward ahead of time, once per shape class, at engine start-up.

Each graph is traced whole (`aot_compile`, fullgraph) with `dynamic=True`, so the packed length `T` and the
number of kept logits rows are symbolic. Attention and the cache write are opaque custom ops (custom_ops.py)
that read the step from a context, so nothing step-specific is traced. Sizes 0 and 1 would be specialised by
torch; tracing under `backed_size_oblivious` stops that for the kept rows, and start-up runs a dummy step of
each shape class (`T = 1`, `T > 1`; int4 layers add a third past their dense-copy threshold), compiling a
graph for each: afterwards no step compiles. On CPU the one-token graph writes and attends in plain tensor
ops (paged_backend/kernels/torch_single_row.py, the cache and the block table as graph inputs), which
inductor fuses into one kernel per layer instead of calling the opaque op.

A graph keeps the guards on the step's inputs (dtypes, ranks, the shape conditions it was traced under) and
on global state, and drops the rest: the guards on the model's modules (hooks, attributes, parameters) are
many, and checking them took a share of every step (docs/compiled-steps.md has the measurement), while the
engine changes no module once its forward is compiled (`structure_of` says when a caller did, and the engine is
rebuilt). The graphs take the model as an argument, its weights as inputs at each call, so one set of graphs
serves every engine over an equal model and settings; `CompiledForward` picks, per step, the graph whose guards
the step passes.

On the CPU the decoder layers are nested compile regions while a graph is traced (layer_regions.py), so
inductor lowers each kind of layer once, not each of the model's layers.

Ahead-of-time graphs can be saved: compile_cache.py keeps them on disk, keyed by what changes them, so the
next process that starts the same model loads them instead of tracing and lowering again.

A path the engine cannot compile (tensor parallelism, whose collectives run inside the forward; a model with
PEFT's tuner layers, whose adapter switches the dropped guards would not see) runs eagerly, and says so once
at start-up.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import time
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.fx.experimental._config as fx_config
from tqdm.auto import tqdm

from paged_backend.kernels import pack_sequences
from paged_backend.model.compiled import compile_cache, layer_regions
from paged_backend.model.quantized import int4_linear
from paged_backend.model.loading.model_state import tuner_layers
from paged_backend.model.loading.rope import has_dynamic_rope

if TYPE_CHECKING:
    from paged_backend.model.paged.paged_cache import PagedCache

logger = logging.getLogger(__name__)

# (packed tokens, kept logits rows) of the warm-up steps: one per graph. transformers' mask code
# branches on `T == 1`, so a one-token step is its own graph; any other size is size-oblivious.
WARM_UP_SHAPES = ((1, 1), (3, 2))


def warm_up_shapes(model: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    """The (tokens, kept rows) of one dummy step per graph `model`'s compiled forward has. Int4 layers
    branch on the step's rows (int4_linear.DENSE_ROWS): steps past their threshold are a graph of their own."""
    int4_rows = int4_linear.most_int4_rows(model)
    if int4_rows is not None:
        return (*WARM_UP_SHAPES, (int4_rows + 8, 2))
    return WARM_UP_SHAPES


# Setting it to 0 makes `EngineConfig.compile=None` mean eager (an explicit compile=True still compiles).
ENV_COMPILE = "PAGED_BACKEND_COMPILE"


def wants_compile(setting: bool | None, device: torch.device) -> bool:
    """`EngineConfig.compile`: None compiles on CPU, where a compiled step runs fewer ops than an eager one and the
    compile cache makes every start after the first cost seconds, unless PAGED_BACKEND_COMPILE=0 or no C++
    compiler is installed (inductor builds its CPU kernels with one). Not on CUDA: there compiled steps gave
    other tokens than eager steps (benchmarks/gpu_check.py --only steps; docs/compiled-steps.md has the run),
    so CUDA compiles only when asked (compile=True), with a warning."""
    if setting is not None:
        if setting and device.type == "cuda":
            logger.warning("compile=True on CUDA: compiled CUDA steps have given tokens different from eager "
                           "steps (gpu_check on an H200, torch 2.11); check them against compile=False")
        return setting
    if os.environ.get(ENV_COMPILE, "1") == "0" or device.type == "cuda":
        return False
    return cpp_compiler() is not None


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would build CPU kernels with, or None."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def eager_reason() -> str | None:
    """Why this process cannot run a compiled forward, or None when it can."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return "tensor parallelism runs eagerly (its collectives are inside the forward)"
    return None


def model_eager_reason(model: torch.nn.Module) -> str | None:
    """Why `model` must run eagerly, or None. PEFT's tuner layers switch adapters by attributes (the active
    adapter, disabled or not) that a compiled forward, having dropped the module guards, would not see
    change: the graph would keep the adapters as they were when it was traced. A model whose config has a dynamic
    rope (rope.py) has a rotary module that decides in Python, per forward, whether to recompute its frequencies."""
    if tuner_layers(model):
        return "a model with PEFT tuner layers runs eagerly (a compiled graph would not see its adapters switch)"
    if has_dynamic_rope(model.config.get_text_config()):
        return ("a model with dynamic NTK rope runs eagerly (transformers' frequency update branches on the step's "
                "largest position, which a whole-graph trace cannot hold)")
    return None


def structure_of(model: torch.nn.Module) -> tuple:
    """What a compiled forward takes as fixed in `model`, having dropped the guards that would check it:
    which module object sits at each name (with its class and its hooks, and whether it trains) and each
    parameter's shape and dtype. A model whose structure changed (an adapter inserted, a module swapped,
    a hook added) compiles anew."""
    modules = tuple((name, id(m), type(m), m.training, len(m._forward_hooks), len(m._forward_pre_hooks))
                    for name, m in model.named_modules())
    params = tuple((name, p.shape, p.dtype, p.device) for name, p in model.named_parameters())
    return modules, params


def logits_of(model: torch.nn.Module, **kwargs) -> torch.Tensor:
    """The step's forward: the model's logits for the kept rows. What is compiled, and what runs eagerly; it
    returns the logits alone so a compiled graph rebuilds no output object."""
    return model(**kwargs).logits


class CompiledForward:
    """`model`'s forward as ahead-of-time compiled graphs, one per shape class the warm-up runs (compile_forward).

    Each graph was traced whole for one warm-up shape and keeps the guards on the step's inputs (their dtypes,
    ranks and the shape conditions it was traced under, such as T == 1 or the int4 layers' row threshold) and
    on global state, not those on the model's modules (see the module docstring). A call runs the graph whose
    guards its inputs pass: the last one that served its token count, else the first that fits. While
    `tracing` (the warm-up) a step that fits none compiles a graph for itself; afterwards such a step runs
    eagerly and is counted in `eager_steps` (and, over every instance, `all_eager_steps`), which the tests read,
    since a silent slow path is the bug that matters here."""

    all_eager_steps = 0

    def __init__(self, model: torch.nn.Module, graphs: list, static_kv: torch.Tensor | None = None) -> None:
        self.model = model
        self.graphs = list(graphs)
        self.new_graphs = 0  # compiled by this process (not loaded)
        self.static_kv = static_kv  # the paged cache: its sizes but the slot count are static while tracing
        self.by_tokens: dict[int, object] = {}
        self.tracing = False
        self.eager_steps = 0

    def __call__(self, **kwargs) -> torch.Tensor:
        tokens = kwargs["input_ids"].shape[-1]
        graph = self.by_tokens.get(tokens)
        if graph is None or not graph.guard_check(self.model, **kwargs):
            graph = self.graph_for(kwargs)
        if graph is None:
            if self.eager_steps == 0:
                logger.warning("compile: a step of %d tokens fits no compiled graph and runs eagerly", tokens)
            self.eager_steps += 1
            CompiledForward.all_eager_steps += 1
            return logits_of(self.model, **kwargs)
        self.by_tokens[tokens] = graph
        return graph(self.model, **kwargs)

    def graph_for(self, kwargs: dict):
        """The first graph whose guards `kwargs` pass; while tracing, a new one compiled for them."""
        graph = next((g for g in self.graphs if g.guard_check(self.model, **kwargs)), None)
        if graph is None and self.tracing:
            graph = self.compile_graph(kwargs)
        return graph

    def compile_graph(self, kwargs: dict):
        """A graph for a step of `kwargs`' shape class, traced ahead of time (or, on an older torch, one lazy graph
        that traces each class as it first sees it)."""
        if self.static_kv is not None:
            # The cache's sizes other than its slot count are the model's: as constants they cannot be duck-sized
            # with the step's block count (torch gives equal sizes one symbol, which tied the warm-up's two blocks to
            # a two-layer model's layers). The slot count stays symbolic, so caches of other sizes share the graph.
            torch._dynamo.mark_static(self.static_kv, [0, 1, 2, 4])
        # The packed row's batch of 1 is a constant: under backed_size_oblivious it would stay a symbol, and
        # inductor on CUDA could not split [1, T, hidden] views by it ("CantSplit"; docs/compiled-steps.md).
        rows = (kwargs["input_ids"], kwargs["position_ids"])
        for row in rows:
            torch._dynamo.mark_static(row, 0)
        if not AHEAD_OF_TIME:  # the marks stay: the lazy graph traces at its first call, just after this
            graph = LazyGraph()
        else:
            try:
                graph = ahead_of_time_graph(self.model, kwargs)
            finally:
                for tensor in (self.static_kv, *rows):
                    unmark_dims(tensor)
        self.graphs.append(graph)
        self.new_graphs += 1
        return graph


# torch 2.11's aot_compile (behind enable_aot_compile) failed to lower the default model's graphs on CUDA
# ("CantSplit" in inductor), where its plain torch.compile lowers them; 2.13's is the one relied on here.
AHEAD_OF_TIME = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 13)


# Inductor checks the size, stride and alignment of every extern kernel's output as its graph runs (our ops'
# outputs among them): Python checks on every step, a share of a one-stream step (docs/compiled-steps.md has the
# measurement). The ops' outputs are what their fake implementations promise, which the equivalence tests check.
UNCHECKED_OUTPUTS = {"size_asserts": False, "alignment_asserts": False}


def ahead_of_time_graph(model: torch.nn.Module, kwargs: dict):
    """`logits_of(model, **kwargs)` traced whole and compiled now, its guards kept as keep_step_guards says."""
    options = {"guard_filter_fn": keep_step_guards}
    if kwargs["input_ids"].device.type == "cpu":
        options.update(UNCHECKED_OUTPUTS)
    compiled = torch.compile(logits_of, dynamic=True, fullgraph=True, options=options)
    # On the CPU each kind of decoder layer is lowered once (layer_regions.py), which shortens a cold compile
    # (docs/compiled-steps.md has the times). CUDA traces layers plainly: regions are not measured there.
    if kwargs["input_ids"].device.type != "cpu":
        graph = compiled.aot_compile(((model,), kwargs))
    else:
        try:
            with layer_regions.marked(model):
                graph = compiled.aot_compile(((model,), kwargs))
        except torch._dynamo.exc.UncapturedHigherOrderOpError as error:
            # A region cannot take inputs that alias each other: projections whose weights are views of one
            # stacked copy (fused_projections.py) when a step runs them unfused. Such a model traces its layers
            # one by one, as before regions, at the cold compile's cost.
            logger.info("compile: decoder layers traced one by one (%s)", str(error).splitlines()[0])
            graph = compiled.aot_compile(((model,), kwargs))
    # CompiledForward checks the guards itself (guard_check) before each call: the graph's own check would be a second.
    graph.disable_guard_check()
    return graph


class LazyGraph:
    """On a torch without a working aot_compile: one `torch.compile`d forward that traces each shape class when
    first called (the warm-up calls them all) and checks its own guards, the module guards dropped. It is kept
    in memory only (compile_cache saves ahead-of-time graphs alone) and serves one model: without module guards,
    its code object (own_forward) is what keeps two models' graphs apart."""

    def __init__(self) -> None:
        self.forward = torch.compile(own_forward(), dynamic=True,
                                     options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})

    def guard_check(self, model: torch.nn.Module, **kwargs) -> bool:
        return True  # torch checks them at the call, and traces a new graph where they fail

    def __call__(self, model: torch.nn.Module, **kwargs) -> torch.Tensor:
        return self.forward(model, **kwargs)


_numbers = itertools.count()


def own_forward() -> Callable:
    """`logits_of` with a code object no other forward shares (torch keeps compiled graphs per code object)."""
    code = logits_of.__code__.replace(co_name=f"paged_forward_{next(_numbers)}")
    return types.FunctionType(code, logits_of.__globals__, code.co_name)


def unmark_dims(tensor: torch.Tensor | None) -> None:
    """Forget `mark_static`'s marks once a graph is traced: a graph saved and loaded again no longer records
    them, and its guard then refuses a marked tensor; one traced in this process accepts an unmarked one."""
    for name in ("_dynamo_static_indices", "_has_dynamo_dim_marking"):
        if tensor is not None and hasattr(tensor, name):
            delattr(tensor, name)


def keep_step_guards(guards: list) -> list[bool]:
    """Keep the guards on the step's inputs and on global state; drop those on the model's modules, parameters
    and buffers (the engine changes none of them once compiled: structure_of says when it did), and those on
    globals, which a saved graph cannot carry to another process."""
    kept = []
    for guard in guards:
        owned = any(part in guard.name for part in ("_modules", "_parameters", "_buffers"))
        kept.append(guard.guard_type in ("GLOBAL_STATE", "SHAPE_ENV")
                    or (guard.guard_type == "TENSOR_MATCH" and not guard.is_global and not owned))
    return kept


# graph key (compile_cache.graph_key) -> the graphs compiled or loaded for it in this process. The graphs take
# the model as an argument, so every engine over an equal model and settings shares them.
_graphs: dict[str, list] = {}


class CompileReport(NamedTuple):
    forward: CompiledForward
    seconds: float  # the compile or load, and the warm-up steps
    loaded: bool  # the graphs came from the on-disk cache or this process's memo, not a compile
    folder: str


def compile_forward(model: torch.nn.Module, kv: torch.Tensor, settings: dict,
                    warm: Callable[[CompiledForward, str | None], float]) -> CompileReport:
    """`model`'s CompiledForward for the engine `settings` (what reaches the graph: the cache's layout, the block
    size, the warm-up shapes), from this process's memo, the on-disk cache, or compiled during `warm(forward)`,
    which runs one dummy step per warm-up shape through it (warm_up) under a progress bar of the title given."""
    start = time.perf_counter()
    key = compile_cache.graph_key(model, settings)
    folder = compile_cache.graphs_dir(key)
    count = len(settings["shapes"])
    if not AHEAD_OF_TIME:
        forward = CompiledForward(model, [], kv)
        forward.tracing = True
        warm(forward, "Compiling the forward")
        forward.tracing = False
        return CompileReport(forward, time.perf_counter() - start, False, "(kept in memory)")
    if key in _graphs:
        forward = CompiledForward(model, _graphs[key], kv)
        warm(forward, None)
        return CompileReport(forward, time.perf_counter() - start, True, str(folder))
    with compile_cache.graph_store(folder, count) as store:
        forward = CompiledForward(model, store.graphs, kv)
        forward.tracing = True
        try:
            warm(forward, "Loading the compiled forward" if store.graphs else "Compiling the forward")
        finally:
            forward.tracing = False
        store.keep(forward.graphs[len(store.graphs):])
    _graphs[key] = forward.graphs
    return CompileReport(forward, time.perf_counter() - start, forward.new_graphs == 0, str(folder))


def warm_up(forward, cache: PagedCache, shapes: tuple[tuple[int, int], ...] = WARM_UP_SHAPES,
            progress: str | None = None) -> float:
    """Run `forward` on dummy steps of every specialised shape in `shapes` over `cache`; return the seconds it
    took. With `progress`, a bar of that title counts the shapes (a cold compile is slow: it shows graph by
    graph). The dummy K/V land in the first blocks, which hold nothing yet (no request has run)
    and which every later owner writes before reading; never in the null block (a window group's freed
    entries), which stays zero. A cache of layer groups gets the step context of one: every group reads the
    dummy step's block table (the graphs never see the tables: the attention op reads them from the context)."""
    kv, block_size = cache.kv, cache.block_size
    device = kv.device
    num_blocks = cache.null_block if cache.null_block is not None else kv.shape[3] // block_size
    start = time.perf_counter()
    # Module float attributes (norm epsilons, attention scales) would be symbolic: torch traced each graph,
    # failed to turn them into tensors, and traced it again with them as constants, a large share of the
    # start-up (docs/compiled-steps.md). Constants from the start trace each graph once.
    # Size-oblivious tracing keeps 0 and 1 kept rows in the graphs of their step length. It is used on CPU only:
    # on CUDA inductor then failed to lower views of [rows, hidden] ("CantSplit"; docs/compiled-steps.md), and
    # torch's own specialisation of 0 and 1, as before it, lowers there.
    oblivious = kv.device.type == "cpu"
    with (torch.inference_mode(), fx_config.patch(backed_size_oblivious=oblivious),
          torch._dynamo.config.patch(specialize_float=True)):
        for tokens, rows in tqdm(shapes, desc=progress, unit="graph", disable=progress is None):
            ids = torch.zeros(1, tokens, dtype=torch.long, device=device)
            positions = torch.arange(tokens, device=device)[None]
            # One sequence of `tokens`, its blocks the cache's first, wrapping round a cache smaller than it.
            table = (np.arange(-(-tokens // block_size)) % num_blocks)[None]
            _, _, metadata = pack_sequences(table, np.zeros(1, dtype=np.int64), np.array([tokens]), block_size,
                                            device)
            forward(ids, positions, torch.arange(tokens - rows, tokens, device=device), metadata)
    return time.perf_counter() - start
