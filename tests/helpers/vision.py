"""Tiny vision-language models built in-process, with their processors: a word-level tokenizer holding the
image token, the family's image processor sized to the tiny vision tower, and seeded random images."""

from __future__ import annotations

import base64
import io

import numpy as np
import torch
import transformers as tf
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<image>"]
WORDS = "user assistant describe the image what is in this picture a cat dog red green blue sky and two".split()
VOCAB = 300
IMAGE_SIZE, PATCH = 32, 8
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} :{% if m['content'] is string %} {{ m['content'] }}"
                 "{% else %}{% for part in m['content'] %}{% if part['type'] == 'image' %} <image>"
                 "{% else %} {{ part['text'] }}{% endif %}{% endfor %}{% endif %} \n{% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")


def word_tokenizer() -> tf.PreTrainedTokenizerFast:
    words = SPECIALS + sorted(set(WORDS)) + ["\n", ":"]
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    tokenizer = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(SPECIALS)
    return tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                      pad_token="<pad>", unk_token="<unk>",
                                      extra_special_tokens={"image_token": "<image>"})


def tiny_llava(seed: int = 0, vision: tuple[int, int] = (32, 2), text: tuple[int, int] = (64, 2),
               image_size: int = IMAGE_SIZE, patch: int = PATCH) -> tuple[tf.LlavaForConditionalGeneration,
                                                                          tf.LlavaProcessor]:
    """A random LLaVA, fp32, with its processor: by default a 2-layer CLIP tower of width 32 giving 16 image tokens
    and a 2-layer Llama of width 64; `vision` and `text` are (width, layers), for larger ones (the benchmark)."""
    tokenizer = word_tokenizer()
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    (vision_width, vision_layers), (text_width, text_layers) = vision, text
    config = tf.LlavaConfig(
        vision_config=tf.CLIPVisionConfig(hidden_size=vision_width, intermediate_size=2 * vision_width,
                                          num_hidden_layers=vision_layers, num_attention_heads=2,
                                          image_size=image_size, patch_size=patch, projection_dim=vision_width),
        text_config=tf.LlamaConfig(vocab_size=VOCAB, hidden_size=text_width, intermediate_size=2 * text_width,
                                   num_hidden_layers=text_layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0),
        image_token_index=image_token, image_seq_length=(image_size // patch) ** 2,
        vision_feature_select_strategy="default", vision_feature_layer=-2)
    torch.manual_seed(seed)
    model = tf.LlavaForConditionalGeneration(config).to(torch.float32).eval()
    image_processor = tf.LlavaImageProcessorPil(size={"shortest_edge": image_size},
                                                crop_size={"height": image_size, "width": image_size})
    processor = tf.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch,
                                  vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                  image_token="<image>", chat_template=CHAT_TEMPLATE)
    return model, processor


def random_image(seed: int, height: int = 40, width: int = 48) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def png_base64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + png_base64(image)


def hf_greedy(model, processor, text: str, images: list, max_new_tokens: int) -> list[int]:
    """HF generate's greedy new tokens for one prompt with images, forced to run `max_new_tokens` (eos banned)."""
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                 "<|video_pad|>", "<unk>"]
QWEN_PATCH, QWEN_MERGE = 8, 2


class ImageOnlyQwen2VLProcessor(tf.Qwen2VLProcessor):
    """Qwen2-VL's processor without its video processor (which needs torchvision): images only."""

    def check_argument_for_proper_class(self, name, arg):
        if name == "video_processor" and arg is None:
            return None
        return super().check_argument_for_proper_class(name, arg)


def tiny_qwen2_vl(seed: int = 0, v25: bool = False) -> tuple[tf.PreTrainedModel, tf.Qwen2VLProcessor]:
    """A Qwen2-VL (`v25`: a Qwen2.5-VL, whose tower attends in windows but for its last block) of a 2-block vision
    tower (8x8 patches merged 2x2: a 40x48 image is 6 tokens) and a 2-layer language model with M-RoPE sections
    (2, 3, 3), fp32, with an image-only processor (Qwen2.5-VL's processes images as Qwen2-VL's does)."""
    words = QWEN_SPECIALS + sorted(set(WORDS))
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    tokenizer = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(QWEN_SPECIALS)
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>",
                                           pad_token="<|endoftext|>", unk_token="<unk>",
                                           extra_special_tokens={"image_token": "<|image_pad|>",
                                                                 "video_token": "<|video_pad|>"})
    token = tokenizer.convert_tokens_to_ids
    vision = (dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2, window_size=32,
                   fullatt_block_indexes=[1]) if v25 else dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2))
    config = (tf.Qwen2_5_VLConfig if v25 else tf.Qwen2VLConfig)(
        vision_config=dict(patch_size=QWEN_PATCH, spatial_merge_size=QWEN_MERGE, temporal_patch_size=2, **vision),
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10.0, "mrope_section": [2, 3, 3]},
                         bos_token_id=None, eos_token_id=token("<|im_end|>"), pad_token_id=token("<|endoftext|>")),
        image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"), vision_end_token_id=token("<|vision_end|>"))
    torch.manual_seed(seed)
    model = (tf.Qwen2_5_VLForConditionalGeneration if v25 else tf.Qwen2VLForConditionalGeneration)(config)
    model = model.to(torch.float32).eval()
    image_processor = tf.Qwen2VLImageProcessorPil(patch_size=QWEN_PATCH, merge_size=QWEN_MERGE, temporal_patch_size=2,
                                                  size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64})
    return model, ImageOnlyQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None)


