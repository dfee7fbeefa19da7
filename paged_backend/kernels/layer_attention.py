"""LayerAttention: what one attention layer computes besides its inputs, fixed for the model's life.

A layer's scale, sliding window, logit soft-cap, ALiBi slopes, attention sinks and chunk do not change from
one step to the next, so they are recorded once, when the engine's start-up probe runs every layer
(paged_cache.ShapeProbe), and handed to the kernels as one record instead of as a dozen arguments on every
call. Only the kernels read its fields; the model's side finds a layer's record by its index (the step
context's table, step_context.py), which is all a torch custom op can carry.

The tensors it holds (the sinks and slopes) are the model's own, on its device: a change to them in place
(a new checkpoint loaded into the model) reaches the kernels as it reaches the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


# eq=False: records hold tensors, which do not compare to one bool; a record is the same record by identity.
@dataclass(frozen=True, slots=True, eq=False)
class LayerAttention:
    scale: float  # multiplies each query-key dot product
    window: int | None = None  # a query sees only the last `window` positions, itself included (None: all)
    softcap: float | None = None  # logits become `softcap * tanh(logit / softcap)` (Gemma 2)
    chunk: int | None = None  # a query sees keys only from `position - position % chunk` on (Llama 4)
    alibi_slopes: torch.Tensor | None = None  # [H] fp32: `slope * (key position - query position)` joins the logits
    sinks: torch.Tensor | None = None  # [H]: a logit per head that joins each row's softmax with no value (gpt-oss)
    # Every query row attends through the CPU kernel's one order of sums, whatever its step (batch_invariant.py).
    batch_invariant: bool = False

    @property
    def masks_only(self) -> bool:
        """Whether the layer is plain softmax attention under a mask (causal, window, chunk): nothing it asks for
        changes the scores or the softmax themselves, so SDPA and batched matmuls over padded buckets serve it."""
        return self.softcap is None and self.alibi_slopes is None and self.sinks is None

    def hides_keys(self, seq_len: int) -> bool:
        """Whether the window or the chunk hides some earlier key from some query of a sequence of `seq_len`
        positions: if not, its attention is plain causal."""
        return ((self.window is not None and seq_len > self.window)
                or (self.chunk is not None and seq_len > self.chunk))
