"""Images through the server's chat routes: OpenAI `image_url` parts, Responses `input_image` parts and Anthropic
image blocks, as data URLs, on a tiny LLaVA; greedy answers equal LLM.chat's (itself checked against HF generate
in tests/model/test_vision.py), bad images are 400s naming the part, and the other requests run on."""

from __future__ import annotations

import httpx
import pytest
from helpers.server import serve, wait_all_blocks_free
from helpers.vision import data_url, random_image, tiny_llava

from paged_backend import LLM, SamplingParams

TOKENS = 6


SEEDS = (21, 22, 23)


@pytest.fixture(scope="module")
def served():
    """The server, and LLM.chat's greedy answer (its words) to the same conversation for each image seed, computed
    before the server's engine thread steps the engine."""
    model, processor = tiny_llava()
    llm = LLM(model, processor)
    # The Messages route has no ignore_eos: its reference stops at EOS as the route does.
    answers = {seed: words(llm, reference(llm, random_image(seed), ignore_eos=seed != 23)) for seed in SEEDS}
    with serve(llm, "tiny-llava") as served:
        yield served, answers


def reference(llm: LLM, image, ignore_eos: bool) -> list[int]:
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is in this picture"},
                                             {"type": "image_url", "image_url": {"url": data_url(image)}}]}]
    return llm.chat(messages, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=ignore_eos),
                    use_tqdm=False)[0].outputs[0].token_ids


def words(llm: LLM, token_ids: list[int]) -> list[str]:
    """The answer's words (the word-level test tokenizer's streamed text differs from a whole decode in spaces)."""
    return llm.tokenizer.decode(token_ids, skip_special_tokens=True).split()


def test_chat_completions_with_an_image_url_part(served) -> None:
    served, answers = served
    image = random_image(21)
    reply = served.client().chat.completions.create(
        model="tiny-llava", max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "text", "text": "what is in this picture"},
                                               {"type": "image_url", "image_url": {"url": data_url(image)}}]}])
    assert reply.choices[0].message.content.split() == answers[21]
    assert reply.usage.prompt_tokens > 16  # the image's 16 placeholders are counted


def test_responses_with_an_input_image_part(served) -> None:
    served, answers = served
    image = random_image(22)
    response = served.client().responses.create(
        model="tiny-llava", max_output_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True},
        input=[{"role": "user", "content": [{"type": "input_text", "text": "what is in this picture"},
                                            {"type": "input_image", "image_url": data_url(image)}]}])
    assert response.output_text.split() == answers[22]


def test_messages_with_an_anthropic_image_block(served) -> None:
    served, answers = served
    image = random_image(23)
    png = data_url(image).split(",", 1)[1]
    reply = httpx.post(f"{served.url}/v1/messages", headers={"x-api-key": "test-key"}, timeout=60, json={
        "model": "tiny-llava", "max_tokens": TOKENS, "temperature": 0,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is in this picture"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}]}]})
    assert reply.status_code == 200, reply.text
    text = "".join(block["text"] for block in reply.json()["content"] if block["type"] == "text")
    assert text.split() == answers[23]


@pytest.mark.parametrize(("url", "error"), [
    ("https://example.com/cat.png", "is not a data URL"),
    ("data:image/png;base64,aGVsbG8=", "not a readable image"),
])
def test_a_bad_image_is_a_400_and_the_engine_runs_on(served, url, error) -> None:
    served, answers = served
    reply = httpx.post(f"{served.url}/v1/chat/completions", headers={"Authorization": "Bearer test-key"}, timeout=60,
                       json={"model": "tiny-llava", "max_tokens": 2, "messages": [{"role": "user", "content": [
                           {"type": "image_url", "image_url": {"url": url}}]}]})
    assert reply.status_code == 400, reply.text
    assert error in reply.json()["error"]["message"]
    assert reply.json()["error"]["param"] == "messages"
    wait_all_blocks_free(served.aengine)
    image = random_image(24)
    ok = served.client().chat.completions.create(
        model="tiny-llava", max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}}]}])
    assert ok.choices[0].finish_reason == "length"