IDEFICS_SPECIALS = (["<pad>", "<s>", "</s>", "<unk>", "<fake_token_around_image>", "<image>", "<end_of_utterance>",
                     "<global-img>"] + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)])


def tiny_idefics3(seed: int = 0) -> tuple[tf.Idefics3ForConditionalGeneration, tf.Idefics3Processor]:
    """An Idefics3 of a 2-layer vision tower of 32x32 crops (4 tokens each after the 2x pixel shuffle) and a 2-layer
    Llama, fp32, with its processor: an image is resized to at most 64 pixels a side and cut into 32-pixel tiles
    plus the whole image (a 40x48 image: 2x2 tiles and the global crop, 20 tokens)."""
    words = IDEFICS_SPECIALS + sorted(set(WORDS)) + [":"]
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    tokenizer = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(IDEFICS_SPECIALS)
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="<end_of_utterance>",
                                           pad_token="<pad>", unk_token="<unk>")
    token = tokenizer.convert_tokens_to_ids
    config = tf.Idefics3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=IMAGE_SIZE, patch_size=PATCH),
        text_config=tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   bos_token_id=token("<s>"), eos_token_id=token("<end_of_utterance>"),
                                   pad_token_id=token("<pad>")),
        scale_factor=2, image_token_id=token("<image>"))
    torch.manual_seed(seed)
    model = tf.Idefics3ForConditionalGeneration(config).to(torch.float32).eval()
    image_processor = tf.Idefics3ImageProcessorPil(size={"longest_edge": 2 * IMAGE_SIZE},
                                                   max_image_size={"longest_edge": IMAGE_SIZE}, do_image_splitting=True)
    return model, tf.Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                       image_seq_len=(IMAGE_SIZE // PATCH) ** 2 // 4)


GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                  "<end_of_image>", "<image_soft_token>"]


def tiny_gemma3(seed: int = 0, window: int = 8) -> tuple[tf.Gemma3ForConditionalGeneration, tf.Gemma3Processor]:
    """A Gemma 3 of a 2-layer SigLIP tower (32x32 images, 16 soft tokens each, whose tokens attend both ways) and a
    2-layer language model, a sliding-window layer (`window` tokens, less than an image) then a global one, fp32,
    with its processor. The projection transformers initialises to zero is drawn at random, so images matter."""
    words = GEMMA_SPECIALS + sorted(set(WORDS))
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    tokenizer = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(GEMMA_SPECIALS)
    tokenizer = tf.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})
    token = tokenizer.convert_tokens_to_ids
    tokens_per_image = (IMAGE_SIZE // PATCH) ** 2
    config = tf.Gemma3Config(
        vision_config=tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH),
        text_config=tf.Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        query_pre_attn_scalar=16, sliding_window=window,
                                        layer_types=["sliding_attention", "full_attention"],
                                        max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2),
        mm_tokens_per_image=tokens_per_image, boi_token_index=token("<start_of_image>"),
        eoi_token_index=token("<end_of_image>"), image_token_index=token("<image_soft_token>"))
    torch.manual_seed(seed)
    model = tf.Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.2)
    image_processor = tf.Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return model, tf.Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                     image_seq_length=tokens_per_image)


def hf_greedy_logprobs(model, processor, text: str, images: list, max_new_tokens: int) -> tuple[list[int], list[float]]:
    """HF generate's greedy new tokens for one prompt with images and each one's logprob (eos banned)."""
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                             return_dict_in_generate=True, output_logits=True)
    new = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return new, [torch.log_softmax(step[0].float(), -1)[token].item() for step, token in zip(out.logits, new)]
