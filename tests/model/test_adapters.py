"""Architectures whose attention bypasses transformers' attention interface run through adapters:
greedy engine output equals HF `generate` for tiny random BLOOM, MPT and the three Falcon families,
in mixed batches with chunked prefill, late arrivals and preemption; outside the engine the
adapted model still behaves as before."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from helpers.adapters import (
    ADAPTED_CONFIGS,
    BAICHUAN_COMMON,
    VOCAB,
    build_adapted,
    random_baichuan_weights,
    write_baichuan,
)
from helpers.engine import (
    MAX_NEW,
    assert_all_blocks_free,
    check_engine,
    greedy,
    hf_case,
    hf_greedy,
    mixed_prompts,
)
from helpers.models import build_from_config

from paged_backend import Engine, EngineConfig
from paged_backend.model.paged import custom_ops
from paged_backend.model.adapters import ADAPTERS, install_adapters

ALIBI = {"bloom", "mpt", "falcon-rw"}


@pytest.fixture(scope="module", params=sorted(ADAPTED_CONFIGS))
def arch_case(request):
    return hf_case(request.param, build_adapted(request.param), MAX_NEW)


def test_plain_batch_runs_through_the_adapter(arch_case, monkeypatch):
    name, model, prompts, refs = arch_case
    seen_slopes = []
    kernel = custom_ops.write_and_attend  # what the adapter's op calls, with the layer's attention record last
    monkeypatch.setattr(custom_ops, "write_and_attend",
                        lambda *args: seen_slopes.append(args[-1].alibi_slopes) or kernel(*args))
    check_engine(model, prompts, refs, EngineConfig(num_kv_blocks=64))
    assert seen_slopes, "the adapter's paged forward never ran"
    assert all((s is not None) == (name in ALIBI) for s in seen_slopes)


def test_chunked_prefill_and_late_arrivals(arch_case):
    _, model, prompts, refs = arch_case
    check_engine(model, prompts, refs, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=16), late_from=5)


def test_preemption(arch_case):
    _, model, prompts, refs = arch_case
    engine = check_engine(model, prompts, refs, EngineConfig(num_kv_blocks=20, block_size=4,
                                                             max_num_batched_tokens=24))
    assert engine.scheduler.num_preemptions > 0


def test_adapted_model_still_works_outside_the_engine(arch_case):
    """After an engine adapted it, plain `generate` (DynamicCache, HF masks) gives what it gave before."""
    _, model, prompts, refs = arch_case
    Engine(model, None, EngineConfig(num_kv_blocks=16))
    for prompt, ref in list(zip(prompts, refs))[:3]:
        assert hf_greedy(model, prompt, MAX_NEW) == ref


def test_kv_cache_holds_only_the_real_kv_heads():
    """falcon-40b's HF code repeats its 2 KV heads to 8 before caching; the adapter pages only 2."""
    engine = Engine(build_adapted("falcon-40b"), None, EngineConfig(num_kv_blocks=8))
    assert engine.cache.shape.num_kv_heads == 2
    engine = Engine(build_adapted("falcon-7b"), None, EngineConfig(num_kv_blocks=8))
    assert engine.cache.shape.num_kv_heads == 1


def test_install_is_per_model_and_idempotent():
    adapted, other = build_adapted("bloom"), build_adapted("bloom", seed=1)
    assert install_adapters(adapted) and install_adapters(adapted)
    attention = adapted.transformer.h[0].self_attention
    assert attention._paged_original_forward.__self__ is attention  # wrapped once, not twice
    assert "_paged_original_forward" not in vars(other.transformer.h[0].self_attention)


@pytest.mark.parametrize("name", ["mpt", "falcon-rw"])
def test_llm_loads_a_saved_checkpoint(name, tmp_path):
    """`LLM(folder)` asks the loader for the paged attention implementation; an adapted architecture
    keeps its own (MPT's mask and Falcon's attention table break otherwise) and still matches."""
    from paged_backend import LLM

    model = build_adapted(name)
    model.save_pretrained(tmp_path / name)
    prompts = mixed_prompts(4)
    llm = LLM(str(tmp_path / name), device="cpu", num_kv_blocks=32)
    outs = llm.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, MAX_NEW) for p in prompts]


@pytest.mark.parametrize(("name", "route"), [("llama", "interface"), ("bloom", "adapter"), ("stablelm", "adapter")])
def test_probe_records_how_each_layer_is_driven(name, route):
    """The start-up probe sees every layer write K/V and receive the step, through the interface
    function or the layer's adapter (StableLM's hands the step on to the interface function)."""
    from helpers.models import CONFIGS

    from paged_backend.model.loading.model_check import prepare_model
    from paged_backend.model.paged.paged_cache import probe_model

    model = build_from_config(CONFIGS.get(name) or ADAPTED_CONFIGS[name])
    prepare_model(model, 2, self_check=False)
    probe = probe_model(model)
    assert probe.routes == {0: route, 1: route}
    assert set(probe.seen) == {0, 1}


