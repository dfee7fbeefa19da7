"""Bad input gets a clear error for that request; the engine keeps serving the others."""

from __future__ import annotations

import pytest
import torch
from helpers.engine import assert_all_blocks_free, greedy, hf_greedy, run_to_completion
from helpers.models import build

from paged_backend import (
    ContextLengthError,
    Engine,
    EngineConfig,
    SamplingParams,
    UnsupportedArchitectureError,
)


@pytest.fixture(scope="module")
def model():
    return build("llama")


@pytest.fixture
def engine(model):
    return Engine(model, None, EngineConfig(num_kv_blocks=64, max_model_len=128))


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], None, "empty"),
        ([1] * 128, None, "context length is 128"),
        ([1, 2, 256], None, "outside the vocabulary"),
        ([1, -3], None, "outside the vocabulary"),
        ("text", None, "needs a tokenizer"),
        ([1, 2.5], None, "int token ids"),
    ],
)
def test_bad_prompt_is_refused_while_others_run(model, engine, prompt, params, message):
    good = engine.add_request([5, 6, 7], greedy(6))
    engine.step()
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, params)
    finals = run_to_completion(engine)
    assert finals[good].outputs[0].token_ids == hf_greedy(model, [5, 6, 7], 6)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(stop="x y".split(" ") + [3]), "stop"),
        (dict(stop=[""]), "stop"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(logprobs=-1), "logprobs"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(n=0), "n"),
        (dict(n=True), "n"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**kwargs)


def test_params_mutated_after_construction_are_revalidated(engine):
    params = SamplingParams()
    params.temperature = -1.0
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request([1, 2], params)
    assert not engine.has_unfinished_requests()


def test_stop_strings_need_a_tokenizer(engine):
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request([1, 2], SamplingParams(stop=["x"]))


def test_abort_mid_generation_frees_blocks_and_reports(model, engine):
    keep = engine.add_request([3, 4, 5], greedy(8))
    gone = engine.add_request([9] * 20, greedy(50))
    for _ in range(3):
        engine.step()
    engine.abort_request(gone)
    finals = run_to_completion(engine)
    assert finals[gone].outputs[0].finish_reason == "abort"
    assert finals[keep].outputs[0].token_ids == hf_greedy(model, [3, 4, 5], 8)
    assert_all_blocks_free(engine)


def test_request_longer_than_the_cache_stops_at_its_length(model):
    engine = Engine(model, None, EngineConfig(num_kv_blocks=4, block_size=4))  # 16 slots in all
    rid = engine.add_request([1, 2, 3], greedy(100))
    out = run_to_completion(engine)[rid].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 16 - 3
    assert_all_blocks_free(engine)


def test_failed_forward_ends_only_that_step(model, monkeypatch):
    engine = Engine(model, None, EngineConfig(num_kv_blocks=64))
    rid = engine.add_request([1, 2, 3], greedy(4))
    monkeypatch.setattr(engine.runner, "execute", lambda batch: (_ for _ in ()).throw(RuntimeError("boom")))
    outputs = engine.step()
    assert outputs[0].request_id == rid and outputs[0].error == "RuntimeError: boom"
    assert outputs[0].outputs[0].finish_reason == "abort"
    monkeypatch.undo()
    again = engine.add_request([1, 2, 3], greedy(4))
    assert run_to_completion(engine)[again].outputs[0].token_ids == hf_greedy(model, [1, 2, 3], 4)
    assert_all_blocks_free(engine)


def test_architecture_without_adapter_refuses_to_run():
    """BLOOM, MPT and Falcon bypass the attention interface and now run through adapters
    (tests/model/test_adapters.py); an architecture with neither is refused, by name."""
    import transformers as tf

    class MadeUpConfig(tf.PretrainedConfig):
        model_type = "made_up_alibi_lm"

    class MadeUpForCausalLM(tf.PreTrainedModel):
        config_class = MadeUpConfig

        def __init__(self, config):
            super().__init__(config)
            self.embed = torch.nn.Embedding(8, 4)

    with pytest.raises(UnsupportedArchitectureError, match="MadeUpForCausalLM.*made_up_alibi_lm"):
        Engine(MadeUpForCausalLM(MadeUpConfig()), None, EngineConfig(num_kv_blocks=8))


def test_encoder_decoder_refuses_to_run():
    import transformers as tf

    model = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                                       num_heads=2))
    with pytest.raises(UnsupportedArchitectureError, match="t5.*encoder-decoder"):
        Engine(model, None, EngineConfig(num_kv_blocks=8))


def test_a_prompt_past_the_context_is_refused_in_one_wording(engine):
    """The engine reserves one generated token; its refusal is the server's (OpenAI's) wording, by type."""
    with pytest.raises(ContextLengthError) as refused:
        engine.add_request([1] * 128, greedy(4))
    assert (refused.value.limit, refused.value.prompt_tokens, refused.value.completion_tokens) == (128, 128, 1)
    assert str(refused.value).startswith("This model's maximum context length is 128 tokens. However, you requested "
                                         "129 tokens (128 in the prompt, 1 in the completion).")
    engine.add_request([1] * 127, greedy(4))  # one token of room is enough: max_tokens is clipped to it
    run_to_completion(engine)
    assert_all_blocks_free(engine)
