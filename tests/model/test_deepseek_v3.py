"""DeepSeek-V3's multi-head latent attention through the paged cache (adapters/deepseek_v3.py): the cache holds
one latent row per token and layer, the load-time self-check covers that path, and prefix caching, n > 1,
beam search and an int8 cache stay correct on it. The mixed-batch equivalence with HF generate (12 prompts,
chunked prefill, preemptions, late arrivals) runs for both tiny configs in tests/test_engine_equivalence.py."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from helpers.engine import (
    MAX_NEW,
    assert_all_blocks_free,
    greedy,
    hf_case,
    hf_greedy,
    mixed_prompts,
    run_to_completion,
)
from helpers.models import build, build_from_config
from peft import LoraConfig, get_peft_model
from torch._dynamo.utils import counters

from paged_backend import (
    BeamSearchParams,
    Engine,
    EngineConfig,
    SamplingParams,
    UnsupportedArchitectureError,
)
from paged_backend.core.layer_specs import LatentAttentionSpec
from paged_backend.entrypoints.beam_search import beam_search
from paged_backend.kernels import dispatch
from paged_backend.model.adapters import deepseek_v3
from paged_backend.model.quantized.int4_linear import Int4Linear
from paged_backend.model.loading.model_check import (
    CHECK_LENGTHS,
    dense_logits,
    paged_logits,
    prepare_model,
)
from paged_backend.model.paged.paged_cache import ShapeProbe

# The tiny config's latent: kv_lora_rank 32 + qk_rope_head_dim 16 values per token and layer.
LATENT, RANK = 48, 32


@pytest.fixture(scope="module")
def model():
    return build("deepseek_v3")


def test_cache_holds_one_latent_row_per_token_and_layer(model):
    """The memory per token and layer is the latent's 48 values, not 4 heads x (32 + 16) keys and 4 x 24
    values: the cache tensor is [layer, 1 plane, 1 head, slot, 48], and a byte budget buys blocks at that size."""
    engine = Engine(model, None, EngineConfig(kv_cache_bytes=2 * 4 * LATENT * 4 * 100, block_size=4))
    layers = model.config.num_hidden_layers
    assert engine.cache.kv.shape == (layers, 1, 1, engine.cache.num_blocks * 4, LATENT)
    assert set(engine.cache.shape.layers) == {LatentAttentionSpec(RANK)}
    assert engine.cache.shape.bytes_per_block(4, torch.float32) == layers * 4 * LATENT * 4
    assert engine.kv.pool.num_blocks == 100
    per_token = engine.cache.kv[0, :, :, 0].numel()  # values one layer stores per token
    expanded = 4 * (32 + 16) + 4 * 24  # what 4 heads' keys and values would take
    assert per_token == LATENT < expanded / 5


def test_model_outside_the_engine_runs_its_own_attention(model):
    ids = torch.tensor([mixed_prompts(1)[0]])
    with torch.no_grad():
        before = model(ids).logits
        Engine(model, None, EngineConfig(num_kv_blocks=16))
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)


def test_self_check_refuses_a_wrong_latent_path(monkeypatch):
    """The load-time self-check runs the latent cache path (chunked prefill and decode over cached latents) against
    the model's own forward: here a rotary embedding of the wrong form (halves, not the config's interleaved
    pairs) is caught, and the model leaves as it came."""
    model = build("deepseek_v3")
    monkeypatch.setattr(deepseek_v3, "rotate", lambda module, q, k, pe: deepseek_v3.apply_rotary_pos_emb(
        q, k, pe[0][0], pe[1][0], unsqueeze_dim=1))
    with pytest.raises(UnsupportedArchitectureError, match="logits differ"):
        Engine(model, None, EngineConfig(num_kv_blocks=16))
    attention = model.model.layers[0].self_attn
    assert "forward" not in vars(attention) and "_paged_absorbed" not in vars(attention.kv_b_proj)


def test_prefix_cache_hits_read_cached_latents(model):
    shared = mixed_prompts(2, seed=5)[1] + mixed_prompts(2, seed=6)[1][:6]  # 16 tokens: 4 full blocks
    prompts = [shared + p[:6] for p in mixed_prompts(4, seed=6)]
    refs = [hf_greedy(model, p, 8) for p in prompts]
    engine = Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=4))
    first = engine.add_request(prompts[0], greedy(8))
    finals = run_to_completion(engine)
    ids = [engine.add_request(p, greedy(8)) for p in prompts[1:]]
    finals.update(run_to_completion(engine))
    assert engine.kv.hit_tokens >= 3 * 16
    assert [finals[i].outputs[0].token_ids for i in [first, *ids]] == refs
    assert_all_blocks_free(engine)


def test_parallel_samples_share_the_prompt_and_equal_separate_requests(model):
    """n = 3 seeded samples (sharing the prompt's latent blocks) equal three separate requests seeded seed + i."""
    prompt = mixed_prompts(3, seed=7)[2]  # 17 tokens
    engine = Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=4))
    group = engine.add_request(prompt, SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8))
    grouped = run_to_completion(engine)[group].outputs
    assert engine.kv.hit_tokens > 0
    alone = Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=4, enable_prefix_caching=False))
    ids = [alone.add_request(prompt, SamplingParams(temperature=1.0, seed=11 + i, max_tokens=8)) for i in range(3)]
    finals = run_to_completion(alone)
    assert sorted(o.token_ids for o in grouped) == sorted(finals[i].outputs[0].token_ids for i in ids)
    assert len({tuple(o.token_ids) for o in grouped}) > 1  # really sampled


