"""Compiling the model forward with `torch.compile`, once, at engine start-up.

The forward is compiled with `dynamic=True`, so the packed length `T` and the number of kept logits
rows are symbolic and one graph serves every step. Attention and the cache write are opaque custom ops
(custom_ops.py) that read the step from a context, so nothing step-specific is guarded on. Sizes 0
and 1 would be specialised by torch; compiling with `backed_size_oblivious` stops that for the kept
rows, and start-up runs a dummy step of each of the two graphs that remain (`T = 1`, `T > 1`; int4 layers
add a third past their dense-copy threshold):
afterwards steady state never recompiles. Inductor's on-disk cache (torch's default) makes a second process's compile faster.

On CPU the one-token graph is the exception: there the step's write and attention are plain tensor ops
inside the graph (paged_backend/kernels/torch_single_row.py, reading the cache and the block table as graph inputs),
which inductor fuses into one kernel per layer instead of calling the opaque op.

Before each call torch checks the graph's guards: about 7,700 of them on the default model, nearly all on
the model's modules (their hooks, attributes and parameters), which took 1.8-2.1 ms of a 19 ms one-stream
decode step on CPU. The engine owns its model and changes no module once the forward is compiled, so the
module guards are dropped (`guard_filter_fn`), which left 0.3 ms; the guards on the step's inputs (and so
the `T = 1` / `T > 1` choice between graphs) and on globals stay. Without module guards nothing would tell
two models of one class apart, so each model gets a forward of its own (a code object of its own, which is
where torch keeps compiled graphs), memoised per model for as long as its structure (`structure_of`)
stays as it was compiled.

A path the engine cannot compile (tensor parallelism, whose collectives run inside the forward; a model with
PEFT's tuner layers, whose adapter switches the dropped guards would not see) runs eagerly, and says so once
at start-up.
"""

from __future__ import annotations

import itertools
import logging
import time
import types
import weakref
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
import torch.fx.experimental._config as fx_config

from paged_backend.kernels import AttentionMetadata
from paged_backend.model import custom_ops, int4_linear
from paged_backend.model.model_state import tuner_layers

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


def wants_compile(setting: bool | None, device: torch.device) -> bool:
    """`EngineConfig.compile`: None compiles on CUDA only. On CPU a compiled step
    has not been measured to pay (README, "Compiled steps"), so CPU compiles only when asked."""
    return device.type == "cuda" if setting is None else setting


def eager_reason() -> str | None:
    """Why this process cannot run a compiled forward, or None when it can."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return "tensor parallelism runs eagerly (its collectives are inside the forward)"
    return None


def model_eager_reason(model: torch.nn.Module) -> str | None:
    """Why `model` must run eagerly, or None. PEFT's tuner layers switch adapters by attributes (the active
    adapter, disabled or not) that a compiled forward, having dropped the module guards, would not see
    change: the graph would keep the adapters as they were when it was traced."""
    if tuner_layers(model):
        return "a model with PEFT tuner layers runs eagerly (a compiled graph would not see its adapters switch)"
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


# model -> (its structure when compiled, its compiled forward). The forward takes the model as an argument
# rather than holding it, so this memo does not keep a model alive.
_compiled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_numbers = itertools.count()


def compile_model(model: torch.nn.Module) -> tuple[Callable, tuple]:
    """`model`'s compiled forward (called with the forward's keywords) and the structure it was compiled
    for; compiled on first use and shared by every engine over the model while its structure is unchanged."""
    structure = structure_of(model)
    known = _compiled.get(model)
    if known is None or known[0] != structure:
        known = _compiled[model] = (structure, torch.compile(own_forward(), dynamic=True,
                                                             options={"guard_filter_fn": drop_module_guards}))
    return partial(known[1], model), structure


def own_forward() -> Callable:
    """`forward(model, **kwargs) -> model(**kwargs)` with a code object no other forward shares."""
    def forward(model: torch.nn.Module, **kwargs):
        return model(**kwargs)

    code = forward.__code__.replace(co_name=f"paged_forward_{next(_numbers)}")
    return types.FunctionType(code, forward.__globals__, code.co_name)


def drop_module_guards(guards: list) -> list[bool]:
    """Keep every guard but those on the model's modules (see the module docstring)."""
    return torch.compiler.skip_guard_on_all_nn_modules_unsafe(guards)


def warm_up(forward, kv: torch.Tensor, block_size: int, kv_scales: torch.Tensor | None = None,
            shapes: tuple[tuple[int, int], ...] = WARM_UP_SHAPES) -> float:
    """Run `forward` on dummy steps of every specialised shape in `shapes`; return the seconds it took.
    The dummy K/V land in the first blocks, which hold nothing yet (no request has run) and which
    every later owner writes before reading."""
    device, num_blocks = kv.device, kv.shape[3] // block_size
    # The one-token graph takes the cache as an input (paged_backend/kernels/torch_single_row.py). Its sizes other than the
    # slot count are the model's: as constants they cannot be duck-sized with the step's block count (torch
    # gives equal sizes one symbol, which tied the warm-up's two blocks to a two-layer model's layers). The
    # slot count stays symbolic, so engines with caches of other sizes share the graph.
    torch._dynamo.mark_static(kv, [0, 1, 2, 4])
    start = time.perf_counter()
    # Module float attributes (norm epsilons, attention scales) would be symbolic: torch traced each graph,
    # failed to turn them into tensors, and traced it again with them as constants, 17 of 66 s of the
    # default model's start-up. Constants from the start trace each graph once.
    with (torch.inference_mode(), fx_config.patch(backed_size_oblivious=True),
          torch._dynamo.config.patch(specialize_float=True)):
        for tokens, rows in shapes:
            ids = torch.zeros(1, tokens, dtype=torch.long, device=device)
            positions = torch.arange(tokens, device=device)[None]
            blocks = min(-(-tokens // block_size), num_blocks)
            metadata = AttentionMetadata(
                slot_mapping=torch.arange(tokens, device=device) % (num_blocks * block_size),
                block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
                query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=device),
                seq_lens=torch.tensor([tokens], dtype=torch.int32, device=device),
                block_size=block_size, query_start_loc_host=[0, tokens], seq_lens_host=[tokens],
                max_query_len=tokens, max_seq_len=tokens,
            )
            with custom_ops.step_context(metadata, kv, kv_scales):
                forward(ids, positions, torch.arange(tokens - rows, tokens, device=device), metadata)
    return time.perf_counter() - start
