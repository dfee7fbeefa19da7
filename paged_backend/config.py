"""EngineConfig: the knobs of one engine, with defaults sized for a small machine."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_backend.speculative.speculative_config import SpeculativeConfig

DEFAULT_CPU_KV_BYTES = 512 * 2**20  # a fixed budget: the KV cache never takes "most of the machine"
DEFAULT_CUDA_KV_FRACTION = 0.4  # of the device memory free after loading the model
# What the paged KV cache stores: "auto" is the model's dtype; int8 keeps a scale per token and head.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}
DEFAULT_CUDA_GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREEMPTION_MODES = ("auto", "swap", "recompute")


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV cache block
    num_kv_blocks: int | None = None  # wins over kv_cache_bytes when set
    kv_cache_bytes: int | None = None  # default: DEFAULT_CPU_KV_BYTES on CPU, a fraction of free memory on CUDA
    max_num_batched_tokens: int = 512  # token budget of one step (chunked prefill slices prompts to fit)
    max_num_seqs: int = 64  # requests in one step
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    dtype: torch.dtype | str | None = None  # weights, e.g. float32, bfloat16; None or auto: precision.py's pick
    device: str | torch.device | None = None  # e.g. cpu, cuda; None: cuda when available (a given model: where it is)
    num_threads: int | None = None  # torch intra-op threads on CPU; None leaves torch's setting
    enable_prefix_caching: bool = True  # share the K/V of identical prompt prefixes across requests
    # Speculative decoding: None (off), a SpeculativeConfig or its dict, e.g. {"method": "ngram",
    # "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}.
    speculative_config: SpeculativeConfig | dict | None = None
    # At start-up, run a few tokens through chunked prefill and decode and refuse the model if its paged
    # logits differ from its own dense forward (the guard for architectures nobody has tested yet), and run a
    # compiled forward against the eager one, dropping it if they differ (fast_path_check.py).
    self_check: bool = True
    # Compile the model forward at start-up: True, False, or None (on CPU, unless PAGED_BACKEND_COMPILE=0 or no
    # C++ compiler is installed; see compilation.py). Compiled graphs are kept on disk: later starts load them.
    compile: bool | None = None
    # Run each layer's q/k/v projections as one matmul and its gate/up projections as one (fused_projections.py;
    # the model's weights become views of the stacked copy). False runs each projection by itself, as the
    # model's own code does: for comparing against the unfused engine or ruling fusion out while debugging.
    fuse_projections: bool = True
    # LoRA adapters chosen per request (model/lora/): at most max_loras distinct adapters run at once (more wait),
    # each of rank at most max_lora_rank. With LoRA the step runs eagerly.
    enable_lora: bool = False
    max_loras: int = 4  # distinct adapters in one step (more wait)
    max_lora_rank: int = 16  # the largest adapter rank the device slots hold
    # The KV cache's storage: "auto" (the model's dtype), "bf16", "fp16" or "int8" (per token and head scaled);
    # a lower precision than the model's halves (bf16/fp16 under fp32) or quarters (int8) KV memory.
    kv_cache_dtype: str = "auto"
    # Decode-only steps are padded to the next of these batch sizes and, on CUDA, replayed from a CUDA graph
    # captured for that size at start-up (decode_padding.py, cuda_graphs.py). None: 1, 2, 4, ..., 256, capped at
    # max_num_seqs; [] turns padding and capture off. Mixed prefill/decode steps are never padded.
    cuda_graph_sizes: list[int] | None = None
    # Pad decode-only steps to cuda_graph_sizes: None pads where the steps are captured (CUDA); True pads on
    # any device (on CPU nothing is captured: this runs the padded path to check it); False never pads (so
    # nothing is captured either).
    pad_decode: bool | None = None
    # Layers with a sliding window keep only the blocks inside it (chunked layers those of their chunk),
    # freeing older ones as a sequence grows (layer_specs.py); False keeps every block of every layer. Engines
    # that pad decode steps, run a draft model or tensor parallelism keep every block either way.
    free_window_blocks: bool = True
    # A second tier for full KV blocks behind the pool (kv_offload/): every block the prefix cache registers is also
    # stored there, and a later prefix hit, or a preempted request resuming, reads back the blocks the pool evicted
    # instead of computing them. Each tier has a byte budget; None leaves it off.
    # Host memory: worth it where the pool is on a GPU (on a CPU a larger kv_cache_bytes does the same).
    kv_offload_host_bytes: int | None = None
    # A folder on disk that outlives the process: after a restart, cached prefixes are read back, not recomputed.
    kv_offload_disk_bytes: int | None = None
    kv_offload_dir: str | None = None  # the disk tier's folder (default: PAGED_BACKEND_CACHE/kv)
    # A preempted request: "recompute" its context, "swap" (read its full blocks back from the second tier), or
    # "auto" (with a second tier, swap where the KV cache is on a CPU, recompute on a GPU; without one, recompute).
    preemption_mode: str = "auto"
    # A request's logits, tokens and logprobs do not depend on the rest of its batch, its prompt's chunking or prefix
    # cache hits (model/batch_invariant.py): for comparing rollout logprobs with a trainer's forward. CPU only; runs
    # eagerly and unfused, small steps' matmuls padded, at a cost docs/rl-trl.md states.
    batch_invariant: bool = False
    # Hosts whose http(s) image URLs requests may name (vision models), fetched with a time and size limit and no
    # redirects; None or empty: images come inline (data URLs, bytes), and a web address is refused.
    allowed_image_domains: list[str] | None = None

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"EngineConfig.kv_cache_dtype={self.kv_cache_dtype!r}: must be one of "
                             f"{', '.join(map(repr, KV_CACHE_DTYPES))}")
        if self.compile not in (True, False, None):
            raise ValueError(f"EngineConfig.compile={self.compile!r}: must be True, False or None")
        if self.pad_decode not in (True, False, None):
            raise ValueError(f"EngineConfig.pad_decode={self.pad_decode!r}: must be True, False or None")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name}={value!r}: must be an int >= 1")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"EngineConfig.preemption_mode={self.preemption_mode!r}: must be one of "
                             f"{', '.join(map(repr, PREEMPTION_MODES))}")
        if self.preemption_mode == "swap" and not (self.kv_offload_host_bytes or self.kv_offload_disk_bytes):
            raise ValueError("EngineConfig.preemption_mode='swap' needs a second tier to swap to: set "
                             "kv_offload_host_bytes or kv_offload_disk_bytes")
        for name in ("num_kv_blocks", "kv_cache_bytes", "max_model_len", "num_threads", "kv_offload_host_bytes",
                     "kv_offload_disk_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"EngineConfig.{name}={value!r}: must be an int >= 1 or None")
        self.cuda_graph_sizes = resolve_graph_sizes(self.cuda_graph_sizes, self.max_num_seqs)
        if self.pad_decode and not self.cuda_graph_sizes:
            raise ValueError("EngineConfig.pad_decode=True needs cuda_graph_sizes to pad to (it is empty)")

    def resolve_kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the KV cache stores for a model of `model_dtype`."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or model_dtype


def resolve_graph_sizes(sizes: list[int] | None, max_num_seqs: int) -> list[int]:
    """The padded decode batch sizes, ascending, none above max_num_seqs; a batch larger than every
    size but within max_num_seqs gets max_num_seqs itself as its size, so every decode batch has one."""
    given = DEFAULT_CUDA_GRAPH_SIZES if sizes is None else sizes
    if not isinstance(given, (list, tuple)) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in given):
        raise ValueError(f"EngineConfig.cuda_graph_sizes={sizes!r}: must be a list of ints >= 1 (or [] for none)")
    kept = {s for s in given if s <= max_num_seqs}
    if len(kept) < len(set(given)):
        kept.add(max_num_seqs)
    return sorted(kept)