def test_beam_search_matches_hf(model):
    prompts = mixed_prompts(2, seed=11)
    engine = Engine(model, None, EngineConfig(num_kv_blocks=128, block_size=4))
    outputs = beam_search(engine, prompts, BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True))
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), num_beams=2, num_return_sequences=2, do_sample=False,
                                 max_new_tokens=5)
        assert [s.token_ids for s in output.sequences] == ref[:, len(prompt):].tolist()
    assert_all_blocks_free(engine)


def test_int8_latent_cache_keeps_logits_close(model):
    """An int8 cache quantizes each latent row with one scale (its value columns dequantize with the key's)."""
    shape = prepare_model(model, model.config.num_hidden_layers, self_check=False)
    generator = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=generator) for n in CHECK_LENGTHS]
    with torch.inference_mode():
        dense = dense_logits(model, seqs)
        low = paged_logits(model, shape, seqs, torch.int8, torch.device("cpu"))
        exact = paged_logits(model, shape, seqs, torch.float32, torch.device("cpu"))
    assert 0 < (low - dense).abs().max().item() / dense.abs().max().item() < 0.05
    assert (exact - dense).abs().max().item() / dense.abs().max().item() < 1e-5
    engine = Engine(model, None, EngineConfig(kv_cache_dtype="int8", num_kv_blocks=32, block_size=4))
    assert engine.cache.kv.dtype == torch.int8 and engine.cache.kv_scales.shape == engine.cache.kv.shape[:-1]


def test_a_quantized_or_biased_absorbed_projection_is_refused():
    """The absorbed form multiplies by kv_b_proj's weight itself: a quantized kv_b_proj, or one with a bias (which
    the absorbed form would drop), is refused, by name."""
    model = build("deepseek_v3")
    attention = model.model.layers[1].self_attn
    attention.kv_b_proj = Int4Linear.from_float(attention.kv_b_proj)
    with pytest.raises(UnsupportedArchitectureError, match="layer 1 has a Int4Linear as kv_b_proj"):
        Engine(model, None, EngineConfig(num_kv_blocks=16))
    assert "forward" not in vars(model.model.layers[0].self_attn)
    attention.kv_b_proj = torch.nn.Linear(32, 4 * (32 + 24))
    with pytest.raises(UnsupportedArchitectureError, match="layer 1 has a Linear with a bias as kv_b_proj"):
        Engine(model, None, EngineConfig(num_kv_blocks=16))


def test_lora_may_not_target_the_absorbed_projection():
    """A LoRA adapter on kv_b_proj would never run (the absorbed form reads its weight): refused, naming it;
    one on the query projections is served."""
    engine = Engine(build("deepseek_v3"), None, EngineConfig(num_kv_blocks=32, enable_lora=True, max_lora_rank=4))
    peft = get_peft_model(build("deepseek_v3"), LoraConfig(r=4, target_modules=["kv_b_proj"]))
    with pytest.raises(ValueError, match="kv_b_proj, whose weight the paged latent attention folds"):
        engine.add_lora("latent", peft)
    peft = get_peft_model(build("deepseek_v3"), LoraConfig(r=4, target_modules=["q_a_proj", "q_b_proj"]))
    engine.add_lora("query", peft)
    assert engine.list_loras() == ["query"]


