"""The LM head of an fp32 model kept in the 16 bits its checkpoint has (CPU).

On a CPU without native bf16 the engine computes in fp32, and a checkpoint's fp16 or bf16 weights load widened to
fp32. A one-stream decode step then reads the LM head at twice the bytes the file holds: 113 MB a step for the
default model's 49,152 x 576 head, and most of a step's reads for a GPTQ or AWQ checkpoint, whose head those tools
leave in fp16 while the layers are 4-bit (docs/precision.md). Where every value of the widened head is exactly an
fp16 (or a bf16) number, the head keeps those 16 bits (`HalfLinear`) and multiplies the rows by them through the
CPU kernel (kernels/cpu_int8_matmul.c: each weight widened in registers, fp32 sums of the rows as given), so no
number changes and a step reads half the bytes. A head tied to the input embedding takes the embedding along
(`HalfEmbedding`: the looked-up rows widened to fp32), so the fp32 copy is freed rather than kept beside the new one.

It applies to a model the engine loads itself (`LLM`, the server, the LangChain models), in fp32, on CPU, where the
kernel is built, with a plain `nn.Linear` head (the int4 path's head is int8 already) and no LoRA adapters (an adapter
may target the head). A compiled forward calls the kernel as one registered op (`paged_backend::half_matmul`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from paged_backend.kernels import cpu_int8_matmul
from paged_backend.model.quantized.quantization import replace_module
from paged_backend.model.quantized.quantized_linear import cast_to

logger = logging.getLogger(__name__)

# The 16-bit types tried, in order: fp16 first (GPTQ's, AWQ's and most fp16 checkpoints' heads), then bf16.
HALF_DTYPES = (torch.float16, torch.bfloat16)


def half_matmul(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`rows [n, in]` (fp32) times the 16-bit `weight [out, in]` transposed, as fp32 `[n, out]`: through the CPU
    kernel where it serves, else through the weight widened for the call (the kernel switched off)."""
    if cpu_int8_matmul.serves_half(rows, weight):
        return cpu_int8_matmul.half_matmul(rows, weight)
    return F.linear(rows, weight.float())


half_matmul_op = torch.library.custom_op("paged_backend::half_matmul", half_matmul, mutates_args=())


@half_matmul_op.register_fake
def _(rows, weight):
    return rows.new_empty(rows.shape[0], weight.shape[0], dtype=torch.float32)


class HalfLinear(nn.Module):
    """A linear layer `[..., in] -> [..., out]` in fp32 whose weight is kept as 16-bit floats (`weight16`)."""

    def __init__(self, weight16: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight16.shape
        self.register_buffer("weight16", weight16.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = cast_to(x.reshape(-1, self.in_features), torch.float32)
        # The registered op inside a graph being compiled; its implementation directly in an eager forward.
        matmul = half_matmul_op if torch.compiler.is_compiling() else half_matmul
        out = matmul(rows, self.weight16)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight16={self.weight16.dtype}"


class HalfEmbedding(nn.Module):
    """An `nn.Embedding` whose table is kept as 16-bit floats: the rows looked up come back in fp32."""

    def __init__(self, weight16: torch.Tensor, padding_idx: int | None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight16.shape
        self.padding_idx = padding_idx
        self.register_buffer("weight16", weight16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight16).float()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, weight16={self.weight16.dtype}"


# Rows of the head compared at a time: widening the whole 16-bit copy back at once held a third fp32-sized tensor
# at the load's peak.
CHECK_ROWS = 4096


def exact_half(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` as the first of HALF_DTYPES that holds every value exactly (and that the kernel takes), else None."""
    if cpu_int8_matmul.SWITCH.off:
        return None
    for dtype in filter(cpu_int8_matmul.takes_half, HALF_DTYPES):
        half = weight.to(dtype)
        if all(torch.equal(half[i:i + CHECK_ROWS].float(), weight[i:i + CHECK_ROWS])
               for i in range(0, weight.shape[0], CHECK_ROWS)):
            return half
    return None


def keep_head_in_half(model: nn.Module) -> str | None:
    """Replace `model`'s fp32 CPU LM head (and the input embedding tied to it) by 16-bit ones holding the same
    values, where it can (module docstring); the 16-bit dtype kept, or None where the head stays as it was."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear or head.weight.dtype != torch.float32 or head.weight.device.type != "cpu":
        return None
    if type(head.weight) not in (torch.Tensor, nn.Parameter):  # a quantized weight (torchao's int8) stays as it is
        return None
    half = exact_half(head.weight.detach())
    if half is None:
        return None
    embedding = model.get_input_embeddings()
    tied = embedding is not None and getattr(embedding, "weight", None) is head.weight
    names = {module: name for name, module in model.named_modules(remove_duplicate=False)}
    replace_module(model, names[head], HalfLinear(half, head.bias))
    # A tied embedding of its own class (a scaled one, say) keeps its fp32 table: only a plain lookup is replaced.
    if tied and type(embedding) is nn.Embedding and embedding.max_norm is None:
        replace_module(model, names[embedding], HalfEmbedding(half, embedding.padding_idx))
    logger.info("the LM head keeps its weights in %s (exact), multiplied by the CPU kernel in fp32%s", half.dtype,
                ", with the input embedding tied to it" if tied else "")
    return str(half.dtype).removeprefix("torch.")
