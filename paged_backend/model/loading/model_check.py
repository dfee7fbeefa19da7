"""Vetting a model before the engine runs it: switch it to the paged attention, probe what every layer
does, and check a few tokens of paged output against the model's own dense forward.

The probe (`paged_cache.probe_kv_shape`) catches a layer that bypasses the engine's step; the
self-check catches anything else that makes paged logits differ (a new architecture nobody has
tested yet), for the price of three small forwards. Attention sinks (gpt-oss) take part in every
row, so the check covers them as it is; a chunked-attention model (Llama 4) runs the check with its
chunk shrunk to CHECK_CHUNK positions, so both sequences cross a chunk boundary, in prefill and in
the cached chunk and decode step alike. A hybrid model's recurrent layers run from state slots of their own
(recurrent_state.py), so the check covers a chunk that continues a state and a decode step that advances one.
A model that fails either is put back exactly
as it came (attention implementation, adapters) and refused with `UnsupportedArchitectureError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator

import numpy as np
import torch
from transformers import PreTrainedModel

from paged_backend.errors import UnsupportedArchitectureError
from paged_backend.kernels import pack_sequences
from paged_backend.model.quantized import quantized_linear
from paged_backend.model.adapters import install_adapters, uninstall_adapters
from paged_backend.model.paged.attention import ATTENTION_NAME, register
from paged_backend.model.model_runner import ModelRunner
from paged_backend.model.step_inputs import StepInputs
from paged_backend.model.paged.paged_cache import KVShape, PagedCache, probe_kv_shape, probe_model
from paged_backend.model.loading.rope import has_dynamic_rope
from paged_backend.model.paged.recurrent_state import RecurrentState, RecurrentStep, state_layout

# Largest |paged - dense| logit difference accepted, relative to the largest |dense logit| (at least
# 1): fp32 differs only by summation order; half precisions round every layer's activations.
TOLERANCE: dict[torch.dtype, float] = {torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 6e-2}

# The self-check's two sequences, packed the way the engine packs them, with block size 4 and
# blocks out of order: step 1 prefills A[0:5] (across a block boundary) and B[0:3]; step 2 runs
# a chunk A[5:7] on cached context and a decode B[3].
CHECK_BLOCK_SIZE = 4
CHECK_TABLES = ((5, 2), (3,))
CHECK_STEPS = (((0, 5), (0, 3)), ((5, 7), (3, 4)))
CHECK_LENGTHS = (7, 4)
# Chunk of a chunked-attention model during the check: sequence A's chunks start at 0, 3 and 6, B's at 0 and
# 3, so prefill, the cached chunk A[5:7] and the decode B[3] each see a chunk start.
CHECK_CHUNK = 3
# Window of a sliding-window model during the check (windows_crossed): both sequences outgrow it.
CHECK_WINDOW = 3

# model -> the (dtype, device, far context or None) it passed the check on
_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# model -> the attention implementation it had before the engine switched it to the paged one
_attention_before: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def prepare_model(model: PreTrainedModel, num_layers: int, self_check: bool = True,
                  context: int | None = None) -> KVShape:
    """Switch `model` to the engine's attention, probe it, and (with `self_check`) compare paged and
    dense logits, at positions up to `context` (the configured max_model_len) where that goes past the model's
    max_position_embeddings; return its K/V shape. On any refusal the model is left exactly as it came."""
    register()
    previous = model.config._attn_implementation
    try:
        adapter = install_adapters(model)
        if (adapter is None or adapter.uses_interface) and previous != ATTENTION_NAME:
            switch_to_paged_attention(model)
        shape = probe_kv_shape(model, num_layers)
        if self_check:
            check_paged_matches_dense(model, shape)
            check_far_positions(model, shape, context)
        return shape
    except BaseException:
        uninstall_adapters(model)
        if model.config._attn_implementation != previous:
            model.set_attn_implementation(previous)
        raise


def switch_to_paged_attention(model: PreTrainedModel) -> None:
    """Switch `model` to the engine's attention, remembering the one it had (`own_attention`)."""
    _attention_before[model] = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)


