"""Batch-invariant steps (`EngineConfig(batch_invariant=True)`): a request's logits, and so its tokens and
logprobs, do not depend on what else runs in its steps, how its prompt was chunked, or whether its prefix came
from the cache. An RL trainer needs this to compare a rollout's logprobs with its own forward's: in the default
mode they move with the batch by a few units in the last place (fp32), as every batching engine's do.

Two parts of a step sum in an order its shape chooses, and this mode fixes both:

- Matmuls. A CPU GEMM picks its kernel by the number of rows: measured on the AVX2 EPYC, fp32 `F.linear` gives
  the same rows for 4, 8 and any 12 or more rows, while 1 (a matrix-vector product), 2, 3, 5-7 and 9-11 rows sum
  in other orders. Inside a batch-invariant step every `F.linear` of fewer than `min_rows` rows is padded with
  zero rows to `min_rows` (a torch function mode, like small_step_linear.py, so the model itself is not changed
  and PEFT's layers, added later, are covered too). `choose_min_rows` finds at start-up, for each weight shape
  of the model, the smallest of MIN_ROWS_TRIED above which this CPU's kernel gives every row the same sums.
- Attention. Every query row attends through the CPU kernel (cpu_paged_attention.c), which folds a row's keys
  in chunks at fixed positions (16 keys with AVX-512, else 8; cut at block ends) in one order, whatever other rows the call holds;
  SDPA's blocked kernel and the bucketed matmuls split by the call's shape instead.

Everything else a step runs is per row already (norms, rotary, activations, the sampler). The compiled forward
(inductor picks kernels per shape) and fused projections (a trainer's forward runs them one by one) are off.
The mode is refused where these two do not cover the model's sums: on GPUs, without the compiled CPU kernel,
for weights that are not plain linear layers (int4/int8 layers, MoE experts' 3-D weights, GPT-2's Conv1D),
recurrent layers (their scans follow the chunking) and the engine's LoRA slots (masked matmuls of their own).

The cost is the padded rows of small steps (a one-stream decode multiplies `min_rows` rows) and the kernel
on long prompts, where SDPA was faster; docs/rl-trl.md has the measurement.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from paged_backend.kernels import cpu_paged_attention
from paged_backend.model.quantized.quantized_linear import QuantizedLinear

MIN_ROWS_TRIED = (16, 32, 64)  # the paddings choose_min_rows tries, smallest first
PROBE_ROWS = (1, 2, 3, 5, 7, 9, 13, 17, 33, 65, 130)  # row counts compared with a 130-row product


class PaddedRows(TorchFunctionMode):
    """`F.linear` of fewer than `min_rows` rows computed on `min_rows` rows (zeros below), its first rows kept."""

    def __init__(self, min_rows: int) -> None:
        super().__init__()
        self.min_rows = min_rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0]
            rows = x.numel() // max(x.shape[-1], 1)
            if 0 < rows < self.min_rows:
                flat = x.reshape(rows, x.shape[-1])
                padded = torch.cat([flat, flat.new_zeros(self.min_rows - rows, flat.shape[-1])])
                return func(padded, *args[1:], **kwargs)[:rows].reshape(*x.shape[:-1], -1)
        return func(*args, **kwargs)


@contextlib.contextmanager
def padded_rows(min_rows: int) -> Iterator[None]:
    """Inside: every `F.linear` has at least `min_rows` rows."""
    with PaddedRows(min_rows):
        yield


def refusal(model: nn.Module) -> str | None:
    """Why `model`'s steps cannot be made batch-invariant here, or None. Every weight of two or more dimensions
    must be a plain tensor of an `nn.Linear` (or `nn.Embedding`, which is read, not summed)."""
    param = next(model.parameters())
    if param.device.type != "cpu":
        return "it runs on CPU only (on a GPU the Triton kernels and GEMMs choose their sums by the step's shape)"
    if cpu_paged_attention.SWITCH.off or cpu_paged_attention.library() is None:
        return "it needs the compiled CPU attention kernel (kernels/cpu_paged_attention.py), which is not built here"
    for name, module in model.named_modules():
        for weight in module.parameters(recurse=False):
            if weight.dim() < 2:
                continue
            if not isinstance(module, (nn.Linear, nn.Embedding)):
                return f"{name} ({type(module).__name__}) multiplies by weights outside a linear layer"
            if type(weight) not in (torch.Tensor, nn.Parameter) or weight.dtype not in (torch.float32, torch.bfloat16,
                                                                                        torch.float16):
                return f"{name} holds {type(weight).__name__} weights of {weight.dtype} (quantized weights)"
        if isinstance(module, QuantizedLinear):
            return f"{name} is a quantized layer ({type(module).__name__}: its kernel is not padded)"
    return None


def choose_min_rows(model: nn.Module) -> int | None:
    """The smallest padding of MIN_ROWS_TRIED under which this CPU's `F.linear` gives a row the same sums at every
    row count, for every weight shape of `model`'s linear layers (probed on random inputs); None when none does."""
    shapes = {(m.in_features, m.out_features, m.weight.dtype): m.weight for m in model.modules()
              if isinstance(m, nn.Linear)}
    generator = torch.Generator().manual_seed(0)
    for min_rows in MIN_ROWS_TRIED:
        if all(rows_agree(weight, min_rows, generator) for weight in shapes.values()):
            return min_rows
    return None


def rows_agree(weight: torch.Tensor, min_rows: int, generator: torch.Generator) -> bool:
    """Whether the first rows of `F.linear` at every PROBE_ROWS count, padded to `min_rows`, equal those of one
    product of the most rows."""
    x = torch.randn(PROBE_ROWS[-1], weight.shape[1], generator=generator).to(weight.dtype)
    with torch.no_grad(), padded_rows(min_rows):
        whole = F.linear(x, weight.detach())
        return all(torch.equal(F.linear(x[:rows], weight.detach()), whole[:rows]) for rows in PROBE_ROWS[:-1])
