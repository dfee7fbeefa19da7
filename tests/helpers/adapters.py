"""Shared test helpers."""

from __future__ import annotations

import torch
import transformers as tf

from helpers.models import build_from_config

VOCAB = 256


# One config per family, as the published checkpoints set them (scaled down).
ADAPTED_CONFIGS = {
    "bloom": lambda: tf.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4),
    # 6 heads: MPT's slope interleave for a head count that is not a power of two.
    "mpt": lambda: tf.MptConfig(vocab_size=VOCAB, d_model=96, n_layers=2, n_heads=6, max_seq_len=512,
                                expansion_ratio=2),
    "falcon-7b": lambda: tf.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, multi_query=True, new_decoder_architecture=False,
                                         parallel_attn=True, alibi=False, bias=False),
    "falcon-40b": lambda: tf.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                          num_attention_heads=8, num_kv_heads=2, new_decoder_architecture=True,
                                          parallel_attn=True, alibi=False, bias=False),
    "falcon-rw": lambda: tf.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, multi_query=False, new_decoder_architecture=False,
                                         parallel_attn=False, alibi=True, bias=True),
}


def build_adapted(name: str, seed: int = 0) -> tf.PreTrainedModel:
    """As helpers.models.build: float32, spread-out weights (no near-ties in greedy argmax), no eos."""
    return build_from_config(ADAPTED_CONFIGS[name], seed)


BAICHUAN_COMMON = dict(model_type="baichuan", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, hidden_act="silu", rms_norm_eps=1e-6,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                       auto_map={"AutoModelForCausalLM": "modeling_baichuan.BaichuanForCausalLM"})


def random_baichuan_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """A checkpoint in Baichuan's own naming, with its fused `W_pack` = [q; k; v] rows."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = BAICHUAN_COMMON["hidden_size"], BAICHUAN_COMMON["intermediate_size"]

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.2

    state = {"model.embed_tokens.weight": rand(VOCAB, hidden), "model.norm.weight": 1 + rand(hidden),
             "lm_head.weight": rand(VOCAB, hidden)}
    for i in range(BAICHUAN_COMMON["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state.update({p + "self_attn.W_pack.weight": rand(3 * hidden, hidden), p + "self_attn.o_proj.weight": rand(hidden, hidden),
                      p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
                      p + "mlp.down_proj.weight": rand(hidden, inter), p + "input_layernorm.weight": 1 + rand(hidden),
                      p + "post_attention_layernorm.weight": 1 + rand(hidden)})
    return state


def write_baichuan(folder, form: str, state: dict[str, torch.Tensor]):
    import json

    folder.mkdir()
    if form == "7b":  # Baichuan-7B: rotary, upper-case C, max_position_embeddings
        config = dict(BAICHUAN_COMMON, architectures=["BaiChuanForCausalLM"], max_position_embeddings=512)
        from safetensors.torch import save_file

        save_file(state, folder / "model.safetensors")
    else:  # Baichuan-13B: ALiBi, lower-case c, model_max_length only; sharded PyTorch pickles
        config = dict(BAICHUAN_COMMON, architectures=["BaichuanForCausalLM"], model_max_length=512)
        names = sorted(state)
        torch.save({n: state[n] for n in names[: len(names) // 2]}, folder / "pytorch_model-00001-of-00002.bin")
        torch.save({n: state[n] for n in names[len(names) // 2:]}, folder / "pytorch_model-00002-of-00002.bin")
    (folder / "config.json").write_text(json.dumps(config))
    return folder