@pytest.mark.slow  # compiles
def test_compiled_engine_equals_hf_without_recompiles():
    """The compiled CPU step holds the latent op as one opaque node (latent_cache.py): greedy tokens equal HF
    through chunked prefill, preemption and late arrivals, and no step falls outside the compiled graphs."""
    model = build("deepseek_v3")
    _, model, prompts, refs = hf_case("deepseek_v3", model, MAX_NEW)
    engine = Engine(model, None, EngineConfig(num_kv_blocks=20, block_size=4, max_num_batched_tokens=24,
                                              compile=True))
    assert engine.runner.compiled
    graphs_before = counters["stats"]["unique_graphs"]
    ids = [engine.add_request(p, greedy(MAX_NEW)) for p in prompts[:5]]
    finals = {o.request_id: o for _ in range(3) for o in engine.step() if o.finished}
    ids += [engine.add_request(p, greedy(MAX_NEW)) for p in prompts[5:]]
    finals.update(run_to_completion(engine))
    assert [finals[i].outputs[0].token_ids for i in ids] == refs
    assert engine.scheduler.num_preemptions >= 2
    assert counters["stats"]["unique_graphs"] == graphs_before
    assert engine.runner.forward_model.eager_steps == 0
    assert_all_blocks_free(engine)


def test_padded_decode_steps_and_a_draft_model_read_the_latent_cache(model):
    """Decode steps padded to a captured size (their padding rows write a scratch block), and the model as its own
    draft (a second latent cache read and written through the target's block tables): HF generate's tokens."""
    prompts = mixed_prompts(5, seed=12)
    refs = [hf_greedy(model, p, 8) for p in prompts]
    engines = []
    for extra in ({"pad_decode": True, "cuda_graph_sizes": [1, 2, 4, 8]},
                  {"speculative_config": {"method": "draft_model", "model": model, "num_speculative_tokens": 2}}):
        engine = Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=4, **extra))
        ids = [engine.add_request(p, greedy(8)) for p in prompts]
        finals = run_to_completion(engine)
        assert [finals[i].outputs[0].token_ids for i in ids] == refs, extra
        assert_all_blocks_free(engine)
        engines.append(engine)
    padded, drafted = engines
    assert padded.runner.padding is not None
    assert drafted.speculator.draft.runner.cache.kv.shape[1:3] == (1, 1)
    assert drafted.speculator.num_accepted_tokens > 0  # the draft's latents were read: its proposals were kept


@pytest.mark.slow  # 128 heads: a 200 MB model
def test_deepseek_v3_attention_dimensions_equal_hf():
    """DeepSeek-V3's own attention dimensions (128 heads, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim
    128, v_head_dim 128; YaRN factor 40 with mscale_all_dim 1) on a narrow 2-layer model: a 576-wide latent row
    per token and layer where expanded K/V would take 40,960 values, attended through the PyTorch backend even
    where Triton is asked for (its tiles take at most 256), with HF generate's tokens."""
    def config():
        return tf.AutoConfig.for_model(
            "deepseek_v3", vocab_size=256, hidden_size=256, intermediate_size=256, moe_intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=96, kv_lora_rank=512,
            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=8, num_experts_per_tok=2,
            n_group=4, topk_group=2, first_k_dense_replace=1, max_position_embeddings=4096,
            rope_parameters={"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 4096,
                             "rope_theta": 10000.0},
            pad_token_id=0, bos_token_id=1, eos_token_id=2)

    model = build_from_config(config)
    with torch.no_grad():  # 128 heads' sums: smaller weights keep the logits spread but finite
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(0.25)
    prompts = mixed_prompts(4, seed=3)
    refs = [hf_greedy(model, p, 6) for p in prompts]
    with dispatch.use_backend("triton"):
        engine = Engine(model, None, EngineConfig(num_kv_blocks=40, block_size=4, max_num_batched_tokens=16))
        assert engine.cache.kv.shape[1:] == (1, 1, 160, 576)
        assert dispatch.select_backend(torch.device("cuda"), torch.bfloat16, 576) == "torch"
        ids = [engine.add_request(p, greedy(6)) for p in prompts]
        finals = run_to_completion(engine)
    assert [finals[i].outputs[0].token_ids for i in ids] == refs


def test_a_model_mixing_latent_and_kv_layers_is_refused(monkeypatch):
    """The cache holds one kind of row for every layer: a model where only some layers cache a latent is refused
    (here the probe hears of layer 0's latent only), naming the layers."""
    original = ShapeProbe.stores_latent
    monkeypatch.setattr(ShapeProbe, "stores_latent",
                        lambda probe, layer, width: original(probe, layer, width) if layer == 0 else None)
    model = build("deepseek_v3")
    with pytest.raises(UnsupportedArchitectureError, match=r"layers \[0\] of 2 cache a latent"):
        Engine(model, None, EngineConfig(num_kv_blocks=16))
