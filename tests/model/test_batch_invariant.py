"""Batch-invariant steps: in fp32 a request's tokens, logprobs and prompt logprobs are bit for bit the same alone,
in mixed batches cut into chunks of other sizes, and from a prefix cache hit; its logprobs stay within fp32
rounding of the model's own dense forward on the same tokens (a trainer's); and the engine refuses the mode where
it cannot keep it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.engine import mixed_prompts, run_to_completion
from helpers.lora import randomise_lora_b
from helpers.models import build, int4_llama
from peft import LoraConfig, get_peft_model

from paged_backend import Engine, EngineConfig, SamplingParams
from paged_backend.kernels import cpu_paged_attention
from paged_backend.model import batch_invariant
from paged_backend.model.quantized.quantization import quantize_int4

# A prompt longer than the CPU kernel's short sequences (cpu_paged_attention.SHORT_SEQUENCE), so that whole, its
# rows would attend through SDPA, and cut into chunks, through the kernel.
TARGET = torch.randint(1, 256, (150,), generator=torch.Generator().manual_seed(5)).tolist()
PROMPTS = [*mixed_prompts(5, seed=1), TARGET, *mixed_prompts(2, seed=2)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0, prompt_logprobs=0)
CONFIG = {"num_kv_blocks": 200, "block_size": 4, "batch_invariant": True}
Run = tuple[list[int], list[float], list[float]]  # tokens, their logprobs, the prompt's logprobs


def run_target(engine: Engine, batch: list[list[int]], params: SamplingParams = PARAMS) -> Run:
    """TARGET's run in `batch` on `engine` (with params.prompt_logprobs=None, no prompt logprobs)."""
    ids = [engine.add_request(prompt, params) for prompt in batch]
    output = run_to_completion(engine)[ids[batch.index(TARGET)]]
    sample = output.outputs[0]
    prompt = [lp[t].logprob for lp, t in zip(output.prompt_logprobs[1:], TARGET[1:])] if output.prompt_logprobs else []
    return sample.token_ids, [lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids)], prompt


def alone_and_batched(model, **config) -> list[Run]:
    """TARGET alone; in a batch of 8 with a 24-token step budget; in 4 with a 7-token one. Then the same, without
    prompt logprobs (which compute the whole prompt): alone, and again beside another request on that engine, its
    prompt a prefix cache hit."""
    runs = [run_target(Engine(model, None, EngineConfig(**CONFIG, **config)), [TARGET])]
    runs.append(run_target(Engine(model, None, EngineConfig(**CONFIG, max_num_batched_tokens=24, **config)), PROMPTS))
    runs.append(run_target(Engine(model, None, EngineConfig(**CONFIG, max_num_batched_tokens=7, **config)),
                           PROMPTS[:3] + [TARGET]))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    engine = Engine(model, None, EngineConfig(**CONFIG, max_num_batched_tokens=7, **config))
    runs.append(run_target(engine, [TARGET], params))
    runs.append(run_target(engine, [PROMPTS[0], TARGET], params))
    assert engine.stats()["prefix_cache_hit_tokens"] >= 148  # TARGET's full blocks
    return runs


def assert_invariant(runs: list[Run]) -> None:
    """Every run's tokens and logprobs equal the first's, bit for bit (prompt logprobs where both have them)."""
    first = runs[0]
    for run in runs[1:]:
        assert run[0] == first[0]
        assert run[1] == first[1], max(abs(a - b) for a, b in zip(run[1], first[1]))
        assert not run[2] or run[2] == first[2], max(abs(a - b) for a, b in zip(run[2], first[2]))


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: sliding windows, soft-capping
def test_a_requests_logprobs_do_not_depend_on_its_batch(arch: str) -> None:
    assert_invariant(alone_and_batched(build(arch)))


def test_a_peft_models_rollouts_are_batch_invariant() -> None:
    """The adapters' own matmuls (PEFT's lora_A/lora_B) are padded like the base layers."""
    model = get_peft_model(build("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    randomise_lora_b(model, seed=0)
    assert_invariant(alone_and_batched(model.eval()))


def test_rollout_logprobs_are_within_fp32_rounding_of_the_dense_forward() -> None:
    """What a trainer recomputes: log-softmax of the model's own forward over prompt and completion. Its attention
    (SDPA) sums in another order than the engine's kernel, so the two agree to fp32 rounding, not bit for bit."""
    model = build("llama")
    tokens, logprobs, prompt = run_target(Engine(model, None, EngineConfig(**CONFIG)), PROMPTS[:4] + [TARGET])
    sequence = torch.tensor([TARGET + tokens])
    with torch.no_grad():
        dense = F.log_softmax(model(sequence).logits[0].float(), dim=-1)
    targets = sequence[0, 1:]
    reference = dense[:-1].gather(1, targets[:, None])[:, 0]
    engine = torch.tensor(prompt + logprobs)
    assert (engine - reference).abs().max().item() < 1e-5


def test_padded_rows_give_each_row_its_many_row_sums() -> None:
    layer = torch.nn.Linear(96, 200)
    min_rows = batch_invariant.choose_min_rows(layer)
    assert min_rows in batch_invariant.MIN_ROWS_TRIED
    x = torch.randn(70, 96)
    with torch.no_grad():
        whole = layer(x)
        with batch_invariant.padded_rows(min_rows):
            parts = [layer(x[:rows]) for rows in (1, 2, 3, 5, 11)]
            assert layer(x[None, :3]).shape == (1, 3, 200)
    assert all(torch.equal(part, whole[: len(part)]) for part in parts)


def int4_model():
    model = int4_llama()
    quantize_int4(model)
    return model


@pytest.mark.parametrize("make, config, reason", [
    (lambda: build("gpt2"), {}, "Conv1D"),
    (lambda: build("qwen2_moe"), {}, "outside a linear layer"),
    (int4_model, {}, "quantized"),
    (lambda: build("falcon_h1"), {}, "recurrent layers"),
    (lambda: build("llama"), {"enable_lora": True}, "LoRA slots"),
    (lambda: build("llama"), {"compile": True}, "runs eagerly"),
], ids=["conv1d", "moe", "int4", "recurrent", "lora-slots", "compile"])
def test_the_mode_is_refused_where_it_cannot_hold(make, config, reason) -> None:
    with pytest.raises(ValueError, match=f"batch_invariant=True: .*{reason}"):
        Engine(make(), None, EngineConfig(**CONFIG, **config))


def test_the_mode_is_refused_without_the_cpu_kernel() -> None:
    with cpu_paged_attention.switched_off(), pytest.raises(ValueError, match="CPU attention kernel"):
        Engine(build("llama"), None, EngineConfig(**CONFIG))
