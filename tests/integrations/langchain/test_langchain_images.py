"""ChatPaged with LangChain's image content blocks on a tiny LLaVA: the answer equals LLM.chat's on the same
image (itself checked against HF generate in tests/model/test_vision.py), whichever block shape carries it."""

from __future__ import annotations

import pytest
from helpers.vision import data_url, png_base64, random_image, tiny_llava
from langchain_core.messages import HumanMessage

from paged_backend import LLM, SamplingParams
from paged_backend.entrypoints.async_engine import AsyncEngine
from paged_backend.integrations.langchain import ChatPaged

TOKENS = 6
QUESTION = {"type": "text", "text": "what is in this picture"}


@pytest.fixture(scope="module")
def llava_chat():
    """(ChatPaged on a tiny LLaVA, LLM.chat's answer words for image seed 31, computed before the engine thread)."""
    model, processor = tiny_llava()
    llm = LLM(model, processor)
    image_url = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png_base64(random_image(31))}}
    reference = llm.chat([{"role": "user", "content": [QUESTION, image_url]}],
                         SamplingParams(max_tokens=TOKENS, temperature=0), use_tqdm=False)[0].outputs[0].text
    aengine = AsyncEngine(llm.engine)
    chat = ChatPaged(temperature=0, max_tokens=TOKENS)
    chat._aengine = aengine
    yield chat, reference.split()
    aengine.shutdown()


@pytest.mark.parametrize("block", [
    {"type": "image", "base64": png_base64(random_image(31)), "mime_type": "image/png"},
    {"type": "image", "source_type": "base64", "data": png_base64(random_image(31)), "mime_type": "image/png"},
    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png_base64(random_image(31))}},
])
def test_image_blocks_answer_as_llm_chat(llava_chat, block) -> None:
    chat, reference = llava_chat
    reply = chat.invoke([HumanMessage([QUESTION, block])])
    assert reply.content.split() == reference
    assert reply.usage_metadata["input_tokens"] > 16  # the image's placeholders are counted


def test_an_image_url_to_fetch_is_refused(llava_chat) -> None:
    chat, _ = llava_chat
    with pytest.raises(ValueError, match="is not a data URL"):
        chat.invoke([HumanMessage([QUESTION, {"type": "image", "url": "https://example.com/cat.png"}])])


def test_chat_paged_built_on_a_model_and_its_processor_takes_images() -> None:
    """The documented way: the processor where the tokenizer goes; the adapter builds the engine."""
    model, processor = tiny_llava(seed=1)
    chat = ChatPaged(model=model, tokenizer=processor, temperature=0, max_tokens=TOKENS)
    block = {"type": "image", "base64": png_base64(random_image(32)), "mime_type": "image/png"}
    reply = chat.invoke([HumanMessage([QUESTION, block])])
    assert reply.usage_metadata["input_tokens"] > 16 and reply.usage_metadata["output_tokens"] > 0
    reference = LLM(model, processor).chat(
        [{"role": "user", "content": [QUESTION, {"type": "image_url", "image_url": {
            "url": data_url(random_image(32))}}]}],
        SamplingParams(max_tokens=TOKENS, temperature=0), use_tqdm=False)[0].outputs[0].text
    assert reply.content.split() == reference.split()
