"""Checking a compiled forward against the eager one before the engine serves with it.

The load-time self-check (model_check.py) compares the eager paged forward with the model's own dense forward.
A compiled forward is another program: inductor's fusions and kernels, the one-token step's attention traced into
the graph (torch_single_row.py), the int4 layers' dense branch for large steps. So once it is compiled (or loaded
from the compile cache), the engine runs one probe through it and through the eager forward, on the engine's own
cache and the model's own weights, and compares their next-token distributions within the dtype's bound
(KL_BOUND). The probe's steps reach every graph the compiled forward has: a prefill of two sequences large enough
for the int4 layers' dense branch, a chunk beside a decode token and two one-token steps. A compiled forward that
fails is dropped: the engine runs eagerly and says so once, naming the size of the difference.

The probe's K/V land in the first blocks, as the compile's warm-up steps do, and are zeroed after it: no request
has run yet, and every later owner of a block writes it before reading it.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from paged_backend.model.compiled import compilation

from paged_backend.model.quantized import int4_linear
from paged_backend.model.loading.model_check import computing_dtype, step_inputs
from paged_backend.model.model_runner import ModelRunner
from paged_backend.model.step_inputs import StepInputs


# The most KL divergence (nats) of the fast path's next-token distribution from the eager one, on any probe row.
# Two right paths differ by their sums' order and roundings: in fp32 by far less than 1e-6; in bf16 on the
# default model (int4, 30 layers) compiled and eager measured 0.13 at most (argmax equal on every row), which
# scaling the embeddings by 1.02 for the compiled run alone only doubled. A wrong step (a cache write lost, a
# layer off) moves whole distributions: 1.5 for embeddings scaled by 1.2, more for a lost write.
KL_BOUND: dict[torch.dtype, float] = {torch.float32: 1e-4, torch.float16: 0.1, torch.bfloat16: 0.5}


@dataclass(frozen=True, slots=True)
class FastPathCheck:
    """One fast variant's probe: the largest KL divergence of its next-token distribution from the eager one over
    the probe's rows, the bound it is held to (KL_BOUND), how long the check took."""

    variant: str
    worst: float
    allowed: float
    seconds: float

    @property
    def passed(self) -> bool:
        return self.worst <= self.allowed  # False for NaN too

    def stats(self) -> dict[str, float]:
        """The check in `Engine.stats()` form."""
        return {f"{self.variant}_check_passed": float(self.passed), f"{self.variant}_check_max_kl": self.worst,
                f"{self.variant}_check_kl_bound": self.allowed, f"{self.variant}_check_s": self.seconds}


def check_compiled(runner: ModelRunner) -> FastPathCheck:
    """Run the probe through `runner`'s compiled forward, then eagerly, and compare their next-token distributions
    (the runner is left compiled; the caller decides). The probe's blocks are zeroed before each run, so a step that
    failed to write its K/V cannot read what an earlier run left there."""
    start = time.perf_counter()
    compiled = runner.forward_model
    with torch.inference_mode():  # inputs made outside it would fail the graphs' guards, as a step's never do
        steps, blocks = probe_steps(runner)
        clear_blocks(runner, blocks)
        fast = torch.cat([runner.forward(inputs) for inputs in steps])
        runner.forward_model = partial(compilation.logits_of, runner.model)
        try:
            clear_blocks(runner, blocks)
            eager = torch.cat([runner.forward(inputs) for inputs in steps])
        finally:
            runner.forward_model = compiled
            clear_blocks(runner, blocks)
    worst = largest_kl(eager, fast)
    precision = computing_dtype(runner.model, next(runner.model.parameters()).dtype)
    return FastPathCheck("compiled", worst, KL_BOUND.get(precision, KL_BOUND[torch.bfloat16]),
                         time.perf_counter() - start)


def largest_kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """The largest KL(reference || other) of the rows' softmax distributions, in nats (NaN if either has one)."""
    ref, oth = reference.float().log_softmax(-1), other.float().log_softmax(-1)
    return (ref.exp() * (ref - oth)).sum(-1).max().item()


def clear_blocks(runner: ModelRunner, blocks: int) -> None:
    """Zero the first `blocks` blocks of every layer's K and V (the probe's)."""
    runner.cache.kv[:, :, :, : blocks * runner.cache.block_size].zero_()


def probe_schedule(int4_rows: int | None) -> tuple[tuple[int, int], tuple[tuple[tuple[int, int], ...], ...]]:
    """(the two sequences' lengths, the steps: `(start, end)` of each sequence that takes part, in order). The
    first step has more tokens than the int4 layers' dense threshold (`int4_rows`), so it runs their large-step
    graph; the second (a chunk and a decode token) the general one; the last two, one token each, the one-token
    graph, the second reading what the first wrote."""
    first = max(5, (int4_rows or 0) + 6)
    steps = (((0, first), (0, 3)), ((first, first + 2), (3, 4)), ((first + 2, first + 3),), ((first + 3, first + 4),))
    return (first + 4, 4), steps


def probe_steps(runner: ModelRunner) -> tuple[list[StepInputs], int]:
    """The probe's packed steps over the runner's cache, and how many of its first blocks they use: random tokens
    (seeded), each sequence in the next blocks from the cache's first, in the form the engine's own steps take."""
    cache, device = runner.cache, runner.device
    lengths, steps = probe_schedule(int4_linear.most_int4_rows(runner.model))
    per_seq = [-(-n // cache.block_size) for n in lengths]
    # A cache smaller than the probe is reused from its start: both runs then overwrite the same slots in the same
    # order, so they still compute the same thing. Never the null block (a window group's freed entries).
    available = cache.null_block if cache.null_block is not None else cache.kv.shape[3] // cache.block_size
    blocks = itertools.cycle(range(available))
    tables = tuple(tuple(next(blocks) for _ in range(n)) for n in per_seq)
    vocab = runner.model.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (n,), generator=generator).to(device) for n in lengths]
    return [with_step_extras(runner, step_inputs(step, seqs, device, tables=tables, block_size=cache.block_size))
            for step in steps], min(sum(per_seq), available)


def with_step_extras(runner: ModelRunner, inputs: StepInputs) -> StepInputs:
    """What a served step of this runner carries: the logits of each sequence's last token, every layer group's
    metadata (here the one table, as the compile's warm-up gives them) and, with LoRA slots, the base model's
    adapter segments."""
    groups = runner.cache.groups if runner.cache.grouped else None
    group_metadata = (inputs.metadata,) * groups.num_groups if groups is not None else None
    step = None
    if runner.lora_slots is not None:
        tokens = inputs.input_ids.shape[-1]
        step = runner.lora_slots.prepare_step(np.zeros(1, dtype=np.int64), np.array([tokens]), runner.device)
    last_rows = inputs.metadata.query_start_loc[1:].long() - 1  # one sampled row per sequence, as served steps keep
    return inputs._replace(logits_indices=last_rows, group_metadata=group_metadata, lora=step)
