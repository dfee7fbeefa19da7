"""The start-up plan: every choice an engine makes before its first step, and why, decided in one place.

`read_facts` reads what the choices depend on from the prepared model (and the process: tensor parallelism),
then `plan_startup` decides, in this order, each choice reading only the facts and the choices above it:

1. refusals of the config for this model (a step budget or LoRA it cannot run);
2. the KV cache's element type and its number of blocks within the memory budget (agreed between tensor
   parallel ranks);
3. whether decode steps are captured in CUDA graphs, and whether they are padded (captured steps must be);
4. the layer groups of the cache: per layer spec, so window and chunked layers free their old blocks, unless
   padding, a draft model or tensor parallelism needs one block table for every layer;
5. the context length: the model's positions, capped where the engine is exact and by what the cache holds;
6. whether prefix caching (where every layer's spec allows it), LoRA and the compiled forward are on, and whether
   steps are batch-invariant.

The result is a frozen record: the engine builds its cache, KV manager and scheduler from it and the model
runner its padding, compiled forward and CUDA graphs. `notes` says why each choice that is off or limited is
so; the engine logs them once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_backend.config import DEFAULT_CPU_KV_BYTES, DEFAULT_CUDA_KV_FRACTION, EngineConfig
from paged_backend.core.kv_cache_groups import CacheGroups, plan_groups
from paged_backend.model import batch_invariant
from paged_backend.model.compiled import compilation, cuda_graphs
from paged_backend.model.loading.model_check import temperature_tuning_limit, usable_context
from paged_backend.model.loading.model_loader import eager_type_reason
from paged_backend.model.paged.paged_cache import KVShape
from paged_backend.parallel.step_protocol import agree_on_blocks


@dataclass(frozen=True)
class ModelFacts:
    """What start-up knows of the model and the process before it decides anything."""

    device: torch.device
    dtype: torch.dtype  # the parameters'
    shape: KVShape  # the K/V each layer keeps (its spec), as the start-up probe found it
    positions: int | None = None  # the config's max_position_embeddings
    context_limit: tuple[int, str] | None = None  # the longest context the engine runs exactly, and why
    step_limit: tuple[int, str] | None = None  # the most tokens (and rows) one step runs exactly, and why
    draft_shape: KVShape | None = None  # a draft model's K/V per block; None: no draft model
    draft_positions: int | None = None  # the draft's max_position_embeddings
    tensor_parallel_reason: str | None = None  # why this process runs eagerly: tensor parallelism; None: one rank
    model_eager_reason: str | None = None  # why this model runs eagerly (PEFT tuner layers, dynamic rope, its type)
    free_device_bytes: int | None = None  # CUDA memory free after loading the model; None on CPU
    batch_invariant_refusal: str | None = None  # why this model's steps cannot be batch-invariant here

    @property
    def tensor_parallel(self) -> bool:
        return self.tensor_parallel_reason is not None

    @property
    def recurrent(self) -> bool:
        """A hybrid model whose recurrent layers keep a state per request, in a state slot."""
        return self.shape.needs_state_slots


@dataclass(frozen=True)
class StartupPlan:
    device: torch.device
    tensor_parallel: bool
    kv_dtype: torch.dtype
    num_blocks: int  # blocks the pool hands out (pages of a layer group each, when some layers free theirs)
    groups: CacheGroups
    pad: bool  # decode-only steps padded to a fixed size (decode_padding.py)
    graph_refusal: str | None  # why decode steps are not captured in CUDA graphs; None: they are
    max_model_len: int
    context_note: str  # why the context is shorter than the model's positions, as " (why)"; "" when it is not
    prefix_caching: bool
    lora: bool
    compile: bool
    batch_invariant: bool = False  # steps run batch-invariantly (model/batch_invariant.py)
    notes: tuple[tuple[str, str], ...] = ()  # (topic, why) for each choice that is off or limited

    @property
    def cache_pages(self) -> int:
        """Pages of the cache tensor: the pool's, and one beyond it that the pool never hands out, read by freed
        table entries (the null block) or written by a padded step's padding rows (the scratch block)."""
        return self.num_blocks + (1 if self.groups.frees_blocks or self.pad else 0)

    @property
    def null_block(self) -> int | None:
        """The page freed table entries point at, when window or chunked layers free their blocks."""
        return self.num_blocks if self.groups.frees_blocks else None

    @property
    def capture(self) -> bool:
        return self.pad and self.graph_refusal is None

    def reasons(self) -> dict[str, str]:
        """Why each choice that is off or limited is so, by topic."""
        return dict(self.notes)

    def stats(self) -> dict[str, float]:
        """The plan's choices in `Engine.stats()` form."""
        return {"startup_max_model_len": self.max_model_len, "startup_prefix_caching": float(self.prefix_caching),
                "startup_pad_decode": float(self.pad), "startup_frees_window_blocks": float(self.groups.frees_blocks),
                "startup_compile_planned": float(self.compile)}


