"""Prompts with images: a text and its images made, by the model's HF processor, into token ids with the image
placeholders expanded and one `ImageSpan` per image.

A prompt with images is a mapping, vLLM's form: `{"prompt": text, "multi_modal_data": {"image": image or [images]}}`
with the images as PIL images, arrays, tensors, bytes or data URLs (image_sources.py) and the text holding the model's image
token where each image goes (the processor's chat template puts it there for chat). The processor expands each
image token to the image's placeholders; each image's span takes, in order, as many of them as its family says
the image fills. An image's digest hashes what the vision encoder reads of it (the processed pixels, which carry
the processor's settings), so equal images share their encoding and their prefix-cache blocks, and different ones
never do.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from paged_backend.core.image_span import ImageSpan, RopePositions
from paged_backend.image_sources import read_image
from paged_backend.model.vision.families import ImageInputs, VisionFamily, refusal

MAX_IMAGES = 32  # per prompt


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt with images after the processor: what the engine queues."""

    text: str | None  # None: given as token ids (generate's rows)
    token_ids: list[int]
    images: tuple[ImageSpan, ...]
    rope: RopePositions | None = None  # its multi-axis positions, for a model that takes them (M-RoPE)


def is_image_prompt(prompt: object) -> bool:
    return isinstance(prompt, (Mapping, ProcessedPrompt))


class ImagePrompts:
    """Reads prompts with images for one model: its processor, its family, its image token."""

    def __init__(self, processor: Any, model: PreTrainedModel, model_name: str, family: VisionFamily | None,
                 step_tokens: int, allowed_domains: Collection[str] = ()) -> None:
        """`family`: the model's vision family where the engine runs its images (None: every image is refused);
        `step_tokens`: the engine's token budget of a step, which an image computed whole must fit;
        `allowed_domains`: the hosts whose web addresses images may be fetched from."""
        self.processor = processor
        self.model = model
        self.step_tokens = step_tokens
        self.allowed_domains = frozenset(allowed_domains)
        self.config = model.config
        self.family = family
        self.model_name = model_name

    def read(self, prompt: Mapping | ProcessedPrompt, add_special_tokens: bool = True) -> ProcessedPrompt:
        """The processed prompt; ValueError naming what is wrong (no images taken by this model, a bad image, more
        images than placeholders). `add_special_tokens` False: the text already has them (a rendered chat)."""
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        text, sources = prompt_parts(prompt)
        self.check_takes_images()
        images = [read_image(source, f"image {i}", self.allowed_domains) for i, source in enumerate(sources)]
        try:
            processed = self.processor(text=text, images=images or None, return_tensors="pt",
                                       add_special_tokens=add_special_tokens)
        except (ValueError, TypeError, OSError) as exc:
            raise ValueError(f"the processor refused the prompt's images: {exc}") from None
        token_ids = processed["input_ids"][0].tolist()
        if not images:
            return ProcessedPrompt(text, token_ids, ())
        return self.processed(text, token_ids, self.family.split(processed, len(images)))

    def processed(self, text: str | None, token_ids: list[int], per_image: list[ImageInputs]) -> ProcessedPrompt:
        """The prompt with its images' spans (and, for an M-RoPE model, its positions)."""
        rope = self.family.rope_positions(self.model, token_ids, per_image) if per_image else None
        return ProcessedPrompt(text, token_ids, self.spans(token_ids, per_image), rope)

    def rows_with_images(self, rows: list[list[int]], image_inputs: Mapping[str, torch.Tensor]) -> list[ProcessedPrompt]:
        """Token-id rows whose image placeholders are already expanded (what a processor gave `generate`), with the
        batch's images (`image_inputs`: the processor's image outputs, one entry per image along the first axis)
        dealt out in order: each row takes as many as its placeholders hold."""
        if self.family is None:
            raise ValueError(refusal(self.config, self.model_name))
        per_image = self.family.split(image_inputs, self.family.num_images(image_inputs))
        prompts, taken = [], 0
        for index, row in enumerate(rows):
            wanted = int((np.asarray(row) == self.config.image_token_id).sum())
            count, filled = 0, 0
            while filled < wanted and taken + count < len(per_image):
                filled += self.family.tokens_of(self.config, per_image[taken + count])
                count += 1
            if filled != wanted:
                raise ValueError(f"row {index} has {wanted} image placeholder tokens, which the images given do not "
                                 "fill in order")
            prompts.append(self.processed(None, list(row), per_image[taken:taken + count]))
            taken += count
        if taken != len(per_image):
            raise ValueError(f"{len(per_image)} images for {taken} images' placeholders in the rows")
        return prompts

    def check_takes_images(self) -> None:
        """ValueError naming the model unless the engine runs images for it (its family, with its processor)."""
        if self.family is None:
            raise ValueError(refusal(self.config, self.model_name))
        if self.processor is None:
            raise ValueError(f"{self.model_name}: a prompt with images needs the model's processor; pass the "
                             "transformers processor (AutoProcessor) as the tokenizer")

    def spans(self, token_ids: list[int], per_image: list[ImageInputs]) -> tuple[ImageSpan, ...]:
        """Each image's span: its share, in order, of the prompt's image placeholders."""
        placeholders = np.flatnonzero(np.asarray(token_ids) == self.config.image_token_id)
        counts = [self.family.tokens_of(self.config, image) for image in per_image]
        if sum(counts) != len(placeholders):
            raise ValueError(f"the prompt has {len(placeholders)} image placeholder tokens where its {len(per_image)} "
                             f"images fill {sum(counts)}: put the image token once per image in the text")
        bounds = np.cumsum([0, *counts])
        spans = tuple(ImageSpan(placeholders[bounds[i]:bounds[i + 1]], image_digest(image), image,
                                self.family.whole_images) for i, image in enumerate(per_image))
        longest = max((span.end - span.start for span in spans if span.whole), default=0)
        if longest > self.step_tokens:
            raise ValueError(f"an image of {longest} tokens, which {self.model_name} computes in one step, is more "
                             f"than max_num_batched_tokens={self.step_tokens}")
        return spans


