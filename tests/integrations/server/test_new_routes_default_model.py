"""The Responses, Messages and embeddings routes on the default model (SmolLM2-135M-Instruct): real text
through the real chat template and EOS, streamed and not alike."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import pytest
import torch
from helpers.server import Served, serve, wait_all_blocks_free

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

QUESTION = "What is the capital of France? Answer in one word."


@pytest.fixture(scope="module")
def real(default_llm) -> Iterator[Served]:
    with serve(default_llm, "smollm2") as served:
        yield served


def test_responses_plain_and_streamed_give_the_same_answer(real: Served) -> None:
    client = real.client()
    whole = client.responses.create(model="smollm2", input=QUESTION, temperature=0, max_output_tokens=16)
    assert whole.status == "completed" and "Paris" in whole.output_text
    with client.responses.stream(model="smollm2", input=QUESTION, temperature=0, max_output_tokens=16) as stream:
        streamed = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert streamed == whole.output_text
    follow = client.responses.create(model="smollm2", previous_response_id=whole.id, temperature=0,
                                     input="And of Italy?", max_output_tokens=16)
    assert follow.usage.input_tokens > whole.usage.input_tokens + whole.usage.output_tokens
    assert "Rome" in follow.output_text


def test_messages_plain_and_streamed_give_the_same_answer(real: Served) -> None:
    client = anthropic.Anthropic(base_url=real.url, api_key="unused", max_retries=0)
    args = {"model": "smollm2", "max_tokens": 16, "messages": [{"role": "user", "content": QUESTION}],
            "extra_body": {"temperature": 0}}
    whole = client.messages.create(**args)
    assert "Paris" in whole.content[0].text and whole.stop_reason == "end_turn"
    with client.messages.stream(**args) as stream:
        assert "".join(stream.text_stream) == whole.content[0].text


def test_embeddings_are_unit_vectors_equal_to_llm_embed(real: Served, default_llm) -> None:
    texts = ["The cat sat on the mat.", "A kitten was sitting on the rug.", "Interest rates rose by half a point."]
    reply = real.client().embeddings.create(model="smollm2", input=texts)
    vectors = torch.tensor([item.embedding for item in reply.data])
    assert vectors.shape == (3, 576) and torch.allclose(vectors.norm(dim=1), torch.ones(3), atol=1e-5)
    offline = torch.stack([o.embedding for o in default_llm.embed(texts, use_tqdm=False)])
    torch.testing.assert_close(vectors, offline, atol=1e-6, rtol=1e-5)
    wait_all_blocks_free(real.aengine)