def test_refused_adapted_model_gets_its_own_forward_back(monkeypatch):
    """A refusal after the adapters went in (here a failing self-check) takes them out again."""
    from paged_backend import UnsupportedArchitectureError
    from paged_backend.model.loading import model_check

    model = build_adapted("bloom")
    x = torch.tensor([mixed_prompts(1)[0]])
    with torch.no_grad():
        before = model(x).logits

    def refuse(*args):
        raise UnsupportedArchitectureError("refused for the test")

    monkeypatch.setattr(model_check, "check_paged_matches_dense", refuse)
    with pytest.raises(UnsupportedArchitectureError, match="refused for the test"):
        Engine(model, None, EngineConfig(num_kv_blocks=8))
    attention = model.transformer.h[0].self_attention
    assert "forward" not in vars(attention) and "_paged_original_forward" not in vars(attention)
    with torch.no_grad():
        assert torch.equal(model(x).logits, before)


def test_registry_has_one_adapter_per_family():
    assert {"bloom", "mpt", "falcon", "baichuan"} <= set(ADAPTERS)
    assert not install_adapters(tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)))


# ---------------------------------------------------------------- Baichuan checkpoints


def llama_from_baichuan_weights(state: dict[str, torch.Tensor]) -> tf.LlamaForCausalLM:
    """The 7B form's equivalent: a Llama (MHA, rope theta 10000) with W_pack split into q/k/v."""
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-6,
                            max_position_embeddings=512, tie_word_embeddings=False)
    model = tf.LlamaForCausalLM(config).eval()
    split = {}
    for name, tensor in state.items():
        if "W_pack" in name:
            for part, chunk in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3)):
                split[name.replace("W_pack", part)] = chunk
        else:
            split[name] = tensor
    model.load_state_dict(split, strict=True)
    model.generation_config.eos_token_id = None
    return model


def baichuan13b_slopes(n: int) -> list[float]:
    """`_get_interleave` from Baichuan-13B's modeling code."""
    import math

    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + baichuan13b_slopes(2 * closest)[0::2][: n - closest]


