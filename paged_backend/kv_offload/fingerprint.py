"""The fingerprint of what a model's K/V depend on, besides the tokens: a stored block is used only under the same one.

It digests the model's weights (every parameter and buffer, quantized codes included, as the engine runs them),
its config, the dtype it computes in, the K/V layout (what each layer keeps, the KV dtype, block size, how layers
are grouped on pages) and the project's version. Two processes that load the same checkpoint with the same settings
get the same fingerprint and can share a folder of stored blocks; any difference (a fine-tuned copy, another
quantization, int8 KV, another block size, a new release) gives another one.

Hashing the weights reads them once at start-up (1.6 s for the default model's 746 MB of parameters and buffers
as the engine holds them, on a 2-core AVX2 EPYC): only engines with a second tier pay it.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata

import torch
from torch import nn

from paged_backend.core.kv_cache_groups import CacheGroups
from paged_backend.model.paged.paged_cache import KVShape


def project_version() -> str:
    try:
        return metadata.version("paged-backend")
    except metadata.PackageNotFoundError:
        return "unknown"


def weights_digest(model: nn.Module) -> str:
    """A digest of every parameter and buffer: names, dtypes, shapes and bytes."""
    h = hashlib.blake2b(digest_size=16)
    seen: set[int] = set()
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in tensors:
        if tensor is None:
            continue
        h.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        if tensor.data_ptr() in seen and tensor.is_contiguous():  # a tied or stacked tensor: its bytes once
            continue
        seen.add(tensor.data_ptr())
        data = tensor.detach().to("cpu").contiguous()
        h.update(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def model_fingerprint(model: nn.Module, shape: KVShape, groups: CacheGroups, kv_dtype: torch.dtype,
                      block_size: int) -> str:
    """The hex fingerprint of the model and K/V layout whose blocks may be stored and restored together."""
    model_dtype = next(model.parameters()).dtype
    facts = {
        "version": project_version(),
        "config": model.config.to_json_string(use_diff=False),
        "modules": sorted({type(m).__name__ for m in model.modules()}),  # which kernels run it (int4, int8, ...)
        "dtype": str(model_dtype),
        "kv_dtype": str(kv_dtype),
        "block_size": block_size,
        "kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "layers": [repr(spec) for spec in shape.layers],
        "groups": [groups.group_size, list(groups.layer_group), list(groups.layer_position)],
        "weights": weights_digest(model),
    }
    return hashlib.blake2b(json.dumps(facts, sort_keys=True).encode(), digest_size=16).hexdigest()