def attention_before_engine(model: PreTrainedModel) -> str:
    """The attention implementation `model` had before the engine switched it; for a model loaded with the
    engine's attention, the one transformers would have picked (SDPA where the model supports it)."""
    if model in _attention_before:
        return _attention_before[model]
    return "sdpa" if getattr(model, "_supports_sdpa", False) else "eager"


def give_attention_back(model: PreTrainedModel) -> None:
    """Switch `model` back from the engine's attention to its own, for transformers code that refuses any
    attention it does not know (its own continuous batching); the engine switches it again when it next runs it
    through `generate` (transformers_generate.generator_for)."""
    if model.config._attn_implementation == ATTENTION_NAME:
        model.set_attn_implementation(attention_before_engine(model))


@contextlib.contextmanager
def own_attention(model: PreTrainedModel) -> Iterator[None]:
    """`model` with its own attention inside the block (`give_attention_back`), the engine's again after it: an
    engine that holds the model (an `LLM` on it) keeps running paged."""
    if model.config._attn_implementation != ATTENTION_NAME:
        yield
        return
    give_attention_back(model)
    try:
        yield
    finally:
        model.set_attn_implementation(ATTENTION_NAME)


def check_paged_matches_dense(model: PreTrainedModel, shape: KVShape) -> None:
    """Run two short sequences through chunked prefill and decode on a small paged cache and refuse
    the model if its logits differ from one dense forward of the same tokens beyond the dtype's
    tolerance. A model object that passed once (same dtype and device) is not checked again."""
    param = next(model.parameters())
    if (param.dtype, param.device, None) in _checked.get(model, ()):
        return
    worst, allowed, precision = logits_difference(model, shape, near_positions())
    if not worst <= allowed:  # also refuses NaN
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} (model_type={getattr(model.config, 'model_type', None)!r}): the paged engine's "
            f"logits differ from the model's own forward by {worst:.4g} (tolerance {allowed:.4g} in "
            f"{str(precision).removeprefix('torch.')}) on a short chunked-prefill and decode check{known_cause(model)}, "
            "so this architecture does not run correctly on it and is refused (EngineConfig(self_check=False) skips "
            "the check)"
        )
    _checked.setdefault(model, set()).add((param.dtype, param.device, None))


def known_cause(model: PreTrainedModel) -> str:
    """Why a model fails the self-check, where its config says it (", ..."), else ""."""
    if getattr(model.config.get_text_config(), "use_bidirectional_attention", False):
        return (" (its config sets use_bidirectional_attention: every token attends to later ones too, as an "
                "embedding model's do, which the engine's causal steps cannot compute)")
    return ""


def check_far_positions(model: PreTrainedModel, shape: KVShape, context: int | None) -> None:
    """Refuse a context (EngineConfig.max_model_len) past the model's max_position_embeddings unless the paged
    engine's logits there equal the model's own. A model whose position encoding depends on the whole forward
    (dynamic NTK rope recomputes its frequencies from the largest position of the forward) gives a request
    different logits when its chunks and batch-mates change, and a model with learned positions has none there:
    the check runs the sequences with one chunk near the start and the rest near `context`, so the chunked
    prefill's steps reach different largest positions while the dense forward sees them all at once. Skipped
    where usable_context already caps the context (with its own reason)."""
    text_config = model.config.get_text_config()
    limit = getattr(text_config, "max_position_embeddings", None)
    if context is None or not limit or context <= limit or usable_context(text_config) is not None:
        return
    param = next(model.parameters())
    if (param.dtype, param.device, context) in _checked.get(model, ()):
        return
    prefix = f"EngineConfig.max_model_len={context} goes past the model's max_position_embeddings={limit}"
    try:
        worst, allowed, precision = logits_difference(model, shape, far_positions(context))
    except Exception as exc:  # noqa: BLE001  (the model's own forward fails there: refuse the setting)
        raise ValueError(f"{prefix}, where the model's own forward fails ({type(exc).__name__}: {exc}); "
                         f"use max_model_len <= {limit}") from exc
    if not worst <= allowed:
        raise ValueError(
            f"{prefix}, where the paged engine's logits differ from the model's own forward by {worst:.4g} "
            f"(tolerance {allowed:.4g} in {str(precision).removeprefix('torch.')}) when a sequence's chunks run in "
            f"different steps (its position encoding there depends on the whole forward); use max_model_len <= "
            f"{limit}")
    _checked.setdefault(model, set()).add((param.dtype, param.device, context))


