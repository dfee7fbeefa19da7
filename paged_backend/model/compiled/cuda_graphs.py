"""CUDA graphs of the padded decode step: captured once per batch size at start-up, replayed per step.

On a GPU a decode step is bound by launching hundreds of small kernels, each paying Python and
launch cost, not by the GPU's work; a captured graph replays them all at once. Capture records
kernels with their arguments and addresses, so everything about a step is fixed per size: its
inputs live in DecodePadding's buffers, and the attention's launch grid and split-KV segment
count depend on the size alone (the segments are chosen for the longest context the engine
allows; on shorter ones the spare segments see no keys and the merge gives them no weight).
Nothing in the captured step may read a device value on the host.

Only decode-only steps are captured; mixed prefill/decode steps run as before (compiled or eager).
A setting that cannot be captured runs uncaptured and says why once at start-up; a capture that
fails does the same, and the engine keeps running.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from paged_backend.kernels.dispatch import select_backend, triton_modules
from paged_backend.model.compiled.decode_padding import DecodePadding
from paged_backend.model.step_inputs import StepInputs


def refusal(device: torch.device, dtype: torch.dtype, head_dim: int, tensor_parallel: bool,
            lora: bool) -> str | None:
    """Why decode steps of this engine cannot be captured, or None when they can."""
    if device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if tensor_parallel:
        return "tensor parallelism is not captured (its collectives are inside the forward)"
    if lora:
        return "LoRA steps are not captured (their adapter segments are Python in the layers' hooks)"
    if select_backend(device, dtype, head_dim) != "triton":
        return (f"attention with head size {head_dim} in {dtype} runs through PyTorch, which reads the "
                "step's lengths on the host")
    return None


def segments_per_size(sizes: list[int], num_kv_heads: int, max_model_len: int,
                      device: torch.device) -> dict[int, int]:
    """The split-KV segment count each captured size launches with, whatever the step's context."""
    attention = triton_modules()[0]
    return {size: attention.decode_segments(size, num_kv_heads, max_model_len, device) for size in sizes}


class DecodeGraphs:
    def __init__(self, padding: DecodePadding, run_step: Callable[[StepInputs], torch.Tensor]) -> None:
        self.padding = padding
        self.run_step = run_step  # ModelRunner.run_in_context: the (compiled) forward inside its step context
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def capture(self) -> float:
        """Capture one graph per size, largest first (the smaller ones reuse its memory pool); return
        the seconds it took."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in sorted(self.padding.sizes, reverse=True):
                self.graphs[size] = self.capture_size(size, pool)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def capture_size(self, size: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        inputs = self.padding.padding_only(size)
        # One run outside capture first, on a side stream as torch asks: Triton compiles this size's
        # kernels and the math libraries pick their algorithms there, not inside the graph.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.run_step(inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self.run_step(inputs)
        return graph, logits

    def replay(self, inputs: StepInputs) -> torch.Tensor | None:
        """The logits of padded step `inputs` (already in the buffers) from its size's graph, or None
        when that size was not captured."""
        entry = self.graphs.get(inputs.input_ids.shape[1])
        if entry is None:
            return None
        graph, logits = entry
        graph.replay()
        return logits
