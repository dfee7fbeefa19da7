"""Import this before any Triton kernel module in a test: without CUDA it switches Triton to its
interpreter. Triton reads TRITON_INTERPRET when each @triton.jit decorator runs: for its own helpers
(tl.max, tl.sum, tl.cdiv) when triton.language is imported, for ours when a kernel module is. So it is
set before either, and whatever an earlier test imported in compiled mode is re-imported to see it."""

from __future__ import annotations

import importlib
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton.language" in sys.modules:
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(sys.modules["triton.language"].standard.max, InterpretedFunction):
            importlib.reload(sys.modules["triton.language.standard"])
            importlib.reload(sys.modules["triton.language"])
    for name in ("paged_backend.kernels.triton_attention", "paged_backend.kernels.triton_cache_write"):
        if name in sys.modules:
            importlib.reload(sys.modules[name])