def logits_difference(model: PreTrainedModel, shape: KVShape,
                      positions: tuple[list[int], ...]) -> tuple[float, float, torch.dtype]:
    """(largest |paged - dense| logit, the tolerance, the computing dtype) on the check's two random sequences at
    `positions` (one list per sequence). The paged steps run first: a dynamic rope keeps the frequencies of the
    largest position it has seen, so a dense forward first would hand its frequencies to every paged step."""
    param = next(model.parameters())
    vocab = model.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (n,), generator=generator).to(param.device) for n in CHECK_LENGTHS]
    with torch.inference_mode(), chunks_crossed(model), windows_crossed(model):
        paged = paged_logits(model, crossed_shape(model, shape), seqs, param.dtype, param.device, positions)
        dense = dense_logits(model, seqs, positions)
    worst = (paged.float() - dense.float()).abs().max().item()
    precision = computing_dtype(model, param.dtype)
    allowed = TOLERANCE.get(precision, 6e-2) * max(1.0, dense.float().abs().max().item())
    return worst, allowed, precision


def near_positions() -> tuple[list[int], ...]:
    """Each check sequence at positions 0, 1, ...: where every request starts."""
    return tuple(list(range(n)) for n in CHECK_LENGTHS)


def far_positions(context: int) -> tuple[list[int], ...]:
    """Sequence A's first chunk (CHECK_STEPS' first step) at positions 0, 1, ... and the rest of it, like all of B,
    at the last positions of `context`: the two steps' largest positions are as far apart as the context allows."""
    first = CHECK_STEPS[0][0][1]
    a, b = CHECK_LENGTHS
    return list(range(first)) + list(range(context - (a - first), context)), list(range(context - b, context))


def crossed_shape(model: PreTrainedModel, shape: KVShape) -> KVShape:
    """`shape` with each layer's attention record as the model describes it now, inside windows_crossed and
    chunks_crossed: the start-up records hold the model's real window and chunk, which the check's short
    sequences would not cross. Recorded by a probe, as at start-up, so the paged steps attend with whatever the
    model's layers say under the shrunk settings, and the dense forward masks with the same."""
    return dataclasses.replace(shape, attention=probe_model(model).layer_attention(shape.num_layers))


@contextlib.contextmanager
def windows_crossed(model: PreTrainedModel) -> Iterator[None]:
    """Inside the block, a sliding-window model's window is CHECK_WINDOW positions, so the self-check's short
    sequences outgrow it (a real window of thousands of tokens would hide a layer whose window the paged path
    misses). The window is set where transformers reads it: `config.sliding_window` (its masks, and attention
    modules that pass the config's value) and each module's `sliding_window` attribute holding the same value
    (attention modules that pass their own). Restored on exit."""
    config = model.config.get_text_config()
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= CHECK_WINDOW:
        yield
        return
    modules = [m for m in model.modules() if vars(m).get("sliding_window") == window]
    config.sliding_window = CHECK_WINDOW
    for module in modules:
        module.sliding_window = CHECK_WINDOW
    try:
        yield
    finally:
        config.sliding_window = window
        for module in modules:
            module.sliding_window = window


@contextlib.contextmanager
def chunks_crossed(model: PreTrainedModel) -> Iterator[None]:
    """Inside the block, a chunked-attention model (a "chunked_attention" entry in its layer types) has chunks
    of CHECK_CHUNK positions, so the self-check's short sequences cross chunk boundaries; both the model's own
    masks and the probe that records the check's attention records (crossed_shape) read the chunk from the config.
    Restored on exit."""
    config = model.config.get_text_config()
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is None or "chunked_attention" not in (getattr(config, "layer_types", None) or ()):
        yield
        return
    config.attention_chunk_size = min(chunk, CHECK_CHUNK)
    try:
        yield
    finally:
        config.attention_chunk_size = chunk