def read_facts(model: torch.nn.Module, shape: KVShape, draft=None) -> ModelFacts:
    """The facts of a prepared model (model_check.prepare_model gave `shape`), its draft model and process."""
    param = next(model.parameters())
    text_config = model.config.get_text_config()
    free = None
    if param.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(param.device)
    return ModelFacts(
        device=param.device, dtype=param.dtype, shape=shape,
        positions=getattr(text_config, "max_position_embeddings", None),
        context_limit=usable_context(text_config), step_limit=temperature_tuning_limit(text_config),
        draft_shape=draft.shape if draft is not None else None,
        draft_positions=(getattr(draft.model.config.get_text_config(), "max_position_embeddings", None)
                         if draft is not None else None),
        tensor_parallel_reason=compilation.eager_reason(),
        model_eager_reason=compilation.model_eager_reason(model) or eager_type_reason(model),
        free_device_bytes=free, batch_invariant_refusal=batch_invariant.refusal(model))


def plan_startup(config: EngineConfig, facts: ModelFacts) -> StartupPlan:
    """Every start-up choice for this config and these facts (see the module's docstring for the order);
    ValueError, naming the field, for a config the model cannot run."""
    refuse_config(config, facts)
    notes: list[tuple[str, str]] = []
    kv_dtype = config.resolve_kv_cache_dtype(facts.dtype)
    blocks = agree_on_blocks(choose_num_blocks(config, facts, kv_dtype), facts.device)
    graph_refusal = cuda_graphs.refusal(facts.device, facts.dtype, facts.shape.head_dim, facts.tensor_parallel,
                                        config.enable_lora)
    pad = choose_padding(config, facts, graph_refusal, notes)
    groups = choose_groups(config, facts, pad, notes)
    if groups.frees_blocks:  # pages of fewer layers, the same memory
        blocks = groups.pages_for(blocks)
    max_model_len, context_note = choose_context(config, facts, groups, blocks)
    return StartupPlan(
        device=facts.device, tensor_parallel=facts.tensor_parallel, kv_dtype=kv_dtype, num_blocks=blocks,
        groups=groups, pad=pad, graph_refusal=graph_refusal, max_model_len=max_model_len,
        context_note=context_note,
        prefix_caching=config.enable_prefix_caching and facts.shape.prefix_caching,
        lora=config.enable_lora, compile=choose_compile(config, facts, notes), batch_invariant=config.batch_invariant,
        notes=tuple(notes))


def refuse_config(config: EngineConfig, facts: ModelFacts) -> None:
    """ValueError for what this model cannot run: a step budget past its step limit, LoRA under tensor
    parallelism, a second KV tier where blocks do not hold all of a request's state."""
    refuse_step_budget(config, facts.step_limit)
    if config.enable_lora and facts.tensor_parallel:
        raise ValueError("enable_lora=True does not run with tensor parallelism (the adapters' B matrices "
                         "would have to be sharded like the layers they adapt)")
    refuse_offload(config, facts)
    refuse_batch_invariance(config, facts)


def refuse_batch_invariance(config: EngineConfig, facts: ModelFacts) -> None:
    """ValueError for batch_invariant=True where a step's sums would still follow its batch: what the model holds
    (batch_invariant.refusal), recurrent layers, the LoRA slots, or a compiled forward asked for."""
    if not config.batch_invariant:
        return
    reasons = [
        facts.recurrent and "this model's recurrent layers scan each prompt in the chunks its steps cut",
        facts.batch_invariant_refusal,
        config.enable_lora and "the LoRA slots (enable_lora=True) multiply by masks of their own; a PEFT model's "
                               "adapters run",
        config.compile and "it runs eagerly (compile=True asks for graphs whose kernels are chosen per shape)",
    ]
    reason = next((reason for reason in reasons if reason), None)
    if reason:
        raise ValueError(f"EngineConfig.batch_invariant=True: {reason}")


def refuse_offload(config: EngineConfig, facts: ModelFacts) -> None:
    """ValueError for a second KV tier (kv_offload_*) this engine cannot keep right: it stores the blocks the prefix
    cache registers, so it needs prefix caching and K/V that live wholly in the pool's blocks."""
    if not (config.kv_offload_host_bytes or config.kv_offload_disk_bytes):
        return
    reason = None
    if not config.enable_prefix_caching:
        reason = "it stores the prefix cache's blocks, and enable_prefix_caching=False"
    elif not facts.shape.prefix_caching:
        reason = ("this model's recurrent layers keep a state per request outside the KV blocks, which the tier "
                  "cannot carry")
    elif facts.draft_shape is not None:
        reason = "the draft model's K/V would have to be stored beside the target's, which the tier does not do"
    elif facts.tensor_parallel:
        reason = "under tensor parallelism each rank holds a shard of every block"
    if reason:
        raise ValueError(f"kv_offload_host_bytes / kv_offload_disk_bytes: a second KV tier does not run here: {reason}")


def fusion_off(config: EngineConfig) -> str | None:
    """Why the config leaves the projections unfused, or None (decided before the plan: the model is fused as it is
    prepared, before its facts are read)."""
    if not config.fuse_projections:
        return "EngineConfig.fuse_projections=False"
    if config.batch_invariant:
        return "EngineConfig.batch_invariant=True: a trainer's forward runs its projections one by one"
    return None


