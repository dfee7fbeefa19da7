"""Linear layers of small CPU steps computed as `weight @ x^T`.

A decode step on one stream, or one carrying a few speculative proposals, multiplies 2-5 rows by every
weight matrix. On CPU (MKL, fp32), `x @ weight^T` at a few rows costs well over a single row, while the
same product taken as `weight @ x^T` (the transposed problem) costs about as much as one, since the weight
is then streamed once as in a matrix-vector product. The default model's bare forward and n-gram
speculation on one stream both gained from it at 2-5 tokens; at 1 token the two ways are equal, so it is
left alone, and at 8 the plain product was ahead again (docs/speculative-decoding.md has the
measurements). Outside 2-5 rows, on other devices and dtypes, and for weights that are not plain tensors
(a quantized tensor subclass), `F.linear` runs as usual.

The switch is a torch function mode, entered only around the forward of a step of 2-5 tokens, so the
model itself is not modified and nothing else in the process sees it (modes are per thread).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

MIN_ROWS, MAX_ROWS = 2, 5
PLAIN = (torch.Tensor, torch.nn.Parameter)


class SmallStepLinear(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if eligible(x, weight, bias):
                return linear_transposed(x, weight, bias)
        return func(*args, **kwargs)


def eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (x.dtype == torch.float32 and x.device.type == "cpu" and type(weight) in PLAIN
            and weight.dtype == torch.float32 and weight.dim() == 2 and (bias is None or type(bias) in PLAIN)
            and MIN_ROWS <= x.numel() // max(x.shape[-1], 1) <= MAX_ROWS)


def linear_transposed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` as `(weight @ x^T)^T`, contiguous like F.linear's result."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.mm(weight, rows.t()).t().contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


@contextlib.contextmanager
def small_step_linear(num_tokens: int, device: torch.device) -> Iterator[None]:
    """Inside: the linears of a CPU step of 2-5 tokens run transposed; any other step runs untouched."""
    if device.type != "cpu" or not MIN_ROWS <= num_tokens <= MAX_ROWS:
        yield
        return
    with SmallStepLinear():
        yield
