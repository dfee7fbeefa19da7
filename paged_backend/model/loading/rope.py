"""What a model config says of its rotary embedding, where the engine's choices depend on it: a dynamic rope
(transformers recomputes its frequencies from the largest position of each forward) caps the context and runs
eagerly (model_check.dynamic_rope_limit, compilation.model_eager_reason)."""

from __future__ import annotations


def rope_types(text_config) -> set[str]:
    """The rope types of a config: one, or one per layer type where rope_parameters is keyed by layer type."""
    rope = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    kinds = [rope] if "rope_type" in rope or "type" in rope else [v for v in rope.values() if isinstance(v, dict)]
    return {str(kind.get("rope_type", kind.get("type"))) for kind in kinds}


def has_dynamic_rope(text_config) -> bool:
    """Whether a rope of the config is dynamic ("dynamic", or a dynamic variant such as "dynamic_yarn")."""
    return any("dynamic" in kind for kind in rope_types(text_config))
