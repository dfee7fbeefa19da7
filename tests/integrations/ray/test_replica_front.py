"""The Ray client's front checks requests with the engine's own input processor: it refuses what one engine
refuses, with the same message, before a request travels (no cluster needed)."""

from __future__ import annotations

import pytest
from helpers.models import build

from paged_backend import Engine, EngineConfig, PoolingParams, SamplingParams
from paged_backend.input_processor import InputProcessor

replica = pytest.importorskip("paged_backend.integrations.ray.replica")  # these need ray
replica_front = pytest.importorskip("paged_backend.integrations.ray.replica_front")

REFUSED = [
    ([], SamplingParams()),
    ([10**6], SamplingParams()),
    (list(range(1, 70)), SamplingParams()),
    ([1, 2], SamplingParams(stop=["x"])),  # stop strings need a tokenizer, which this engine has not
]


def front_of(engine: Engine):
    info = replica.ReplicaInfo(engine.max_model_len, engine.vocab_size, engine.config.block_size,
                               engine.config.max_num_seqs, engine.tokenizer, "host", 0, str(engine.device),
                               engine.eos_token_ids, engine.plan.context_note, False, engine.hidden_size,
                               engine.embedding_sizes)
    return replica_front.ReplicaFront([info], [], router=None)


def test_the_front_refuses_what_the_engine_refuses_with_its_words() -> None:
    engine = Engine(build("llama"), config=EngineConfig(num_kv_blocks=16, max_model_len=64))
    front = front_of(engine)
    assert isinstance(front.inputs, InputProcessor)
    for token_ids, params in REFUSED:
        with pytest.raises(ValueError) as by_engine:
            engine.add_request(token_ids, params)
        with pytest.raises(ValueError) as by_front:
            front.validate(token_ids, params)
        assert str(by_front.value) == str(by_engine.value)
    with pytest.raises(ValueError) as by_engine:
        engine.add_pooling_request([1] * 65, PoolingParams())
    with pytest.raises(ValueError) as by_front:
        front.validate_pooling([1] * 65, PoolingParams())
    assert str(by_front.value) == str(by_engine.value)
    front.validate([1, 2, 3], SamplingParams(max_tokens=4))  # a good one passes
    assert not engine.has_unfinished_requests()