def prompt_parts(prompt: Mapping) -> tuple[str, list[Any]]:
    """(text, images) of a prompt mapping; ValueError for what is not one."""
    unknown = set(prompt) - {"prompt", "multi_modal_data"}
    if unknown:
        raise ValueError(f"a prompt mapping takes 'prompt' and 'multi_modal_data', not {sorted(unknown)}")
    text = prompt.get("prompt")
    if not isinstance(text, str):
        raise ValueError("a prompt with images needs its text as 'prompt' (a string with the image token where "
                         "each image goes)")
    data = prompt.get("multi_modal_data") or {}
    if not isinstance(data, Mapping) or set(data) - {"image"}:
        raise ValueError("'multi_modal_data' takes 'image': an image or a list of images")
    images = data.get("image", [])
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    if len(images) > MAX_IMAGES:
        raise ValueError(f"{len(images)} images in one prompt; at most {MAX_IMAGES}")
    return text, images


def image_digest(inputs: ImageInputs) -> int:
    """128 bits of hash over an image's encoder inputs (names, dtypes, shapes and values)."""
    h = hashlib.blake2b(digest_size=16)
    for key in sorted(inputs):
        tensor = inputs[key].detach().contiguous().cpu()
        h.update(f"{key}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        h.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return int.from_bytes(h.digest(), "little")


def text_tokenizer(tokenizer_or_processor: Any) -> tuple[Any, Any]:
    """(the tokenizer, the processor or None) of what a caller passed as the tokenizer: a transformers processor
    (which carries a tokenizer) stands for both."""
    inner = getattr(tokenizer_or_processor, "tokenizer", None)
    if inner is not None and hasattr(tokenizer_or_processor, "image_processor"):
        # A vision model's chat template is often the processor's alone; every chat front end renders with the
        # tokenizer's.
        if not getattr(inner, "chat_template", None) and getattr(tokenizer_or_processor, "chat_template", None):
            inner.chat_template = tokenizer_or_processor.chat_template
        return inner, tokenizer_or_processor
    return tokenizer_or_processor, None


def check_images_allowed(images: Sequence[ImageSpan], params: Any) -> None:
    """Options that cannot run on a prompt with images (its truncation would cut an image's placeholders)."""
    if images and getattr(params, "truncate_prompt_tokens", None) is not None:
        raise ValueError("truncate_prompt_tokens cannot cut a prompt with images")