def refuse_step_budget(config: EngineConfig, step_limit: tuple[int, str] | None) -> None:
    """ValueError for a step budget larger than the model runs exactly in one packed step
    (model_check.temperature_tuning_limit); a padded decode step holds at most max_num_seqs rows."""
    if step_limit is None:
        return
    for name in ("max_num_batched_tokens", "max_num_seqs"):
        if getattr(config, name) > step_limit[0]:
            raise ValueError(f"EngineConfig.{name}={getattr(config, name)}: {step_limit[1]}")


def choose_num_blocks(config: EngineConfig, facts: ModelFacts, kv_dtype: torch.dtype) -> int:
    """Blocks within the K/V budget; a draft model's cache has as many blocks and shares the budget."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    budget = config.kv_cache_bytes
    if budget is None and facts.free_device_bytes is not None:
        budget = int(facts.free_device_bytes * DEFAULT_CUDA_KV_FRACTION)
    budget = budget or DEFAULT_CPU_KV_BYTES
    per_block = facts.shape.bytes_per_block(config.block_size, kv_dtype)
    if facts.draft_shape is not None:
        per_block += facts.draft_shape.bytes_per_block(config.block_size, kv_dtype)
    return max(1, budget // per_block)


def choose_padding(config: EngineConfig, facts: ModelFacts, graph_refusal: str | None,
                   notes: list[tuple[str, str]]) -> bool:
    """Pad decode-only steps: where they are captured (CUDA), or anywhere when the config says so."""
    if not config.cuda_graph_sizes or config.pad_decode is False:
        return False
    if facts.recurrent:  # padding rows would need state slots of their own
        return False
    if config.enable_lora:  # the LoRA hooks run per step (eagerly): a captured step would leave them out
        notes.append(("CUDA graphs", "LoRA steps run eagerly and unpadded"))
        return False
    if facts.device.type == "cuda" and graph_refusal is not None:
        notes.append(("CUDA graphs", f"{graph_refusal}; decode steps run uncaptured"))
    return bool(config.pad_decode) or graph_refusal is None


def choose_groups(config: EngineConfig, facts: ModelFacts, pad: bool, notes: list[tuple[str, str]]) -> CacheGroups:
    """The layer groups of the KV cache: per layer spec, so window and chunked layers free their old blocks
    (kv_cache_groups.py), unless no layer frees any or this engine needs one block table for all layers; then
    one group keeping every block, as a model without windows has. A hybrid model's recurrent layers keep no K/V:
    the pages hold its attention layers only."""
    specs = facts.shape.layers
    groups = plan_groups(specs)
    if not groups.frees_blocks:
        return groups
    reason = window_memory_refusal(config, facts, pad)
    if reason is None:
        return groups
    notes.append(("sliding windows", f"every layer keeps every block ({reason})"))
    return plan_groups([spec.keeping_every_block() for spec in specs])


def window_memory_refusal(config: EngineConfig, facts: ModelFacts, pad: bool) -> str | None:
    """Why this engine keeps every block of its window (and chunked) layers, or None when they free theirs. A
    compiled forward frees them too: its graphs read no block table (the attention op takes each layer's group
    metadata from the step context)."""
    if not config.free_window_blocks:
        return "EngineConfig.free_window_blocks=False"
    if facts.draft_shape is not None:
        return "a draft model reads and writes through the target's one block table"
    if facts.tensor_parallel:
        return "tensor parallelism's ranks share one block table"
    if pad:
        return "padded and captured decode steps replay one block table"
    return None


def choose_context(config: EngineConfig, facts: ModelFacts, groups: CacheGroups, num_blocks: int
                   ) -> tuple[int, str]:
    """The context length and, when the engine caps the model's positions to run exactly, why (" (why)")."""
    model_len = config.max_model_len or facts.positions or 2048
    note = ""
    if facts.context_limit is not None:
        limit, why = facts.context_limit
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"EngineConfig.max_model_len={config.max_model_len}: {why}")
        model_len, note = min(model_len, limit), f" ({why})"
    if facts.draft_shape is not None:  # the draft sees every position the target does
        model_len = min(model_len, facts.draft_positions or model_len)
    # A request alone must always fit in the cache, or preemption could never make room for it.
    return min(model_len, groups.capacity_tokens(num_blocks, config.block_size, config.max_num_batched_tokens)), note


def choose_compile(config: EngineConfig, facts: ModelFacts, notes: list[tuple[str, str]]) -> bool:
    """Compile the runner's forward when the config asks (or, by default, on CPU), unless the process or the
    model must run eagerly."""
    if not compilation.wants_compile(config.compile, facts.device):
        return False
    if config.batch_invariant:
        notes.append(("compile", "batch_invariant=True runs eagerly (compiled kernels are chosen per shape)"))
        return False
    reason = facts.tensor_parallel_reason or facts.model_eager_reason
    if reason is not None:
        notes.append(("compile", reason))
        return False
    return True