def baichuan13b_reference_greedy(state: dict[str, torch.Tensor], prompt: list[int], max_new: int) -> list[int]:
    """Baichuan-13B's forward written out from its modeling code (full recompute per token, no cache):
    RMSNorm, W_pack, `q.k / sqrt(d) + slope * key_pos` with a causal mask, SiLU-gated MLP."""
    heads, hidden = BAICHUAN_COMMON["num_attention_heads"], BAICHUAN_COMMON["hidden_size"]
    dim = hidden // heads
    slopes = torch.tensor(baichuan13b_slopes(heads))

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    tokens = list(prompt)
    for _ in range(max_new):
        n = len(tokens)
        x = state["model.embed_tokens.weight"][torch.tensor(tokens)]
        bias = slopes[:, None, None] * torch.arange(n)[None, None, :]
        bias = bias.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        for i in range(BAICHUAN_COMMON["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = rms(x, state[p + "input_layernorm.weight"])
            q, k, v = (h @ state[p + "self_attn.W_pack.weight"].T).view(n, 3, heads, dim).permute(1, 2, 0, 3)
            probs = torch.softmax(q @ k.transpose(1, 2) / dim ** 0.5 + bias, dim=-1)
            x = x + (probs @ v).transpose(0, 1).reshape(n, hidden) @ state[p + "self_attn.o_proj.weight"].T
            h = rms(x, state[p + "post_attention_layernorm.weight"])
            gate, up = h @ state[p + "mlp.gate_proj.weight"].T, h @ state[p + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ state[p + "mlp.down_proj.weight"].T
        logits = rms(x[-1], state["model.norm.weight"]) @ state["lm_head.weight"].T
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


def generate_with_llm(folder, prompts, config_kwargs) -> list[list[int]]:
    from paged_backend import LLM

    llm = LLM(str(folder), **config_kwargs)
    assert llm.tokenizer is None  # the synthetic folder has no tokenizer files
    outs = llm.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
    assert_all_blocks_free(llm.engine)
    if config_kwargs["num_kv_blocks"] < 32:
        assert llm.engine.scheduler.num_preemptions > 0
    return [o.outputs[0].token_ids for o in outs]


BAICHUAN_RUNS = [dict(num_kv_blocks=64, device="cpu"),
                 dict(num_kv_blocks=20, block_size=4, max_num_batched_tokens=24, device="cpu")]


def test_baichuan_7b_form_is_a_llama_with_split_qkv(tmp_path):
    from paged_backend.model.loading.model_loader import load_model

    state = random_baichuan_weights()
    folder = write_baichuan(tmp_path / "baichuan-7b", "7b", state)
    model, tokenizer = load_model(folder, device="cpu")
    assert type(model).__name__ == "LlamaForCausalLM" and tokenizer is None
    reference = llama_from_baichuan_weights(state)
    prompts = mixed_prompts()
    refs = [hf_greedy(reference, p, MAX_NEW) for p in prompts]
    for run in BAICHUAN_RUNS:
        assert generate_with_llm(folder, prompts, run) == refs


def test_baichuan_13b_form_runs_alibi_through_its_adapter(tmp_path):
    from paged_backend.model.adapters.baichuan import BaichuanAlibiForCausalLM
    from paged_backend.model.loading.model_loader import load_model

    state = random_baichuan_weights(seed=1)
    folder = write_baichuan(tmp_path / "baichuan-13b", "13b", state)
    model, _ = load_model(folder, device="cpu")
    assert isinstance(model, BaichuanAlibiForCausalLM) and model.config.model_type == "baichuan"
    prompts = mixed_prompts()
    refs = [baichuan13b_reference_greedy(state, p, MAX_NEW) for p in prompts]
    model.generation_config.eos_token_id = None
    assert [hf_greedy(model, p, MAX_NEW) for p in prompts[:3]] == refs[:3]  # its own (non-engine) forward
    for run in BAICHUAN_RUNS:
        assert generate_with_llm(folder, prompts, run) == refs
    model.save_pretrained(tmp_path / "resaved")  # our class's own checkpoint loads back as the same form
    reloaded, _ = load_model(tmp_path / "resaved", device="cpu")
    assert isinstance(reloaded, BaichuanAlibiForCausalLM)
    assert generate_with_llm(tmp_path / "resaved", prompts[:4], BAICHUAN_RUNS[0]) == refs[:4]


def test_baichuan_form_detection_on_published_configs():
    from paged_backend.model.adapters.baichuan import uses_alibi

    base = dict(model_type="baichuan", model_max_length=4096)
    assert not uses_alibi(dict(base, architectures=["BaiChuanForCausalLM"], hidden_size=4096,
                               max_position_embeddings=4096))  # Baichuan-7B
    assert not uses_alibi(dict(base, architectures=["BaichuanForCausalLM"], hidden_size=4096,
                               max_position_embeddings=4096))  # Baichuan2-7B
    assert uses_alibi(dict(base, architectures=["BaichuanForCausalLM"], hidden_size=5120))  # (Baichuan2-)13B
    assert uses_alibi(dict(base, architectures=["BaichuanAlibiForCausalLM"], max_position_embeddings=4096))


def test_baichuan2_head_rows_are_normalised_once():
    from paged_backend.model.adapters.baichuan import (
        BAICHUAN2_VOCAB,
        convert_state_dict,
        llama_config_of,
    )

    raw = dict(BAICHUAN_COMMON, architectures=["BaichuanForCausalLM"], max_position_embeddings=64)
    head = torch.randn(6, 8) * 3
    config2 = llama_config_of(dict(raw, vocab_size=BAICHUAN2_VOCAB))
    normed = convert_state_dict({"lm_head.weight": head}, config2)["lm_head.weight"]
    torch.testing.assert_close(normed.norm(dim=1), torch.ones(6))
    assert convert_state_dict({"lm_head.weight": head}, llama_config_of(raw))["lm_head.weight"] is head


def test_baichuan_remote_tokenizer_gets_a_clear_error(tmp_path):
    import json

    from paged_backend.model.loading.model_loader import load_model

    folder = write_baichuan(tmp_path / "baichuan-7b", "7b", random_baichuan_weights())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "BaichuanTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_baichuan.BaichuanTokenizer", None]}}))
    with pytest.raises(ValueError, match="Baichuan's tokenizer is remote code"):
        load_model(folder, device="cpu")


def test_model_of_an_adapted_type_built_by_other_code_is_refused():
    """A Baichuan built by its remote code has none of the modules the adapter knows: a clear error."""
    config = tf.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                            num_attention_heads=2)
    model = tf.LlamaForCausalLM(config)
    model.config.model_type = "baichuan"
    with pytest.raises(NotImplementedError, match="BaichuanAlibiAttention.*load_model"):
        install_adapters(model)
