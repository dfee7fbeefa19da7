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
import weakref
from collections.abc import Iterator

import torch
from transformers import PreTrainedModel

from paged_backend.errors import UnsupportedArchitectureError
from paged_backend.kernels import AttentionMetadata
from paged_backend.model import quantized_linear
from paged_backend.model.adapters import install_adapters, uninstall_adapters
from paged_backend.model.attention import ATTENTION_NAME, register
from paged_backend.model.model_runner import ModelRunner, StepInputs
from paged_backend.model.paged_cache import KVShape, PagedCache, probe_kv_shape
from paged_backend.model.recurrent_state import RecurrentState, RecurrentStep, state_layout

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

_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (dtype, device) it passed on


def prepare_model(model: PreTrainedModel, num_layers: int, self_check: bool = True) -> KVShape:
    """Switch `model` to the engine's attention, probe it, and (with `self_check`) compare paged and
    dense logits; return its K/V shape. On any refusal the model is left exactly as it came."""
    register()
    previous = model.config._attn_implementation
    try:
        adapter = install_adapters(model)
        if (adapter is None or adapter.uses_interface) and previous != ATTENTION_NAME:
            model.set_attn_implementation(ATTENTION_NAME)
        shape = probe_kv_shape(model, num_layers)
        if self_check:
            check_paged_matches_dense(model, shape)
        return shape
    except BaseException:
        uninstall_adapters(model)
        if model.config._attn_implementation != previous:
            model.set_attn_implementation(previous)
        raise


def check_paged_matches_dense(model: PreTrainedModel, shape: KVShape) -> None:
    """Run two short sequences through chunked prefill and decode on a small paged cache and refuse
    the model if its logits differ from one dense forward of the same tokens beyond the dtype's
    tolerance. A model object that passed once (same dtype and device) is not checked again."""
    param = next(model.parameters())
    if _checked.get(model) == (param.dtype, param.device):
        return
    vocab = model.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (n,), generator=generator).to(param.device) for n in CHECK_LENGTHS]
    with torch.inference_mode(), chunks_crossed(model):
        dense = dense_logits(model, seqs)
        paged = paged_logits(model, shape, seqs, param.dtype, param.device)
    worst = (paged.float() - dense.float()).abs().max().item()
    precision = computing_dtype(model, param.dtype)
    allowed = TOLERANCE.get(precision, 6e-2) * max(1.0, dense.float().abs().max().item())
    if not worst <= allowed:  # also refuses NaN
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} (model_type={getattr(model.config, 'model_type', None)!r}): the paged engine's "
            f"logits differ from the model's own forward by {worst:.4g} (tolerance {allowed:.4g} in "
            f"{str(precision).removeprefix('torch.')}) on a short chunked-prefill and decode check, so this "
            "architecture does not run correctly on it and is refused (EngineConfig(self_check=False) skips the check)"
        )
    _checked[model] = (param.dtype, param.device)


@contextlib.contextmanager
def chunks_crossed(model: PreTrainedModel) -> Iterator[None]:
    """Inside the block, a chunked-attention model (a "chunked_attention" entry in its layer types) has chunks
    of CHECK_CHUNK positions, so the self-check's short sequences cross chunk boundaries; both the model's own
    masks and the paged attention read the chunk from the config when they run. Restored on exit."""
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


def dense_logits(model: PreTrainedModel, seqs: list[torch.Tensor]) -> torch.Tensor:
    """The model's own forward (no paged cache) on the sequences right-padded into one batch; causal
    attention keeps padding from touching real positions. Rows in CHECK_STEPS order."""
    width = max(len(s) for s in seqs)
    batch = torch.zeros(len(seqs), width, dtype=torch.long, device=seqs[0].device)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s
    logits = model(input_ids=batch, use_cache=False).logits
    return torch.cat([logits[i, lo:hi] for step in CHECK_STEPS for i, (lo, hi) in enumerate(step)])


def paged_logits(model: PreTrainedModel, shape: KVShape, seqs: list[torch.Tensor], dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """The same logits through the engine's path: packed steps, a paged cache, the model runner's call."""
    num_blocks = 1 + max(b for table in CHECK_TABLES for b in table)
    cache = PagedCache(shape, num_blocks, CHECK_BLOCK_SIZE, dtype, device)
    runner = ModelRunner(model, cache)
    layout = state_layout(model.config.get_text_config())
    if layout is not None:  # a hybrid model: sequence i in state slot i
        runner.recurrent = RecurrentState(layout, len(seqs), dtype, device)
    return torch.cat([runner.forward(step_inputs(step, seqs, device, layout is not None)) for step in CHECK_STEPS])


def step_inputs(step: tuple[tuple[int, int], ...], seqs: list[torch.Tensor], device: torch.device,
                recurrent: bool = False) -> StepInputs:
    """One packed step `[(start, end) per sequence]` as the model runner would build it (with `recurrent`,
    sequence i's state in slot i)."""
    def on_device(values) -> torch.Tensor:
        return torch.tensor(values, device=device)

    positions = [p for lo, hi in step for p in range(lo, hi)]
    slots = [CHECK_TABLES[i][p // CHECK_BLOCK_SIZE] * CHECK_BLOCK_SIZE + p % CHECK_BLOCK_SIZE
             for i, (lo, hi) in enumerate(step) for p in range(lo, hi)]
    starts = [0]
    for lo, hi in step:
        starts.append(starts[-1] + hi - lo)
    width = max(len(t) for t in CHECK_TABLES)
    tables = [list(t) + [0] * (width - len(t)) for t in CHECK_TABLES]
    seq_lens = [hi for _, hi in step]
    metadata = AttentionMetadata(
        slot_mapping=on_device(slots),
        block_tables=on_device(tables).to(torch.int32),
        query_start_loc=on_device(starts).to(torch.int32),
        seq_lens=on_device(seq_lens).to(torch.int32),
        block_size=CHECK_BLOCK_SIZE,
        query_start_loc_host=starts,
        seq_lens_host=seq_lens,
        max_query_len=max(hi - lo for lo, hi in step),
        max_seq_len=max(seq_lens),
    )
    ids = torch.cat([seqs[i][lo:hi] for i, (lo, hi) in enumerate(step)])
    return StepInputs(input_ids=ids[None], position_ids=on_device(positions)[None],
                      logits_indices=torch.arange(len(ids), device=device), sampling_requests=[],
                      metadata=metadata,
                      recurrent=RecurrentStep(tuple(starts), tuple(lo for lo, _ in step),
                                              tuple(range(len(step)))) if recurrent else None)


def usable_context(text_config) -> tuple[int, str] | None:
    """(the longest context the engine runs exactly, why) for a model that has such a limit below its
    max_position_embeddings, else None: LongRoPE's original length, or Llama 4's temperature tuning
    (temperature_tuning_limit)."""
    return longrope_limit(text_config) or temperature_tuning_limit(text_config)


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
