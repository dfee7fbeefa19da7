"""Every causal-LM type transformers ships (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), a tiny random model each, in
its plain form and, where its config has a sliding window, windowed (small mixtures of experts wherever the
config takes them): an accepted type gives HF generate's tokens in test_engine_equivalence.py's mixed batch
(chunked prefill, late arrivals, preemption) or is refused by the load-time self-check, never wrong and never a
crash; a refused type is refused with UnsupportedArchitectureError, its model left as it came.

The tiny config is generic (one set of small sizes, whatever names the type reads them under), so some types do
not build from it, or their own forward fails on it; those variants are skipped here (their tuned tiny models
in helpers/models.py are what the fast tier runs). Slow tier: about two hundred types, a few minutes."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from helpers.engine import MAX_NEW, check_engine, hf_case, one_thread  # noqa: F401  (autouse fixture)
from helpers.models import VOCAB, build_from_config
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from paged_backend import Engine, EngineConfig
from paged_backend.errors import UnsupportedArchitectureError
from paged_backend.model.loading.model_loader import SUPPORTED, check_architecture

pytestmark = pytest.mark.slow

# Small sizes under every name the causal-LM configs of transformers 5.25 read them (a config keeps what it
# does not read as a plain attribute, unused). A Mamba-2 mixer's reference scan (no mamba_ssm on a CPU) works in
# squares of its chunk: at the default 256 one tiny Falcon-H1 took two minutes, and 8 also scans several chunks.
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, head_dim=16, pad_token_id=0, bos_token_id=1,
             eos_token_id=2, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=32, shared_expert_intermediate_size=32, expert_intermediate_size=32,
             n_positions=512, n_embd=64, n_layer=2, n_head=4, d_model=64, ffn_dim=128, n_inner=128, num_layers=2,
             num_heads=4, max_seq_len=512, mamba_chunk_size=8)
# A window shorter than most of the mixed prompts: layer 0 slides, layer 1 attends to everything.
WINDOW = dict(sliding_window=8, use_sliding_window=True, max_window_layers=1)
# A type whose config ignores the sizes above builds at its real size: not tiny, skipped.
MAX_PARAMS = 10_000_000


def tiny_config(model_type: str, window: bool) -> tf.PretrainedConfig | None:
    """The generic tiny config of `model_type`, windowed where asked and the type has a window; None when the
    type has no window (for `window`) or does not build from these sizes."""
    try:
        default = tf.AutoConfig.for_model(model_type)
        text = default.get_text_config()
    except Exception:  # its defaults fail transformers' own validation, or it has several text models
        return None
    if window and not hasattr(text, "sliding_window"):
        return None
    extra = dict(WINDOW) if window else {}
    if window and any("sliding" in kind for kind in getattr(text, "layer_types", None) or ()):
        extra["layer_types"] = ["sliding_attention", "full_attention"]
    try:
        if text is not default:  # a composite config: the sizes go to its text model
            return tf.AutoConfig.for_model(model_type, text_config={**SIZES, **extra}, pad_token_id=0,
                                           bos_token_id=1, eos_token_id=2)
        return tf.AutoConfig.for_model(model_type, **SIZES, **extra)
    except Exception:
        return None


def tiny_case(model_type: str, window: bool):
    """(model, prompts, HF generate's answers) for the tiny model of `model_type`, or None when there is none:
    the config does not build, is not tiny, or transformers' own generate fails on it."""
    config = tiny_config(model_type, window)
    if config is None:
        return None
    try:
        with torch.device("meta"):
            size = sum(p.numel() for p in tf.AutoModelForCausalLM.from_config(config).parameters())
        if size > MAX_PARAMS:
            return None
        model = build_from_config(lambda: config)
        _, model, prompts, refs = hf_case(model_type, model, MAX_NEW)
    except Exception:
        return None
    return model, prompts, refs


@pytest.mark.parametrize("model_type", sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
def test_every_causal_lm_type_is_right_or_refused(model_type):
    """What counts is the type the engine checks: the config's, and the loaded model's (GPT-SW3's config is a
    GPT-2 one, a Llama 4 config loads a Llama 4 text model)."""
    config = tiny_config(model_type, window=False)
    if config is not None and config.model_type not in SUPPORTED:
        with pytest.raises(UnsupportedArchitectureError, match=f"model_type={config.model_type!r}"):
            check_architecture(config)
    for window in (False, True):
        case = tiny_case(model_type, window)
        if case is None:
            continue
        model, prompts, refs = case
        attention = model.config._attn_implementation
        if model.config.model_type not in SUPPORTED:
            with pytest.raises(UnsupportedArchitectureError):
                Engine(model, None, EngineConfig(num_kv_blocks=20, block_size=4))
            assert model.config._attn_implementation == attention  # left as it came
            continue
        try:
            engine = check_engine(model, prompts, refs, EngineConfig(num_kv_blocks=20, block_size=4,
                                                                     max_num_batched_tokens=24), late_from=5)
        except UnsupportedArchitectureError:  # refused by the load-time self-check, with its reason: not wrong
            assert model.config._attn_implementation == attention
            continue
        except AssertionError as wrong:
            pytest.fail(f"{model_type} (window={window}) differs from HF generate: {wrong}")
        assert engine.scheduler.num_preemptions >= 1, f"window={window}"
