"""DeepSeek-V3's multi-head latent attention (MLA), paged as its compressed latent, in the absorbed form.

Per token a layer caches one row: the normalised compressed latent (kv_lora_rank values) and the roped key
part shared by every head (qk_rope_head_dim), `kv_lora_rank + qk_rope_head_dim` values in all, where
expanded K/V would take `num_heads * (qk_head_dim + v_head_dim)`. transformers expands the cached latents
through `kv_b_proj` into every head's K and V at each step; here the expansion is folded into the query and
the output instead (as vLLM's MLA backends do). `kv_b_proj`'s weight is per head `[W_UK; W_UV]`
(`[qk_nope_head_dim + v_head_dim, kv_lora_rank]`), so a head's score over a cached token is

    q_nope . (W_UK c) + q_rope . k_rope = (W_UK^T q_nope) . c + q_rope . k_rope

and its output `W_UV (sum_j w_j c_j)`: each head attends with the query `[W_UK^T q_nope, q_rope]` over the
latent rows `[c, k_rope]` as one shared key head (multi-query attention of head size kv_lora_rank +
qk_rope_head_dim), its output's first kv_lora_rank columns taken back through `W_UV`. The scale is the
module's own (`1 / sqrt(qk_head_dim)`, times YaRN's mscale squared where the config sets mscale_all_dim), the
rotary embedding the model's own (interleaved or not, as `config.rope_interleave` says).

The sums run in another order than transformers' expanded form, so logits differ by rounding only. The
absorbed form reads `kv_b_proj`'s weight rather than calling the module, so that projection must be a plain
linear with no LoRA on it: `prepare` refuses other kinds, and LoRA adapters may not target it
(`absorbed_linears`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
)

from paged_backend.errors import UnsupportedArchitectureError
from paged_backend.kernels.layer_attention import LayerAttention
from paged_backend.kernels.torch_attention import attend_one
from paged_backend.model.adapters.registry import Adapter, register_adapter
from paged_backend.model.paged.latent_cache import latent_attention
from paged_backend.model.compiled.layer_regions import traced_layer
from paged_backend.model.paged.paged_cache import PackedStepCache, PagedCache, ShapeProbe


def prepare(module: DeepseekV3Attention, config) -> None:
    projection = module.kv_b_proj
    if type(projection) is not nn.Linear or type(projection.weight) is not nn.Parameter or projection.bias is not None:
        kind = type(projection).__name__ if type(projection) is not nn.Linear else (
            f"Linear with a {type(projection.weight).__name__} weight" if projection.bias is None
            else "Linear with a bias")
        raise UnsupportedArchitectureError(
            f"{getattr(config, 'model_type', 'deepseek_v3')}: {type(module).__name__} layer {module.layer_idx} has "
            f"a {kind} as kv_b_proj; its paged "
            "latent attention multiplies by that projection's weight itself (absorbed into the query and output), "
            "which needs a plain nn.Linear without bias (no quantized or PEFT layer there)")
    projection._paged_absorbed = True  # read by lora.adaptable_linears: an adapter there would be ignored


def absorbed_weights(module: DeepseekV3Attention) -> tuple[torch.Tensor, torch.Tensor]:
    """`W_UK [H, qk_nope_head_dim, kv_lora_rank]` and `W_UV [H, v_head_dim, kv_lora_rank]`, views of kv_b_proj's
    weight (its heads counted from the weight, not the config, so a sharded projection gives its own heads)."""
    weight = module.kv_b_proj.weight
    per_head = weight.view(-1, module.qk_nope_head_dim + module.v_head_dim, module.kv_lora_rank)
    return per_head[:, : module.qk_nope_head_dim], per_head[:, module.qk_nope_head_dim:]


def project_query(module: DeepseekV3Attention, x: torch.Tensor) -> torch.Tensor:
    """The step's queries `[T, H, qk_head_dim]`, through the low-rank path when the config has one."""
    if module.q_lora_rank is None:
        q = module.q_proj(x)
    else:
        q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(x)))
    return q.view(x.shape[0], -1, module.qk_head_dim)


def rotate(module: DeepseekV3Attention, q_rope: torch.Tensor, k_rope: torch.Tensor,
           position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own rotary embedding of `q_rope [T, H, P]` and `k_rope [T, 1, P]`."""
    cos, sin = position_embeddings
    rotary = apply_rotary_pos_emb_interleave if module.config.rope_interleave else apply_rotary_pos_emb
    return rotary(q_rope, k_rope, cos[0], sin[0], unsqueeze_dim=1)


def paged_forward(module: DeepseekV3Attention, cache: PackedStepCache, hidden_states: torch.Tensor, *args,
                  position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                  paged_single_row: object = None, **kwargs) -> tuple[torch.Tensor, None]:
    # `paged_single_row` (a compiled CPU one-token step's traced attention, torch_single_row.py) reads a K/V
    # cache: a latent layer leaves it unused, its one-token steps calling the latent op like every other step.
    return latent_forward(module, cache, hidden_states, position_embeddings, rotate)


def latent_forward(module: nn.Module, cache: PackedStepCache, hidden_states: torch.Tensor,
                   position_embeddings: tuple[torch.Tensor, torch.Tensor], rotation) -> tuple[torch.Tensor, None]:
    """The absorbed latent attention of an MLA module (DeepSeek-V3's, or another family's with the same
    projections), `rotation(module, q_rope, k_rope, position_embeddings)` being that family's rotary embedding."""
    x = hidden_states[0]
    tokens, rank = x.shape[0], module.kv_lora_rank
    q_nope, q_rope = project_query(module, x).split([module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)
    compressed, k_rope = module.kv_a_proj_with_mqa(x).split([rank, module.qk_rope_head_dim], dim=-1)
    q_rope, k_rope = rotation(module, q_rope, k_rope[:, None], position_embeddings)
    latent = torch.cat([module.kv_a_layernorm(compressed)[:, None], k_rope], dim=-1)  # [T, 1, rank + P]
    w_uk, w_uv = absorbed_weights(module)
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, rank]
    query = torch.cat([q_latent, q_rope], dim=-1)
    out = attend_latent(module, cache, query, latent)[..., :rank]  # [T, H, rank]: the value columns
    out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v_head_dim]
    return module.o_proj(out.reshape(1, tokens, -1)), None


def attend_latent(module: DeepseekV3Attention, cache: PackedStepCache, query: torch.Tensor,
                  latent: torch.Tensor) -> torch.Tensor:
    """Write the step's `latent [T, 1, D]` and attend `query [T, H, D]` over each sequence's latents; `[T, H, D]`."""
    if isinstance(cache, PagedCache):
        return latent_attention(query, latent, traced_layer(module))
    if not isinstance(cache, ShapeProbe):
        raise TypeError(f"deepseek_v3's paged attention got a {type(cache).__name__}, not the engine's cache")
    # The engine's start-up probe: it learns the latent's width and that this layer caches a latent.
    row = latent.transpose(0, 1)[None]
    cache.update(row, row, module.layer_idx)
    layer = LayerAttention(module.scaling)
    cache.reached(module.layer_idx, "adapter", layer)
    cache.stores_latent(module.layer_idx, module.kv_lora_rank)
    out = attend_one(query.transpose(0, 1), latent.transpose(0, 1), latent.transpose(0, 1), layer)
    return out.transpose(0, 1)


ADAPTER = register_adapter(Adapter("deepseek_v3", (DeepseekV3Attention,), paged_forward, "cache", prepare))
