"""Vision-language families: what the engine needs to know of each to run its images through the unmodified HF
model (transformers 5.25).

A family says three things: which processor outputs belong to one image (`split`), how many placeholder tokens
an image takes (`tokens_of`, checked against the prompt the processor made), and how to turn a batch of images
into their embeddings (`encode`, the model's own `get_image_features`, one tensor per image). The engine puts
those rows at the image's placeholder positions of the step's input embeddings, which is what the model's own
forward does with `pixel_values`, so the language model runs paged as for text.

Families whose language model needs more than embeddings at the placeholders are not here yet and are refused
with images (`refusal`): multi-axis rotary positions (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), bidirectional attention
over an image's tokens (Gemma 3), images split into tiles between text tokens (SmolVLM, Idefics3), any-resolution
tiles (LLaVA-NeXT).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig, PreTrainedModel

ImageInputs = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class VisionFamily:
    name: str
    image_keys: tuple[str, ...]  # the processor outputs that hold one entry per image along their first axis

    def split(self, processed: Mapping[str, torch.Tensor], num_images: int) -> list[ImageInputs]:
        """The processor's outputs for a prompt's images, one mapping per image."""
        for key in self.image_keys:
            if processed[key].shape[0] != num_images:
                raise ValueError(f"the processor gave {processed[key].shape[0]} {key} rows for {num_images} images")
        return [{key: processed[key][i : i + 1] for key in self.image_keys} for i in range(num_images)]

    def tokens_of(self, config: PretrainedConfig, image: ImageInputs) -> int:
        """How many placeholder tokens the image's embeddings fill."""
        vision = config.vision_config
        patches = (vision.image_size // vision.patch_size) ** 2
        return patches + (1 if config.vision_feature_select_strategy == "full" else 0)

    def encode(self, model: PreTrainedModel, images: Sequence[ImageInputs]) -> list[torch.Tensor]:
        """Each image's embeddings `[tokens, hidden]`, the images run through the vision tower as one batch."""
        batch = {key: torch.cat([image[key] for image in images]).to(model.device) for key in self.image_keys}
        if "pixel_values" in batch:
            batch["pixel_values"] = batch["pixel_values"].to(model.dtype)
        features = model.get_image_features(**batch, return_dict=True).pooler_output
        return [rows.reshape(-1, rows.shape[-1]) for rows in features]


FAMILIES: dict[str, VisionFamily] = {
    "llava": VisionFamily("LLaVA", ("pixel_values",)),
}

# Vision-language types whose images the engine does not run yet, with the reason (their text runs where the type
# is supported, as gemma3's).
REFUSED: dict[str, str] = {
    "gemma3": "Gemma 3 attends bidirectionally over an image's tokens, which the paged attention does not do yet",
    **dict.fromkeys(("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"),
                    "its multi-axis rotary positions (M-RoPE) for image tokens are not computed by the engine yet"),
    **dict.fromkeys(("idefics3", "smolvlm"),
                    "its images are split into tiles between text tokens, which the engine does not map yet"),
    "llava_next": "its any-resolution tiles are not mapped to placeholders by the engine yet",
}


def family_of(config: PretrainedConfig) -> VisionFamily | None:
    return FAMILIES.get(getattr(config, "model_type", None))


def refusal(config: PretrainedConfig, model_name: str) -> str:
    """Why a prompt with images is refused for a model whose family is not in FAMILIES."""
    model_type = getattr(config, "model_type", None)
    if model_type in FAMILIES:
        return f"{model_name}: images do not run under tensor parallelism yet"
    reason = REFUSED.get(model_type, "it is a text-only model")
    return f"{model_name} (model_type={model_type!r}) does not take images: {reason}"
