"""Vision-language families: what the engine needs to know of each to run its images through the unmodified HF
model (transformers 5.25).

A family says three things: which processor outputs belong to one image (`split`), how many placeholder tokens
an image takes (`tokens_of`, checked against the prompt the processor made), and how to turn a batch of images
into their embeddings (`encode`, the model's own `get_image_features`, one tensor per image). The engine puts
those rows at the image's placeholder positions of the step's input embeddings, which is what the model's own
forward does with `pixel_values`, so the language model runs paged as for text.

A family whose language model takes multi-axis rotary positions (Qwen2-VL's M-RoPE) also says a prompt's positions
(`rope_positions`); one whose images are cut into crops between text tokens (Idefics3) encodes a prompt's images
together; one whose image tokens attend both ways (Gemma 3) has each image computed in one step. Families not here
yet are refused with images (`refusal`): any-resolution tiles (LLaVA-NeXT), processors or vision towers not mapped
yet (SmolVLM, Qwen3-VL).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from transformers import PretrainedConfig, PreTrainedModel

from paged_backend.core.image_span import RopePositions

ImageInputs = Mapping[str, torch.Tensor]


class VisionFamily:
    """LLaVA's way, which the others change where theirs differs: images stacked along the first axis of each of
    `image_keys`, a fixed number of tokens per image, 1-D positions."""

    name = "LLaVA"
    image_keys: tuple[str, ...] = ("pixel_values",)  # the processor outputs that hold the images
    derived_keys: tuple[str, ...] = ()  # processor outputs the engine computes again from the token ids
    multi_axis_positions = False  # whether the language model takes M-RoPE positions (rope_positions)
    whole_images = False  # whether an image's tokens attend both ways, so each is computed in one step (Gemma 3)

    def num_images(self, processed: Mapping[str, torch.Tensor]) -> int:
        """How many images the processor's outputs hold."""
        return processed[self.image_keys[0]].shape[0]

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

    def rope_positions(self, model: PreTrainedModel, token_ids: list[int],
                       images: Sequence[ImageInputs]) -> RopePositions | None:
        """A prompt's multi-axis positions, for a family whose language model takes them; None for 1-D ones."""
        return None


class QwenVLFamily(VisionFamily):
    """Qwen2-VL and Qwen2.5-VL: an image is a run of flattened patches (`pixel_values` rows, `image_grid_thw` its
    temporal, height and width patch counts), merged 2x2 into tokens; the language model takes three position
    axes (M-RoPE), which the model's own `get_rope_index` computes from the prompt and its image grids."""

    name = "Qwen2-VL"
    image_keys = ("pixel_values", "image_grid_thw")
    derived_keys = ("mm_token_type_ids",)  # which tokens are image placeholders
    multi_axis_positions = True

    def num_images(self, processed: Mapping[str, torch.Tensor]) -> int:
        return processed["image_grid_thw"].shape[0]

    def split(self, processed: Mapping[str, torch.Tensor], num_images: int) -> list[ImageInputs]:
        grids = processed["image_grid_thw"]
        if grids.shape[0] != num_images:
            raise ValueError(f"the processor gave {grids.shape[0]} image grids for {num_images} images")
        bounds = [0, *torch.cumsum(grids.prod(dim=-1), 0).tolist()]
        return [{"pixel_values": processed["pixel_values"][bounds[i]:bounds[i + 1]], "image_grid_thw": grids[i:i + 1]}
                for i in range(num_images)]

    def tokens_of(self, config: PretrainedConfig, image: ImageInputs) -> int:
        return int(image["image_grid_thw"].prod()) // config.vision_config.spatial_merge_size ** 2

    def rope_positions(self, model: PreTrainedModel, token_ids: list[int],
                       images: Sequence[ImageInputs]) -> RopePositions | None:
        ids = torch.tensor([token_ids])
        kinds = (ids == model.config.image_token_id).long()  # 1 on image placeholders, 0 on text
        grids = torch.cat([image["image_grid_thw"] for image in images]) if images else None
        positions, delta = model.model.get_rope_index(ids, kinds, image_grid_thw=grids)
        return RopePositions(positions[:, 0].numpy().astype(np.int64), int(delta.reshape(-1)[0]))


class TiledFamily(VisionFamily):
    """Idefics3: an image is cut into crops (a grid of tiles and the whole image, each `image_seq_len` tokens after
    the connector's pixel shuffle), laid out between row and column tags, and a prompt's crops are one batch sample
    (`pixel_values [1, crops, 3, H, W]`, padding crops all zero). A prompt's images therefore encode together, as
    one `ImageSpan` of all their placeholders (its digest covers every image); a batch of `generate` rows gives one
    per row that has images."""

    name = "Idefics3"
    image_keys = ("pixel_values", "pixel_attention_mask")

    def num_images(self, processed: Mapping[str, torch.Tensor]) -> int:
        return processed["pixel_values"].shape[0]  # batch samples: each sample's images encode together

    def split(self, processed: Mapping[str, torch.Tensor], num_images: int) -> list[ImageInputs]:
        samples = []
        for pixels, mask in zip(processed["pixel_values"], processed["pixel_attention_mask"]):
            real = pixels.flatten(1).ne(0).any(dim=1)  # the model's own rule: an all-zero crop is padding
            if real.any():
                samples.append({"pixel_values": pixels[real][None], "pixel_attention_mask": mask[real][None]})
        return samples

    def tokens_of(self, config: PretrainedConfig, image: ImageInputs) -> int:
        vision = config.vision_config
        per_crop = (vision.image_size // vision.patch_size) ** 2 // config.scale_factor ** 2
        return image["pixel_values"].shape[1] * per_crop

    def encode(self, model: PreTrainedModel, images: Sequence[ImageInputs]) -> list[torch.Tensor]:
        pixels = torch.cat([image["pixel_values"] for image in images], dim=1).to(model.device, model.dtype)
        mask = torch.cat([image["pixel_attention_mask"] for image in images], dim=1).to(model.device)
        rows = model.get_image_features(pixel_values=pixels, pixel_attention_mask=mask, return_dict=True).pooler_output
        rows = torch.cat(list(rows)).reshape(-1, rows[0].shape[-1])
        return list(torch.split(rows, [self.tokens_of(model.config, image) for image in images]))


class BidirectionalFamily(VisionFamily):
    """Gemma 3: a fixed number of soft tokens per image (the projector pools the tower's patches), between
    begin- and end-of-image tokens, which attend to each other both ways: the scheduler computes what is left of an
    image in one step and the step's attention widens the causal rule over it (`whole_images`)."""

    name = "Gemma 3"
    derived_keys = ("token_type_ids",)  # which tokens are image soft tokens
    whole_images = True

    def tokens_of(self, config: PretrainedConfig, image: ImageInputs) -> int:
        return config.mm_tokens_per_image


FAMILIES: dict[str, VisionFamily] = {
    "llava": VisionFamily(),
    "qwen2_vl": QwenVLFamily(),
    "qwen2_5_vl": QwenVLFamily(),  # a windowed tower behind the same inputs, outputs and rope index
    "idefics3": TiledFamily(),
    "gemma3": BidirectionalFamily(),
}

# Vision-language types whose images the engine does not run yet, with the reason (their text runs where the type
# is supported, as gemma3's).
REFUSED: dict[str, str] = {
    **dict.fromkeys(("qwen3_vl", "qwen3_vl_moe"),
                    "its vision tower is not mapped by the engine yet (Qwen2-VL's and Qwen2.5-VL's are)"),
    "smolvlm": "its processor's image layout is not mapped by the engine yet (Idefics3's, the same model, is)",
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