def computing_dtype(model: PreTrainedModel, dtype: torch.dtype) -> torch.dtype:
    """The precision the model's matmuls run in: quantized layers take bf16 activations whatever the model's dtype."""
    return quantized_linear.COMPUTE_DTYPE if quantized_linear.has_quantized_layers(model) else dtype


def dense_logits(model: PreTrainedModel, seqs: list[torch.Tensor],
                 positions: tuple[list[int], ...] | None = None) -> torch.Tensor:
    """The model's own forward (no paged cache) on the sequences right-padded into one batch, at `positions`
    (default: 0, 1, ...); causal attention keeps padding from touching real positions. Rows in CHECK_STEPS order."""
    width = max(len(s) for s in seqs)
    batch = torch.zeros(len(seqs), width, dtype=torch.long, device=seqs[0].device)
    position_ids = torch.arange(width, device=seqs[0].device).repeat(len(seqs), 1)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s
        if positions is not None:
            position_ids[i, : len(s)] = torch.tensor(positions[i])
            position_ids[i, len(s):] = positions[i][-1]  # padding: no larger position than the sequence's own
    # With positions, a mask of ones too: without one transformers reads a jump in position_ids as the start of
    # another packed sequence and masks across it.
    kwargs = {} if positions is None else {"position_ids": position_ids, "attention_mask": torch.ones_like(batch)}
    logits = model(input_ids=batch, use_cache=False, **kwargs).logits
    return torch.cat([logits[i, lo:hi] for step in CHECK_STEPS for i, (lo, hi) in enumerate(step)])


def paged_logits(model: PreTrainedModel, shape: KVShape, seqs: list[torch.Tensor], dtype: torch.dtype,
                 device: torch.device, positions: tuple[list[int], ...] | None = None) -> torch.Tensor:
    """The same logits through the engine's path: packed steps, a paged cache, the model runner's call."""
    num_blocks = 1 + max(b for table in CHECK_TABLES for b in table)
    cache = PagedCache(shape, num_blocks, CHECK_BLOCK_SIZE, dtype, device)
    layout = state_layout(model.config.get_text_config())
    # A hybrid model: sequence i in state slot i.
    runner = ModelRunner(model, cache, recurrent=RecurrentState(layout, len(seqs), dtype, device)
                         if layout is not None else None)
    positions = positions or near_positions()
    return torch.cat([runner.forward(step_inputs(step, seqs, device, layout is not None, positions))
                      for step in CHECK_STEPS])


def step_inputs(step: tuple[tuple[int, int], ...], seqs: list[torch.Tensor], device: torch.device,
                recurrent: bool = False, positions: tuple[list[int], ...] | None = None,
                tables: tuple[tuple[int, ...], ...] = CHECK_TABLES, block_size: int = CHECK_BLOCK_SIZE) -> StepInputs:
    """One packed step `[(start, end) of sequence i, ...]` as the model runner would build it (with `recurrent`,
    sequence i's state in slot i), token p of sequence i at `positions[i][p]` (default: p), in the blocks of
    `tables[i]`."""
    positions = positions or tuple(range(len(s)) for s in seqs)
    position_ids = [positions[i][p] for i, (lo, hi) in enumerate(step) for p in range(lo, hi)]
    width = max(len(t) for t in tables[: len(step)])
    padded = np.array([list(t) + [0] * (width - len(t)) for t in tables[: len(step)]], dtype=np.int32)
    starts = np.array([lo for lo, _ in step], dtype=np.int64)
    counts = np.array([hi - lo for lo, hi in step], dtype=np.int64)
    _, query_start_loc, metadata = pack_sequences(padded, starts, counts, block_size, device)
    ids = torch.cat([seqs[i][lo:hi] for i, (lo, hi) in enumerate(step)])
    return StepInputs(input_ids=ids[None], position_ids=torch.tensor(position_ids, device=device)[None],
                      logits_indices=torch.arange(len(ids), device=device), sampling_requests=[],
                      metadata=metadata,
                      recurrent=RecurrentStep(tuple(query_start_loc.tolist()), tuple(starts.tolist()),
                                              tuple(range(len(step)))) if recurrent else None)


