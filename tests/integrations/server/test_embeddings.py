"""/v1/embeddings through the openai SDK (which asks for base64 and decodes it) and plain HTTP (floats),
against the HF model's own forward, while a chat answer streams on the same engine."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch
from helpers.server import (
    Served,
    build_chat_tokenizer,
    serve,
    tiny_llama,
    wait_all_blocks_free,
)
from paged_backend.integrations.server.embeddings import decode

from paged_backend import LLM

pytestmark = pytest.mark.timeout(120)

TEXTS = ["The cat sat on the mat.", "A short one.", "Paged attention keeps blocks of keys and values."]


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer(TEXTS * 3)


@pytest.fixture(scope="module")
def tiny(tokenizer) -> Iterator[Served]:
    with serve(LLM(tiny_llama(tokenizer), tokenizer, num_kv_blocks=16, block_size=4), "tiny") as served:
        yield served


def hf_embedding(tokenizer, text: str | list[int], pooling: str = "last") -> torch.Tensor:
    ids = tokenizer(text)["input_ids"] if isinstance(text, str) else text
    with torch.no_grad():
        hidden = tiny_llama(tokenizer)(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    return torch.nn.functional.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=-1)


def post(served: Served, **body) -> httpx.Response:
    return httpx.post(f"{served.url}/v1/embeddings", json={"model": "tiny"} | body, timeout=60)


def test_sdk_embeddings_equal_the_hf_forward(tiny: Served, tokenizer) -> None:
    reply = tiny.client().embeddings.create(model="tiny", input=TEXTS)  # the SDK sends encoding_format=base64
    assert [d.index for d in reply.data] == [0, 1, 2] and reply.model == "tiny"
    for item, text in zip(reply.data, TEXTS):
        torch.testing.assert_close(torch.tensor(item.embedding), hf_embedding(tokenizer, text), atol=2e-5, rtol=1e-4)
    assert reply.usage.prompt_tokens == sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)
    wait_all_blocks_free(tiny.aengine)


def test_float_and_base64_carry_the_same_vector(tiny: Served) -> None:
    floats = post(tiny, input=TEXTS[0], encoding_format="float").json()["data"][0]["embedding"]
    encoded = post(tiny, input=TEXTS[0], encoding_format="base64").json()["data"][0]["embedding"]
    assert isinstance(floats, list) and isinstance(encoded, str)
    assert decode(encoded) == pytest.approx(floats, abs=1e-7)


def test_token_ids_and_mean_pooling(tiny: Served, tokenizer) -> None:
    ids = tokenizer(TEXTS[2])["input_ids"]
    one = post(tiny, input=ids, pooling="mean").json()["data"]
    many = post(tiny, input=[ids, ids[:3]]).json()["data"]
    torch.testing.assert_close(torch.tensor(one[0]["embedding"]), hf_embedding(tokenizer, ids, "mean"),
                               atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(many[1]["embedding"]), hf_embedding(tokenizer, ids[:3]),
                               atol=2e-5, rtol=1e-4)


def test_embeddings_beside_a_streaming_chat(tiny: Served, tokenizer) -> None:
    def chat() -> None:
        stream = tiny.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=40, temperature=0, stream=True)
        texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))

    texts: list[str] = []
    thread = threading.Thread(target=chat)
    thread.start()
    reply = tiny.client().embeddings.create(model="tiny", input=TEXTS * 4)
    thread.join(60)
    assert len(texts) == 1
    want = [hf_embedding(tokenizer, t) for t in TEXTS]
    for i, item in enumerate(reply.data):
        torch.testing.assert_close(torch.tensor(item.embedding), want[i % 3], atol=2e-5, rtol=1e-4)
    wait_all_blocks_free(tiny.aengine)


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"input": TEXTS[0], "dimensions": 16}, "dimensions", None),
    ({"input": [1] * 65}, "input", "context_length_exceeded"),
    ({"input": ["ok", "x " * 80]}, "input", "context_length_exceeded"),
    ({"input": []}, "input", None),
    ({"input": ""}, "input", None),
    ({"input": [10**6]}, "input", None),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", None),
    ({"input": "hi", "pooling": "cls"}, "pooling", None),
    ({"input": "hi", "model": "other"}, "model", "model_not_found"),
])
def test_bad_input_is_a_4xx_naming_the_field(tiny: Served, body: dict, param: str, code: str | None) -> None:
    reply = post(tiny, **body)
    assert 400 <= reply.status_code < 500, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and (code is None or error["code"] == code), error
    wait_all_blocks_free(tiny.aengine)


def test_the_sdk_raises_for_dimensions(tiny: Served) -> None:
    with pytest.raises(openai.BadRequestError, match="not trained to be truncated"):
        tiny.client().embeddings.create(model="tiny", input="hi", dimensions=8)
    assert len(tiny.client().embeddings.create(model="tiny", input="hi", dimensions=64).data[0].embedding) == 64
