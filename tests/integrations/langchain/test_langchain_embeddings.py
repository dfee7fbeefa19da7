"""PagedEmbeddings: LangChain's Embeddings on the shared engine, equal to the HF model's own forward,
sync and async, sharing its engine with a chat model; bad input raises before anything runs."""

from __future__ import annotations

import pytest
import torch
from helpers.server import build_chat_tokenizer, tiny_llama
from langchain_core.embeddings import Embeddings
from paged_backend.integrations.langchain import ChatPaged, PagedEmbeddings

from paged_backend import LLM

pytestmark = pytest.mark.timeout(120)

TEXTS = ["The cat sat on the mat.", "A short one.", "Paged attention keeps blocks of keys and values."]


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer(TEXTS * 3)


@pytest.fixture(scope="module")
def llm(tokenizer) -> LLM:
    return LLM(tiny_llama(tokenizer), tokenizer, num_kv_blocks=16, block_size=4)


def hf_embedding(tokenizer, text: str, pooling: str = "last") -> list[float]:
    with torch.no_grad():
        out = tiny_llama(tokenizer)(torch.tensor([tokenizer(text)["input_ids"]]), output_hidden_states=True)
    hidden = out.hidden_states[-1][0]
    return torch.nn.functional.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=-1).tolist()


def assert_close(got: list[list[float]], want: list[list[float]]) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=2e-5, rtol=1e-4)


def test_documents_and_query_equal_the_hf_forward(llm: LLM, tokenizer) -> None:
    embeddings = PagedEmbeddings(model=llm)
    assert isinstance(embeddings, Embeddings)
    assert_close(embeddings.embed_documents(TEXTS), [hf_embedding(tokenizer, t) for t in TEXTS])
    assert_close([embeddings.embed_query(TEXTS[1])], [hf_embedding(tokenizer, TEXTS[1])])
    mean = PagedEmbeddings(model=llm, pooling="mean")
    assert_close(mean.embed_documents(TEXTS[:1]), [hf_embedding(tokenizer, TEXTS[0], "mean")])


async def test_async_calls(llm: LLM, tokenizer) -> None:
    embeddings = PagedEmbeddings(model=llm)
    assert_close(await embeddings.aembed_documents(TEXTS), [hf_embedding(tokenizer, t) for t in TEXTS])
    assert_close([await embeddings.aembed_query(TEXTS[0])], [hf_embedding(tokenizer, TEXTS[0])])


def test_shares_the_engine_with_a_chat_model(llm: LLM, tokenizer) -> None:
    embeddings, chat = PagedEmbeddings(model=llm), ChatPaged(model=llm, temperature=0, max_tokens=5)
    assert embeddings.client is chat.async_engine
    assert chat.invoke("hi").content is not None
    assert_close(embeddings.embed_documents(TEXTS[:2]), [hf_embedding(tokenizer, t) for t in TEXTS[:2]])


def test_bad_input_raises_before_anything_runs(llm: LLM) -> None:
    embeddings = PagedEmbeddings(model=llm)
    with pytest.raises(ValueError, match=r"text 1: .*maximum context length is 64 tokens.*\(\d+ in the input\)"):
        embeddings.embed_documents(["fine", "x " * 80])
    with pytest.raises(ValueError, match="dimensions=8"):
        PagedEmbeddings(model=llm, dimensions=8).embed_query("hi")
    assert not llm.engine.has_unfinished_requests()