def usable_context(text_config) -> tuple[int, str] | None:
    """(the longest context the engine runs exactly, why) for a model that has such a limit, else None:
    LongRoPE's original length, dynamic NTK rope's max_position_embeddings (a max_model_len past it is refused),
    Llama 4's temperature tuning (temperature_tuning_limit), or DeepSeek Sparse Attention's index_topk
    (sparse_attention_limit)."""
    return (longrope_limit(text_config) or dynamic_rope_limit(text_config) or temperature_tuning_limit(text_config)
            or sparse_attention_limit(text_config))


def dynamic_rope_limit(text_config) -> tuple[int, str] | None:
    """Dynamic NTK rope's usable context (usable_context). transformers recomputes its frequencies from the largest
    position of each forward once that passes max_position_embeddings, and keeps them: in a packed step the
    largest position is the batch's, so chunking and batch-mates would change a request's rotary embedding. Up to
    max_position_embeddings the frequencies are the model's default ones, exactly."""
    if not has_dynamic_rope(text_config):
        return None
    limit = getattr(text_config, "max_position_embeddings", None)
    if not limit:
        return None
    return int(limit), (f"dynamic NTK rope runs on the paged engine up to max_position_embeddings={limit} tokens "
                        "(past it transformers rescales the frequencies from the largest position in each forward, "
                        "which a packed step shares between requests)")


def temperature_tuning_limit(text_config) -> tuple[int, str] | None:
    """(the most positions, and the most tokens in one packed step, the engine runs exactly; why) for a Llama 4
    model with attention temperature tuning on its NoPE layers, else None. Those layers scale each query by
    `1 + attn_scale * log(1 + floor((position + 1) / floor_scale))`, with the position counted from the cache's
    length plus the token's index in the forward, not from position_ids: in a packed step that index runs
    across requests. Below floor_scale - 1 both the true position and the packed index give a scale of exactly
    1, so within floor_scale - 1 positions, in steps of at most that many tokens, the paged engine is exact."""
    if not getattr(text_config, "attn_temperature_tuning", False) or 0 not in (
            getattr(text_config, "no_rope_layers", None) or ()):
        return None
    limit = int(text_config.floor_scale) - 1
    return limit, (f"Llama 4's attention temperature tuning runs on the paged engine up to floor_scale - 1 = {limit} "
                   "positions and steps of at most that many tokens (it counts positions within one forward, "
                   "which a packed step shares between requests)")


def longrope_limit(text_config) -> tuple[int, str] | None:
    """LongRoPE's usable context (usable_context). LongRoPE (Phi-3 128k, Phi-3.5) switches every cached key to the
    long rope factors once a sequence passes original_max_position_embeddings, and transformers picks
    the factors from the largest position in a whole forward, so one request's length would change
    another's rotary embedding in a packed step; within the original length both are exact."""
    rope = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type")) != "longrope":
        return None
    original = rope.get("original_max_position_embeddings") or getattr(
        text_config, "original_max_position_embeddings", None)
    if not original:
        return None
    return int(original), (f"LongRoPE models run on the paged engine up to original_max_position_embeddings="
                           f"{original} tokens (longer contexts switch the rope factors for every cached key)")


def sparse_attention_limit(text_config) -> tuple[int, str] | None:
    """DeepSeek Sparse Attention's usable context (usable_context): its indexer keeps each query's `index_topk`
    best-scored keys and masks the rest; within index_topk tokens it keeps every key, which is the dense attention
    the paged engine computes (adapters/deepseek_v32.py). Past it the engine would attend to keys the model drops."""
    topk = getattr(text_config, "index_topk", None)
    if not isinstance(topk, int) or isinstance(topk, bool) or topk <= 0:
        return None
    return topk, (f"DeepSeek Sparse Attention runs on the paged engine up to index_topk={topk} tokens (within them "
                  "its indexer keeps every key, so the attention is dense; past them it drops keys by its own "
                  "scores, which the paged attention does not compute)")
