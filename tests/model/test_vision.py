"""Vision-language models through the engine: images encoded by the model's own tower, their rows merged at the
placeholders, the language model paged; HF generate's greedy tokens with the same pixels (fp32) as the oracle."""

from __future__ import annotations

import base64
import http.server
import threading

import pytest
import torch
from helpers.vision import data_url, hf_greedy, random_image, tiny_llava

from paged_backend import LLM, SamplingParams

TOKENS = 8
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
ONE = "user : <image> \n describe the image assistant :"
TWO = "user : what is in this picture <image> and <image> \n assistant :"
TEXT = "user : describe the sky \n assistant :"


@pytest.fixture(scope="module")
def llava():
    return tiny_llava()


def image_prompt(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}}


def tokens(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def check_paged_generate(model, processor, texts: list[str], images: list) -> tuple[dict, torch.Tensor]:
    """`model.generate(**processor(...), cache_implementation="paged")` on a left-padded batch equals plain
    `generate` (greedy, eos banned); (the processor's inputs, the reference) for further checks."""
    import paged_backend  # noqa: F401  (enables cache_implementation="paged")

    processor.tokenizer.padding_side = "left"
    inputs = processor(text=texts, images=images, return_tensors="pt", padding=True)
    with torch.no_grad():
        reference = model.generate(**inputs, max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False)
        paged = model.generate(**inputs, max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False,
                               cache_implementation="paged")
    assert paged.tolist() == reference.tolist()
    return inputs, reference


def test_one_image_alone_equals_hf(llava) -> None:
    model, processor = llava
    image = random_image(1)
    llm = LLM(model, processor)
    assert tokens(llm.generate(image_prompt(ONE, image), GREEDY)) == [hf_greedy(model, processor, ONE, [image], TOKENS)]


def test_mixed_batch_with_chunked_prefill_and_preemption_equals_hf(llava) -> None:
    """Text-only and image requests in one batch; chunks of 12 tokens cut through every 16-token image, and a
    cache of 12 blocks of 4 preempts requests, which recompute their images' rows from the encoder cache."""
    model, processor = llava
    cases = [(ONE, [random_image(1)]), (TWO, [random_image(2), random_image(3, 64, 32)]), (TEXT, []),
             (ONE, [random_image(4, 32, 32)]), (TWO, [random_image(5), random_image(1)])]
    expected = [hf_greedy(model, processor, text, images, TOKENS) for text, images in cases]
    llm = LLM(model, processor, block_size=4, num_kv_blocks=24, max_num_batched_tokens=12, max_num_seqs=4,
              preemption_mode="recompute")
    got = tokens(llm.generate([image_prompt(text, images) for text, images in cases], GREEDY))
    assert got == expected
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_a_repeated_image_is_encoded_once_and_shares_its_blocks(llava) -> None:
    model, processor = llava
    image = random_image(7)
    llm = LLM(model, processor, block_size=4)
    first = tokens(llm.generate(image_prompt(ONE, [image]), GREEDY))
    before = llm.engine.stats()
    again = tokens(llm.generate(image_prompt(ONE, [image.copy()]), GREEDY))
    after = llm.engine.stats()
    assert again == first
    assert (before["images_encoded"], after["images_encoded"]) == (1, 1)
    assert after["encoder_cache_hits"] == before["encoder_cache_hits"]  # the whole prompt came from the prefix cache
    prompt_blocks = len(processor(text=ONE, images=[image])["input_ids"][0]) // 4
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == 4 * prompt_blocks


def test_a_different_image_with_the_same_text_shares_no_image_block(llava) -> None:
    """Without the image's digest in the block keys, the second prompt (equal tokens) would take the first one's
    image blocks and answer about the first image."""
    model, processor = llava
    first_image, second_image = random_image(8), random_image(9)
    llm = LLM(model, processor, block_size=4)
    llm.generate(image_prompt(ONE, [first_image]), GREEDY)
    before = llm.engine.stats()["prefix_cache_hit_tokens"]
    got = tokens(llm.generate(image_prompt(ONE, [second_image]), GREEDY))
    hit = llm.engine.stats()["prefix_cache_hit_tokens"] - before
    ids = processor(text=ONE, images=[second_image], return_tensors="pt")["input_ids"][0].tolist()
    assert hit == 4 * (ids.index(model.config.image_token_id) // 4)  # the text blocks before the image only
    assert got == [hf_greedy(model, processor, ONE, [second_image], TOKENS)]
    assert llm.engine.stats()["images_encoded"] == 2


def test_the_encoder_cache_is_bounded_and_re_encodes_what_it_dropped(llava) -> None:
    model, processor = llava
    llm = LLM(model, processor, enable_prefix_caching=False)
    cache = llm.engine.runner.images.cache
    cache.max_bytes = 16 * 64 * 4  # one image's rows (16 tokens of 64 fp32)
    images = [random_image(10), random_image(11)]
    expected = [hf_greedy(model, processor, ONE, [image], TOKENS) for image in images]
    for _ in range(2):
        assert tokens(llm.generate([image_prompt(ONE, [image]) for image in images], GREEDY)) == expected
    assert len(cache) == 1 and cache.bytes <= cache.max_bytes
    # The first batch encodes both, keeping the second; the second batch finds it and encodes the first again.
    stats = llm.engine.stats()
    assert (stats["images_encoded"], stats["encoder_cache_hits"]) == (3, 1)


@pytest.mark.parametrize(("prompt", "error"), [
    (image_prompt(ONE, [random_image(1), random_image(2)]), "processor refused.*1 <image> tokens and 2 images"),
    (image_prompt(TWO, [random_image(1)]), "processor refused.*2 <image> tokens and 1 images"),
    ({"prompt": ONE, "multi_modal_data": {"video": []}}, "'multi_modal_data' takes 'image'"),
    ({"prompt": ONE, "images": []}, "not ['images']"),
    ({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": []}}, "not ['prompt_token_ids']"),
    (image_prompt(ONE, ["not an image"]), "image 0: 'not an image' is not a data URL"),
    (image_prompt(ONE, [b"not an image"]), "image 0: not a readable image"),
    (image_prompt(ONE, [3]), "image 0: expected a PIL image, an array, bytes or a data URL, got int"),
])
def test_bad_prompts_with_images_are_refused_and_the_batch_runs_on(llava, prompt, error) -> None:
    model, processor = llava
    llm = LLM(model, processor)
    with pytest.raises(ValueError, match=r"prompt 1: .*" + error.replace("[", r"\[")):
        llm.generate([image_prompt(ONE, [random_image(1)]), prompt], GREEDY)
    assert llm.engine.stats()["num_waiting"] == 0  # nothing of the batch was queued
    assert tokens(llm.generate(image_prompt(ONE, [random_image(1)]), GREEDY)) == [
        hf_greedy(model, processor, ONE, [random_image(1)], TOKENS)]
    stats = llm.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_a_processor_that_expands_images_to_other_counts_is_refused(llava) -> None:
    """A processor whose placeholders per image differ from what the vision tower gives: refused up front, rather
    than rows landing on the wrong positions."""
    model, processor = llava
    wrong = type(processor)(image_processor=processor.image_processor, tokenizer=processor.tokenizer, patch_size=8,
                            vision_feature_select_strategy="default", num_additional_image_tokens=2,
                            image_token="<image>")
    llm = LLM(model, wrong)
    with pytest.raises(ValueError, match="the prompt has 17 image placeholder tokens where its 1 images fill 16"):
        llm.generate(image_prompt(ONE, [random_image(1)]), GREEDY)


def test_truncating_a_prompt_with_images_is_refused(llava) -> None:
    model, processor = llava
    llm = LLM(model, processor)
    with pytest.raises(ValueError, match="truncate_prompt_tokens cannot cut a prompt with images"):
        llm.generate(image_prompt(ONE, [random_image(1)]), SamplingParams(max_tokens=2, truncate_prompt_tokens=8))


def test_a_text_only_model_refuses_images_naming_it() -> None:
    from helpers.server import build_chat_tokenizer, tiny_llama

    tokenizer = build_chat_tokenizer(["describe the image"] * 3)
    llm = LLM(tiny_llama(tokenizer), tokenizer)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM \(model_type='llama'\) does not take images: it is a "
                                         "text-only model"):
        llm.generate(image_prompt("describe the image", [random_image(1)]), GREEDY)


def test_images_without_the_processor_are_refused(llava) -> None:
    model, processor = llava
    llm = LLM(model, processor.tokenizer)
    with pytest.raises(ValueError, match="needs the model's processor"):
        llm.generate(image_prompt(ONE, [random_image(1)]), GREEDY)
    assert tokens(llm.generate(TEXT, GREEDY)) == [hf_greedy(model, processor, TEXT, [], TOKENS)]


def test_embedding_requests_refuse_images(llava) -> None:
    model, processor = llava
    llm = LLM(model, processor)
    with pytest.raises(ValueError, match="embedding request takes text or token ids, not images"):
        llm.engine.add_pooling_request(image_prompt(ONE, [random_image(1)]))


def chat_with_images(*images) -> list[dict]:
    parts = [{"type": "text", "text": "what is in this picture"}]
    parts += [{"type": "image_url", "image_url": {"url": image}} for image in images]
    return [{"role": "user", "content": parts}]


def test_chat_with_image_parts_equals_hf_on_the_processor_template(llava) -> None:
    """OpenAI-shaped image parts (data URLs) through LLM.chat: the processor's chat template (the tokenizer has
    none) puts the image token where each part was; the tokens equal HF generate on the same rendered text."""
    model, processor = llava
    images = [random_image(12), random_image(13, 30, 50)]
    llm = LLM(model, processor)
    got = tokens(llm.chat([chat_with_images(data_url(images[0])), chat_with_images(*map(data_url, images))],
                          GREEDY))
    for output, shown in zip(got, ([images[0]], images)):
        messages = [{"role": "user", "content": [{"type": "text", "text": "what is in this picture"}]
                     + [{"type": "image"} for _ in shown]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert text.count("<image>") == len(shown)
        inputs = processor(text=text, images=shown, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False)
        assert output == out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize(("url", "error"), [
    ("https://example.com/cat.png", "is not a data URL; images are sent inline"),
    ("data:image/png;base64,@@@", "its data URL is not valid base64"),
    ("data:image/png;base64,aGVsbG8=", "image 0: not a readable image"),
])
def test_chat_refuses_images_it_cannot_read(llava, url, error) -> None:
    model, processor = llava
    llm = LLM(model, processor)
    with pytest.raises(ValueError, match=error):
        llm.chat(chat_with_images(url), GREEDY)
    assert llm.engine.stats()["num_waiting"] == 0


def test_chat_with_an_image_on_a_text_only_model_is_refused() -> None:
    from helpers.server import build_chat_tokenizer, tiny_llama

    tokenizer = build_chat_tokenizer(["what is in this picture"] * 3)
    llm = LLM(tiny_llama(tokenizer), tokenizer)
    with pytest.raises(ValueError, match="content part of type 'image_url': this is a text-only model"):
        llm.chat(chat_with_images(data_url(random_image(1))), GREEDY)


def test_an_image_of_too_many_pixels_is_refused(llava, monkeypatch) -> None:
    from paged_backend import image_sources

    model, processor = llava
    monkeypatch.setattr(image_sources, "MAX_PIXELS", 40 * 48 - 1)
    llm = LLM(model, processor)
    with pytest.raises(ValueError, match="image 0: 48x40 pixels, more than 1919"):
        llm.chat(chat_with_images(data_url(random_image(1))), GREEDY)


def test_generate_with_pixel_values_on_the_paged_cache_equals_hf(llava) -> None:
    """`model.generate(**processor(...), cache_implementation="paged")` on a padded batch: rows without an image,
    with one and with two, the images dealt out to the rows in order; num_return_sequences repeats each row's."""
    model, processor = llava
    inputs, reference = check_paged_generate(model, processor, [TWO, TEXT, ONE],
                                             [random_image(41), random_image(42, 30, 60), random_image(43)])
    with torch.no_grad():
        repeated = model.generate(**inputs, max_new_tokens=TOKENS, do_sample=True, top_k=1, num_return_sequences=2,
                                  min_new_tokens=TOKENS, cache_implementation="paged")  # top_k=1: the greedy tokens
    assert repeated.tolist() == reference.repeat_interleave(2, dim=0).tolist()


def test_generate_refuses_pixel_values_that_do_not_fill_the_rows(llava) -> None:
    import paged_backend  # noqa: F401

    model, processor = llava
    inputs = processor(text=[ONE], images=[random_image(44)], return_tensors="pt")
    two = torch.cat([inputs["pixel_values"], inputs["pixel_values"]])
    with pytest.raises(ValueError, match="2 images for 1 images' placeholders in the rows"):
        model.generate(input_ids=inputs["input_ids"], pixel_values=two, max_new_tokens=2,
                       cache_implementation="paged")


def test_the_image_text_to_text_pipeline_swap_answers_as_the_stock_one(llava) -> None:
    """paged_backend.pipeline("image-text-to-text") against transformers' own pipeline: chat inputs with images,
    several at once (one continuous batch), the same generated text."""
    import transformers

    from paged_backend import PagedImageTextToTextPipeline, pipeline

    model, processor = llava
    chats = [[{"role": "user", "content": [{"type": "image", "image": random_image(seed)},
                                           {"type": "text", "text": "what is in this picture"}]}]
             for seed in (51, 52, 53)]
    options = {"max_new_tokens": TOKENS, "generate_kwargs": {"do_sample": False, "min_new_tokens": TOKENS}}
    stock = transformers.pipeline("image-text-to-text", model=model, processor=processor)
    paged = pipeline("image-text-to-text", model=model, processor=processor)
    assert isinstance(paged, PagedImageTextToTextPipeline)
    expected = [stock(text=chat, **options)[0]["generated_text"] for chat in chats]
    assert [out[0]["generated_text"] for out in paged(text=chats, **options)] == expected


# ---------------------------------------------------------------------- Qwen2-VL: multi-axis positions (M-RoPE)

QWEN_ONE = "<|im_start|> user <|vision_start|><|image_pad|><|vision_end|> describe the image <|im_end|> <|im_start|> assistant"
QWEN_TWO = ("<|im_start|> user <|vision_start|><|image_pad|><|vision_end|> and <|vision_start|><|image_pad|><|vision_end|>"
            " what is in this picture <|im_end|> <|im_start|> assistant")
QWEN_TEXT = "<|im_start|> user describe the sky <|im_end|> <|im_start|> assistant"


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen2_vl(request):
    from helpers.vision import tiny_qwen2_vl

    return tiny_qwen2_vl(v25=request.param == "qwen2_5_vl")


def test_qwen2_vl_mixed_batch_with_chunks_and_preemption_equals_hf(qwen2_vl) -> None:
    """Images of different sizes (6 and 8 tokens), two in one prompt, beside a text-only request: each token's three
    positions come from the model's own rope index (text after an image advances by less than its token count, so
    every decode step's positions differ from its sequence index); chunks of 5 tokens cut through the images and a
    small cache preempts requests, which recompute their positions and rows."""
    model, processor = qwen2_vl
    cases = [(QWEN_ONE, [random_image(1)]), (QWEN_TWO, [random_image(2, 64, 32), random_image(3)]), (QWEN_TEXT, []),
             (QWEN_ONE, [random_image(4, 60, 60)])]
    expected = [hf_greedy(model, processor, text, images, TOKENS) for text, images in cases]
    alone = LLM(model, processor)
    assert tokens(alone.generate(image_prompt(*cases[1]), GREEDY)) == [expected[1]]
    llm = LLM(model, processor, block_size=4, num_kv_blocks=16, max_num_batched_tokens=5, max_num_seqs=3,
              preemption_mode="recompute")
    assert tokens(llm.generate([image_prompt(text, images) for text, images in cases], GREEDY)) == expected
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_qwen2_vl_logprobs_equal_hf_within_fp32_rounding(qwen2_vl) -> None:
    """Tokens alone can hide wrong positions in a tiny model; the logprobs do not: with 1-D positions in place of the
    three axes they part from HF's by more than 1e-3, here they agree to about 5e-7."""
    from helpers.vision import hf_greedy_logprobs

    model, processor = qwen2_vl
    cases = [(QWEN_ONE, [random_image(1)]), (QWEN_TWO, [random_image(2, 64, 32), random_image(3)])]
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    outputs = LLM(model, processor).generate([image_prompt(text, images) for text, images in cases], params)
    for (text, images), output in zip(cases, outputs):
        expected, logprobs = hf_greedy_logprobs(model, processor, text, images, TOKENS)
        sample = output.outputs[0]
        assert sample.token_ids == expected
        got = [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)]
        assert max(abs(a - b) for a, b in zip(got, logprobs)) < 1e-4


def test_qwen2_vl_a_repeated_image_is_encoded_once_and_another_shares_no_image_block(qwen2_vl) -> None:
    model, processor = qwen2_vl
    first, second = random_image(5), random_image(6)
    llm = LLM(model, processor, block_size=4)
    llm.generate(image_prompt(QWEN_ONE, [first]), GREEDY)
    before = llm.engine.stats()
    again = tokens(llm.generate(image_prompt(QWEN_ONE, [first]), GREEDY))
    other = tokens(llm.generate(image_prompt(QWEN_ONE, [second]), GREEDY))
    stats = llm.engine.stats()
    assert again == [hf_greedy(model, processor, QWEN_ONE, [first], TOKENS)]
    assert other == [hf_greedy(model, processor, QWEN_ONE, [second], TOKENS)]
    assert (before["images_encoded"], stats["images_encoded"]) == (1, 2)


def test_qwen2_vl_generate_with_pixel_values_equals_hf(qwen2_vl) -> None:
    model, processor = qwen2_vl
    check_paged_generate(model, processor, [QWEN_TWO, QWEN_TEXT, QWEN_ONE],
                         [random_image(7), random_image(8, 30, 60), random_image(9)])


# ---------------------------------------------------------------------- Idefics3: images cut into crops

IDEFICS_ONE = "<s> user : <image> describe the image <end_of_utterance> assistant :"
IDEFICS_TWO = "<s> user : <image> and <image> what is in this picture <end_of_utterance> assistant :"
IDEFICS_TEXT = "<s> user : describe the sky <end_of_utterance> assistant :"


@pytest.fixture(scope="module")
def idefics3():
    from helpers.vision import tiny_idefics3

    return tiny_idefics3(seed=2)  # a seed whose greedy answers depend on the image


def test_idefics3_mixed_batch_with_chunks_and_preemption_equals_hf(idefics3) -> None:
    """Images of 5 crops (2x2 tiles and the whole image) and of 1 crop, their placeholders between row and column
    tags, two in one prompt (encoded together), beside a text-only request; chunks of 7 tokens cut through the
    crops and a small cache preempts."""
    model, processor = idefics3
    cases = [(IDEFICS_ONE, [random_image(1)]), (IDEFICS_TWO, [random_image(2, 64, 32), random_image(3, 20, 20)]),
             (IDEFICS_TEXT, []), (IDEFICS_ONE, [random_image(4, 30, 30)])]
    expected = [hf_greedy(model, processor, text, images, TOKENS) for text, images in cases]
    llm = LLM(model, processor, block_size=4, num_kv_blocks=20, max_num_batched_tokens=7, max_num_seqs=3,
              preemption_mode="recompute")
    assert tokens(llm.generate([image_prompt(text, images) for text, images in cases], GREEDY)) == expected
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_idefics3_generate_with_pixel_values_equals_hf(idefics3) -> None:
    """A padded batch: the processor pads each row's crops to the batch's most with all-zero crops, which the engine
    drops as the model does; the text-only row has none."""
    model, processor = idefics3
    check_paged_generate(model, processor, [IDEFICS_TWO, IDEFICS_TEXT, IDEFICS_ONE],
                         [[random_image(5), random_image(6, 20, 30)], [], [random_image(7)]])


# ---------------------------------------------------------------------- Gemma 3: image tokens attend both ways

GEMMA_ONE = "<bos> <start_of_turn> user <start_of_image> describe the image <end_of_turn> <start_of_turn> model"
GEMMA_TWO = ("<bos> <start_of_turn> user <start_of_image> and <start_of_image> what is in this picture <end_of_turn> "
             "<start_of_turn> model")
GEMMA_TEXT = "<bos> <start_of_turn> user describe the sky <end_of_turn> <start_of_turn> model"


@pytest.fixture(scope="module")
def gemma3():
    from helpers.vision import tiny_gemma3

    return tiny_gemma3()


def test_gemma3_mixed_batch_with_chunks_and_preemption_equals_hf(gemma3) -> None:
    """16-token images whose tokens attend both ways, under a sliding window of 8, in a 20-token step budget: the
    scheduler ends a chunk before an image it cannot finish, and each image's queries see all its keys (without
    either, the second prompt's answer parts from HF's); a small cache preempts."""
    model, processor = gemma3
    cases = [(GEMMA_ONE, [random_image(1)]), (GEMMA_TWO, [random_image(2, 64, 32), random_image(3, 20, 20)]),
             (GEMMA_TEXT, []), (GEMMA_ONE, [random_image(5)])]
    expected = [hf_greedy(model, processor, text, images, TOKENS) for text, images in cases]
    llm = LLM(model, processor, block_size=4, num_kv_blocks=16, max_num_batched_tokens=20, max_num_seqs=3,
              preemption_mode="recompute")
    assert tokens(llm.generate([image_prompt(text, images) for text, images in cases], GREEDY)) == expected
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_gemma3_a_prefix_hit_inside_an_image_computes_the_rest_of_it_in_one_step(gemma3) -> None:
    """The same prompt again: its cached blocks end inside the image (blocks of 4), and the rest of the image is
    computed in one step, seeing the cached keys of its start."""
    model, processor = gemma3
    image = random_image(6)
    llm = LLM(model, processor, block_size=4, max_num_batched_tokens=20)
    first = tokens(llm.generate(image_prompt(GEMMA_ONE, [image]), GREEDY))
    again = tokens(llm.generate(image_prompt(GEMMA_ONE, [image]), GREEDY))
    assert first == again == [hf_greedy(model, processor, GEMMA_ONE, [image], TOKENS)]
    assert llm.engine.stats()["prefix_cache_hit_tokens"] > 0


def test_gemma3_refuses_an_image_longer_than_a_step(gemma3) -> None:
    model, processor = gemma3
    llm = LLM(model, processor, max_num_batched_tokens=12)
    with pytest.raises(ValueError, match="an image of 16 tokens, which Gemma3ForConditionalGeneration computes in one "
                                         "step, is more than max_num_batched_tokens=12"):
        llm.generate(image_prompt(GEMMA_ONE, [random_image(1)]), GREEDY)


def test_gemma3_generate_with_pixel_values_equals_hf(gemma3) -> None:
    model, processor = gemma3
    check_paged_generate(model, processor, [GEMMA_TWO, GEMMA_TEXT, GEMMA_ONE],
                         [[random_image(7), random_image(8, 30, 60)], [], [random_image(9)]])


# ---------------------------------------------------------------------- web addresses, where the deployer allows them


@pytest.fixture
def image_host():
    """A web server on 127.0.0.1 serving /cat.png (a PNG of random_image(61)), /big.png (over the size limit) and
    /moved.png (a redirect to /cat.png); yields its base URL."""
    body = base64.b64decode(data_url(random_image(61)).split(",", 1)[1])

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802  (the http.server hook's name)
            if self.path == "/moved.png":
                self.send_response(302)
                self.send_header("Location", "/cat.png")
                self.end_headers()
                return
            data = body if self.path == "/cat.png" else b"x" * (21 * 2**20)
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_images_from_an_allowed_host_are_fetched_others_refused(llava, image_host) -> None:
    model, processor = llava
    llm = LLM(model, processor, allowed_image_domains=["127.0.0.1"])
    got = tokens(llm.chat(chat_with_images(f"{image_host}/cat.png"), GREEDY))
    assert got == tokens(llm.chat(chat_with_images(data_url(random_image(61))), GREEDY))
    with pytest.raises(ValueError, match="holds more than the 20971520 bytes an image may have"):
        llm.chat(chat_with_images(f"{image_host}/big.png"), GREEDY)
    with pytest.raises(ValueError, match="fetching .*moved.png' failed: HTTP Error 302"):
        llm.chat(chat_with_images(f"{image_host}/moved.png"), GREEDY)
    closed = LLM(model, processor)
    with pytest.raises(ValueError, match="the deployer did not allow"):
        closed.chat(chat_with_images(f"{image_host}/cat.png"), GREEDY)
