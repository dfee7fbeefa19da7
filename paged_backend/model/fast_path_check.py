"""Checking a compiled forward against the eager one before the engine serves with it.

The load-time self-check (model_check.py) compares the eager paged forward with the model's own dense forward.
A compiled forward is another program: inductor's fusions and kernels, the one-token step's attention traced into
the graph (torch_single_row.py), the int4 layers' dense branch for large steps. So once it is compiled (or loaded
from the compile cache), the engine runs one probe through it and through the eager forward, on the engine's own
cache and the model's own weights, and compares the logits within the dtype's bound (model_check.TOLERANCE). The
probe's steps reach every graph the compiled forward has: a prefill of two sequences large enough for the int4
layers' dense branch, a chunk beside a decode token and two one-token steps. A compiled
forward that fails is dropped: the engine runs eagerly and says so once, naming the size of the difference.

The probe's K/V land in the first blocks, as the compile's warm-up steps do: no request has run yet, and every
later owner of a block writes it before reading it.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from paged_backend.model import compilation, int4_linear
from paged_backend.model.model_check import TOLERANCE, computing_dtype, step_inputs
from paged_backend.model.model_runner import ModelRunner, StepInputs


@dataclass(frozen=True, slots=True)
class FastPathCheck:
    """One fast variant's probe: the largest |fast - eager| logit, the bound it is held to, how long it took."""

    variant: str
    worst: float
    allowed: float
    seconds: float

    @property
    def passed(self) -> bool:
        return self.worst <= self.allowed  # False for NaN too

    def stats(self) -> dict[str, float]:
        """The check in `Engine.stats()` form."""
        return {f"{self.variant}_check_passed": float(self.passed), f"{self.variant}_check_max_logit_diff": self.worst,
                f"{self.variant}_check_tolerance": self.allowed, f"{self.variant}_check_s": self.seconds}


def check_compiled(runner: ModelRunner) -> FastPathCheck:
    """Run the probe through `runner`'s compiled forward, then eagerly, and compare their logits (the runner is
    left compiled; the caller decides)."""
    start = time.perf_counter()
    compiled = runner.forward_model
    with torch.inference_mode():  # inputs made outside it would fail the graphs' guards, as a step's never do
        steps = probe_steps(runner)
        fast = torch.cat([runner.forward(inputs) for inputs in steps])
        runner.forward_model = partial(compilation.logits_of, runner.model)
        try:
            eager = torch.cat([runner.forward(inputs) for inputs in steps])
        finally:
            runner.forward_model = compiled
    worst = (fast.float() - eager.float()).abs().max().item()
    precision = computing_dtype(runner.model, next(runner.model.parameters()).dtype)
    allowed = TOLERANCE.get(precision, 6e-2) * max(1.0, eager.float().abs().max().item())
    return FastPathCheck("compiled", worst, allowed, time.perf_counter() - start)


def probe_schedule(int4_rows: int | None) -> tuple[tuple[int, int], tuple[tuple[tuple[int, int], ...], ...]]:
    """(the two sequences' lengths, the steps: `(start, end)` of each sequence that takes part, in order). The
    first step has more tokens than the int4 layers' dense threshold (`int4_rows`), so it runs their large-step
    graph; the second (a chunk and a decode token) the general one; the last two, one token each, the one-token
    graph, the second reading what the first wrote."""
    first = max(5, (int4_rows or 0) + 6)
    steps = (((0, first), (0, 3)), ((first, first + 2), (3, 4)), ((first + 2, first + 3),), ((first + 3, first + 4),))
    return (first + 4, 4), steps


def probe_steps(runner: ModelRunner) -> list[StepInputs]:
    """The probe's packed steps over the runner's cache: random tokens (seeded), each sequence in the next blocks
    from the cache's first, in the form the engine's own steps take."""
    cache, device = runner.cache, runner.device
    lengths, steps = probe_schedule(int4_linear.most_int4_rows(runner.model))
    per_seq = [-(-n // cache.block_size) for n in lengths]
    # A cache smaller than the probe is reused from its start: both runs then overwrite the same slots in the same
    # order, so they still compute the same thing. Never the null block (a window group's freed entries).
    blocks = itertools.cycle(range(cache.null_block if cache.null_block is not None else
                                   cache.kv.shape[3] // cache.block_size))
    tables = tuple(tuple(next(blocks) for _ in range(n)) for n in per_seq)
    vocab = runner.model.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (n,), generator=generator).to(device) for n in lengths]
    return [with_step_extras(runner, step_inputs(step, seqs, device, tables=tables, block_size=cache.block_size))
            for step in steps]


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
