"""Tiny random models of every architecture the engine claims, built in-process (no downloads)."""

from __future__ import annotations

import torch
import transformers as tf

VOCAB = 256

# Each factory returns a config small enough that a forward takes milliseconds.
CONFIGS = {
    "llama": lambda: tf.LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **_common()),
    "mistral": lambda: tf.MistralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=None,
                                        **_common()),
    "qwen2": lambda: tf.Qwen2Config(num_attention_heads=4, num_key_value_heads=2, **_common()),
    "qwen3": lambda: tf.Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=16, **_common()),
    "gemma": lambda: tf.GemmaConfig(num_attention_heads=4, num_key_value_heads=1, head_dim=16, **_common()),
    "phi3": lambda: tf.Phi3Config(num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, **_common()),
    "gpt2": lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512),
    "gpt_neox": lambda: tf.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=128, rotary_pct=0.5,
                                         max_position_embeddings=512),
    "gptj": lambda: tf.GPTJConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=512),
    "gpt_bigcode": lambda: tf.GPTBigCodeConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, multi_query=True,
                                               n_positions=512),
    "opt": lambda: tf.OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                ffn_dim=128, word_embed_proj_dim=64, max_position_embeddings=512),
    # Sliding-window layer then global layer, with soft-capped attention and final logits small enough
    # to bite on these weights; the 8-token window is shorter than most prompts.
    "gemma2": lambda: tf.Gemma2Config(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                                      attn_logit_softcapping=5.0, final_logit_softcapping=10.0,
                                      query_pre_attn_scalar=16, **_common()),
    "gemma3_text": lambda: tf.Gemma3TextConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                               sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                               attn_logit_softcapping=5.0, final_logit_softcapping=10.0,
                                               query_pre_attn_scalar=16, **_common()),
    # LongRoPE: runs with its short factors, the engine's context capped at the original length.
    "phi3_longrope": lambda: tf.Phi3Config(num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                                           original_max_position_embeddings=64, rope_scaling=dict(
                                               rope_type="longrope", short_factor=[1.0 + i / 8 for i in range(8)],
                                               long_factor=[2.0 + i for i in range(8)]), **_common()),
    "mixtral": lambda: tf.MixtralConfig(num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, **_common()),
    "qwen2_moe": lambda: tf.Qwen2MoeConfig(num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=32, **_common()),
    # Its window lives only in the mask: the attention call carries no `sliding_window=` (layer 0 slides, window 8).
    "qwen2_moe_window": lambda: tf.Qwen2MoeConfig(num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                                  num_experts_per_tok=2, moe_intermediate_size=32,
                                                  shared_expert_intermediate_size=32, use_sliding_window=True,
                                                  sliding_window=8, max_window_layers=2, **_common()),
    # Dynamic NTK rope: exact within max_position_embeddings, where its frequencies are the default ones.
    "llama_dynamic_rope": lambda: tf.LlamaConfig(num_attention_heads=4, num_key_value_heads=2,
                                                 rope_parameters=dict(rope_type="dynamic", factor=2.0,
                                                                      rope_theta=10000.0), **_common()),
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=32, **_common()),
    "granite": lambda: tf.GraniteConfig(num_attention_heads=4, num_key_value_heads=2, attention_multiplier=0.2,
                                        residual_multiplier=0.5, embedding_multiplier=2.0, logits_scaling=2.0,
                                        **_common()),
    "olmo": lambda: tf.OlmoConfig(num_attention_heads=4, num_key_value_heads=2, clip_qkv=2.0, **_common()),
    "olmo2": lambda: tf.Olmo2Config(num_attention_heads=4, num_key_value_heads=2, **_common()),
    "starcoder2": lambda: tf.Starcoder2Config(num_attention_heads=4, num_key_value_heads=2, sliding_window=None,
                                              **_common()),
    "phi": lambda: tf.PhiConfig(num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.5, **_common()),
    "cohere": lambda: tf.CohereConfig(num_attention_heads=4, num_key_value_heads=2, use_qk_norm=False, **_common()),
    # Every fourth layer of SmolLM3 has no rotary embedding (NoPE): layer 1 here.
    "smollm3": lambda: _auto("smollm3", num_attention_heads=4, num_key_value_heads=2, no_rope_layers=[1, 0]),
    # Attention sinks (a learned logit per head that takes part in the softmax), a sliding-window layer
    # then a full one, and a mixture of experts; the 8-token window is shorter than most prompts.
    "gpt_oss": lambda: _auto("gpt_oss", num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                             layer_types=["sliding_attention", "full_attention"], num_local_experts=4,
                             num_experts_per_tok=2, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    # Chunked attention (a key is seen only from the query's own 8-token chunk) on the rotary layer, a
    # NoPE full-attention layer, mixture-of-experts feed-forward on both.
    "llama4_text": lambda: _auto("llama4_text", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 attention_chunk_size=8, no_rope_layers=[1, 0], num_local_experts=4,
                                 num_experts_per_tok=1, intermediate_size_mlp=128),
    "glm4": lambda: _auto("glm4", num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    # A sliding-window layer (window 8) then a full one.
    "olmo3": lambda: _auto("olmo3", num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                           layer_types=["sliding_attention", "full_attention"]),
    # A sliding-window layer with rotary positions, then a full-attention layer without (EXAONE 4's hybrid form).
    "exaone4": lambda: _auto("exaone4", num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                             sliding_window_pattern=2, layer_types=["sliding_attention", "full_attention"]),
    "ernie4_5": lambda: _auto("ernie4_5", num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "apertus": lambda: _auto("apertus", num_attention_heads=4, num_key_value_heads=2,
                             rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    "seed_oss": lambda: _auto("seed_oss", num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    # Multi-head latent attention: a 32-wide latent plus a 16-wide rotary key cached per token (48 values, where
    # expanded K/V would take 4 heads x (32 + 24)); queries through a low-rank q projection, interleaved rotary
    # pairs, YaRN with mscale_all_dim (the softmax scale grows by mscale^2), a value head (24) unlike the key's
    # (32); a dense first layer, then a mixture of experts with a shared expert and grouped routing.
    "deepseek_v3": lambda: _auto("deepseek_v3", **_deepseek_v3_common(), q_lora_rank=32, rope_interleave=True,
                                 rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                  "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32,
                                                  "beta_slow": 1, "original_max_position_embeddings": 128}),
    # The other form: a full-rank q projection, rotary halves (not interleaved pairs), plain rotary positions.
    "deepseek_v3_plain": lambda: _auto("deepseek_v3", **_deepseek_v3_common(), q_lora_rank=None,
                                       rope_interleave=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # DeepSeek-V3.2: V3's latent attention (interleaved rotary pairs, YaRN) with a sparse-attention indexer keeping
    # each query's 64 best keys: the engine's context is capped at index_topk=64, within which it keeps every key
    # (the mixed batch's sequences reach 52 tokens).
    "deepseek_v32": lambda: _auto("deepseek_v32", **_deepseek_v3_common(), q_lora_rank=32, index_topk=64,
                                  index_head_dim=32, index_n_heads=4,
                                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                   "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32,
                                                   "beta_slow": 1, "original_max_position_embeddings": 128}),
    # Hybrid: a Kimi delta attention layer (a convolution window and a per-channel-decay delta-rule state per
    # sequence) before a latent-attention layer without rotary positions (a 32-wide latent plus a 16-wide shared key
    # part cached per token), a dense first layer, then experts with a shared expert.
    "kimi_linear": lambda: _auto("kimi_linear", **_deepseek_v3_common(), q_lora_rank=None,
                                 layer_types=["linear_attention", "full_attention"], linear_num_heads=4,
                                 linear_head_dim=16, model_max_length=512),
    # Hybrid: short-convolution layers (a state of the last conv_L_cache - 1 inputs per sequence) around an
    # attention layer.
    "lfm2": lambda: _auto("lfm2", num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                          layer_types=["conv", "full_attention", "conv"]),
    # Hybrid: Mamba-2 layers (a convolution window and an SSM state per sequence; 8-token scan chunks, so prompts
    # span several) around a rotary attention layer, with a mixture of experts.
    "granitemoehybrid": lambda: _auto("granitemoehybrid", num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
                                      position_embedding_type="rope", mamba_n_heads=8, mamba_d_head=16,
                                      mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=8, num_local_experts=4,
                                      num_experts_per_tok=2, shared_intermediate_size=64),
    # Hybrid: every layer runs attention and a Mamba-2 mixer side by side (µP multipliers off their defaults,
    # gated RMS norm on, 8-token scan chunks).
    "falcon_h1": lambda: _auto("falcon_h1", num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8,
                               mamba_d_head=8, mamba_d_ssm=64, mamba_d_state=16, mamba_n_groups=1,
                               mamba_chunk_size=8, mamba_rms_norm=True, attention_in_multiplier=0.8,
                               ssm_out_multiplier=0.7, ssm_in_multiplier=1.2,
                               ssm_multipliers=[1.0, 0.9, 1.1, 1.0, 0.8]),
    # Hybrid: a gated delta-net layer (a convolution window and a delta-rule state per sequence; 2 key heads
    # shared by 4 value heads) before a gated attention layer (rotary on a quarter of the head), experts with a
    # gated shared expert after each.
    "qwen3_next": lambda: _auto("qwen3_next", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=32),
    # Qwen3.5: Qwen3-Next's layers (separate q/k/v, z, b, a projections in the delta net; multimodal rotary
    # sections, plain on text), dense with the attention layer first, and MoE. A checkpoint's config is the
    # multimodal one (qwen3_5, qwen3_5_moe); AutoModelForCausalLM builds the text model of either form.
    "qwen3_5": lambda: tf.AutoConfig.for_model("qwen3_5", text_config=_qwen3_5_text(dense=True)),
    "qwen3_5_text": lambda: tf.AutoConfig.for_model("qwen3_5_text", **_qwen3_5_text(dense=True)),
    "qwen3_5_moe": lambda: tf.AutoConfig.for_model("qwen3_5_moe", text_config=_qwen3_5_text(dense=False)),
    "qwen3_5_moe_text": lambda: tf.AutoConfig.for_model("qwen3_5_moe_text", **_qwen3_5_text(dense=False)),
    # Its decoder layer drops forward keywords on the way to attention: runs through its adapter.
    "stablelm": lambda: tf.StableLmConfig(num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.5,
                                          **_common()),
    # Granite 4.0 Micro's form: a hybrid family's type with attention layers only (rotary, no experts, a dense
    # shared MLP), so no recurrent layer and no state slots.
    "granitemoehybrid_attention": lambda: _auto("granitemoehybrid", num_attention_heads=4, num_key_value_heads=2,
                                                layer_types=["attention", "attention"],
                                                position_embedding_type="rope", num_local_experts=0,
                                                shared_intermediate_size=128),
    # LFM2 with attention layers only.
    "lfm2_attention": lambda: _auto("lfm2", num_attention_heads=4, num_key_value_heads=2,
                                    layer_types=["full_attention", "full_attention"]),
    # Types that run through the interface as they are: the sweep of every causal-LM type found each HF-identical.
    # A sliding-window layer (window 8) then a full one.
    "afmoe": lambda: _auto("afmoe", num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=32, sliding_window=8,
                           layer_types=["sliding_attention", "full_attention"]),
    "apertus1p5_text": lambda: _auto("apertus1p5_text", num_attention_heads=4, num_key_value_heads=2),
    "arcee": lambda: _auto("arcee", num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "aria_text": lambda: _auto("aria_text", num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    # A sliding-window layer (window 8) then a full one.
    "beam": lambda: _auto("beam", num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=32, sliding_window=8,
                          layer_types=["sliding_attention", "full_attention"]),
    "biogpt": lambda: _auto("biogpt", num_attention_heads=4),
    "bitnet": lambda: _auto("bitnet", num_attention_heads=4, num_key_value_heads=2),
    # A sliding-window layer (window 8) then a full one.
    "cohere2": lambda: _auto("cohere2", num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                             layer_types=["sliding_attention", "full_attention"]),
    # A sliding-window layer (window 8) then a full one.
    "cohere2_moe": lambda: _auto("cohere2_moe", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 num_experts=4, num_experts_per_tok=2, sliding_window=8,
                                 layer_types=["sliding_attention", "full_attention"]),
    "ctrl": lambda: _auto("ctrl", n_positions=512, n_embd=64, n_layer=2, n_head=4, dff=128),
    # A sliding-window layer (window 8) then a full one.
    "cwm": lambda: _auto("cwm", num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"]),
    # A sliding-window layer (window 8) then a full one.
    "ergo": lambda: _auto("ergo", num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32, sliding_window=8,
                          layer_types=["sliding_attention", "full_attention"], first_dense_intermediate_size=128,
                          shared_intermediate_size=32),
    "ernie4_5_moe": lambda: _auto("ernie4_5_moe", num_attention_heads=4, num_key_value_heads=2,
                                  moe_intermediate_size=32),
    "exaone": lambda: _auto("exaone", num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    # A sliding-window layer (window 8) then a full one.
    "exaone_moe": lambda: _auto("exaone_moe", num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                num_experts_per_tok=2, moe_intermediate_size=32, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention"]),
    "flex_olmo": lambda: _auto("flex_olmo", num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                               num_experts_per_tok=2),
    # A sliding-window layer (window 8) then a full one.
    "flint": lambda: _auto("flint", num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                           sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "fuyu": lambda: _auto("fuyu"),
    # Gemma 3's multimodal type (Gemma3ForConditionalGeneration) on token ids alone (its images:
    # tests/model/test_vision.py): a sliding-window layer (window 8) then a global one, under a tiny vision tower.
    "gemma3": lambda: tf.Gemma3Config(text_config=dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                       sliding_window=8, query_pre_attn_scalar=16,
                                                       layer_types=["sliding_attention", "full_attention"],
                                                       **_common()),
                                      vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                         num_attention_heads=2, image_size=28, patch_size=14),
                                      mm_tokens_per_image=4, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "glm": lambda: _auto("glm", num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    # Idefics3 on token ids alone (its images: tests/model/test_vision.py); its image token lies outside the prompts'.
    "idefics3": lambda: tf.Idefics3Config(
        text_config=dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2, **_common()),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=8),
        scale_factor=2, image_token_id=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Qwen2-VL on token ids alone (its images: tests/model/test_vision.py): its M-RoPE positions are the sequence's on
    # every axis; its vision token ids lie outside the prompts' vocabulary.
    "qwen2_vl": lambda: tf.Qwen2VLConfig(
        text_config=dict(num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                         **_common()),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=8, spatial_merge_size=2),
        image_token_id=VOCAB, video_token_id=VOCAB + 1, vision_start_token_id=VOCAB + 2, vision_end_token_id=VOCAB + 3),
    "qwen2_5_vl": lambda: tf.Qwen2_5_VLConfig(
        text_config=dict(num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                         **_common()),
        vision_config=dict(depth=1, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2,
                           patch_size=8, spatial_merge_size=2, fullatt_block_indexes=[0]),
        image_token_id=VOCAB, video_token_id=VOCAB + 1, vision_start_token_id=VOCAB + 2, vision_end_token_id=VOCAB + 3),
    # LLaVA on token ids alone (its images: tests/model/test_vision.py); the image token is a plain id here.
    "llava": lambda: tf.LlavaConfig(text_config=dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2,
                                                     **_common()),
                                    vision_config=dict(model_type="clip_vision_model", hidden_size=32,
                                                       intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                                       image_size=16, patch_size=8),
                                    image_token_index=255, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "glm4_moe": lambda: _auto("glm4_moe", num_attention_heads=4, num_key_value_heads=2, n_routed_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=32),
    # A sliding-window layer (window 8) then a full one.
    "granite_swa": lambda: _auto("granite_swa", num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                                 layer_types=["sliding_attention", "full_attention"]),
    "granitemoe": lambda: _auto("granitemoe", num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                num_experts_per_tok=2),
    # A sliding-window layer (window 8) then a full one.
    "granitemoe_swa": lambda: _auto("granitemoe_swa", num_attention_heads=4, num_key_value_heads=2,
                                    num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                    layer_types=["sliding_attention", "full_attention"]),
    "granitemoeshared": lambda: _auto("granitemoeshared", num_attention_heads=4, num_key_value_heads=2,
                                      num_local_experts=4, num_experts_per_tok=2),
    "helium": lambda: _auto("helium", num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "hunyuan_v1_dense": lambda: _auto("hunyuan_v1_dense", num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "hunyuan_v1_moe": lambda: _auto("hunyuan_v1_moe", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    num_experts=4),
    "hy_v3": lambda: _auto("hy_v3", num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=32),
    "hyperclovax": lambda: _auto("hyperclovax", num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "internlm3": lambda: _auto("internlm3", num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "iquestcoder": lambda: _auto("iquestcoder", num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "jais2": lambda: _auto("jais2", num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    # A sliding-window layer (window 8) then a full one.
    "kolibri1": lambda: _auto("kolibri1", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=32, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"]),
    # A sliding-window layer (window 8) then a full one.
    "laguna": lambda: _auto("laguna", num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                            sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    # A sliding-window layer (window 8) then a full one.
    "mellum": lambda: _auto("mellum", num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=32, sliding_window=8,
                            layer_types=["sliding_attention", "full_attention"]),
    "minicpm5_moe": lambda: _auto("minicpm5_moe", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "minimax_m2": lambda: _auto("minimax_m2", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                num_local_experts=4, num_experts_per_tok=2),
    "minimax_m3_vl_text": lambda: _auto("minimax_m3_vl_text", num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=16, num_local_experts=4, num_experts_per_tok=2),
    # A sliding-window layer (window 8) then a full one.
    "ministral": lambda: _auto("ministral", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    # Every layer slides over 8 positions (no layer_types: the window applies to all).
    "ministral3": lambda: _auto("ministral3", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                sliding_window=8),
    # A sliding-window layer (window 8) then a full one.
    "modernbert-decoder": lambda: _auto("modernbert-decoder", num_attention_heads=4, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention"]),
    "nanochat": lambda: _auto("nanochat", num_attention_heads=4, num_key_value_heads=2),
    "olmoe": lambda: _auto("olmoe", num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                           num_experts_per_tok=2),
    "param2moe": lambda: _auto("param2moe", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "persimmon": lambda: _auto("persimmon", num_attention_heads=4),
    "sarvam_moe": lambda: _auto("sarvam_moe", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "solar_open": lambda: _auto("solar_open", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    # A sliding-window layer (window 8) then a full one.
    "vaultgemma": lambda: _auto("vaultgemma", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                sliding_window=8, layer_types=["sliding_attention", "full_attention"]),

}


def _common() -> dict:
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                max_position_embeddings=512)


def _qwen3_5_text(dense: bool) -> dict:
    layers = ["full_attention", "linear_attention"] if dense else ["linear_attention", "full_attention"]
    moe = {} if dense else {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                            "shared_expert_intermediate_size": 32}
    return {**_common(), "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "layer_types": layers,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **moe}


def _deepseek_v3_common() -> dict:
    return {"num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 32, "v_head_dim": 24, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1}


def _auto(model_type: str, **kwargs) -> tf.PretrainedConfig:
    """A tiny config of a type without a config class exported at the top level, with in-vocabulary special ids."""
    return tf.AutoConfig.for_model(model_type, pad_token_id=0, bos_token_id=1, eos_token_id=2, **{**_common(), **kwargs})


def build(arch: str, seed: int = 0) -> tf.PreTrainedModel:
    """A tiny random causal LM of `arch`, in float32 eval mode, with no eos so runs go to max length."""
    return build_from_config(CONFIGS[arch], seed)


def build_from_config(make_config, seed: int = 0) -> tf.PreTrainedModel:
    """The model of `make_config()`, seeded, with build()'s weights and generation settings."""
    torch.manual_seed(seed)
    config = make_config()
    vision = ("llava", "qwen2_vl", "qwen2_5_vl", "idefics3")
    auto = tf.AutoModelForImageTextToText if config.model_type in vision else tf.AutoModelForCausalLM
    return spread_weights(auto.from_config(config, dtype=torch.float32))


def spread_weights(model: tf.PreTrainedModel) -> tf.PreTrainedModel:
    """`model` with build()'s weights (drawn from the current seed) and generation settings, in eval mode.
    Larger-than-default init spreads the logits, so greedy argmax has no near-ties to flip on rounding."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def int4_llama() -> tf.PreTrainedModel:
    """A llama whose projections stack as int4 (output sizes multiples of the kernel's 64-row blocks)."""
    def config() -> tf.LlamaConfig:
        return tf.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)

    from paged_backend.model.quantized.quantization import quantize_int4

    model = build_from_config(config)
    quantize_int4(model)
    return model
