"""StepImages: a step's image rows, encoded or found in the encoder cache, merged into its input embeddings.

A step of a vision-language model whose tokens include image placeholders runs the model on `inputs_embeds`:
the text embeddings of the packed row with each placeholder's row replaced by its image's embedding row, as the
model's own forward does with `pixel_values`. A chunk of prefill that cuts through an image takes the rows its
positions need; the images a step needs and the cache lacks are encoded together, in one batch. A step without
image tokens (every decode step) runs on token ids as before.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np
import torch
from transformers import PreTrainedModel

from paged_backend.core.image_span import ImageSpan, widened_spans
from paged_backend.core.request import Request
from paged_backend.kernels import AttentionMetadata
from paged_backend.model.vision.encoder_cache import EncoderCache
from paged_backend.model.vision.families import VisionFamily


class StepImages:
    def __init__(self, model: PreTrainedModel, family: VisionFamily, cache: EncoderCache | None = None) -> None:
        self.model = model
        self.family = family
        self.cache = cache or EncoderCache()

    def input_embeds(self, requests: Sequence[Request], starts: np.ndarray, ends: np.ndarray,
                     query_start_loc: np.ndarray, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The step's input embeddings `[1, T, hidden]` with its image rows in place, or None for a step
        without image placeholders."""
        wanted: list[tuple[ImageSpan, np.ndarray, np.ndarray]] = []  # (image, its rows, their packed rows)
        for i, request in enumerate(requests):
            start, end = int(starts[i]), min(int(ends[i]), request.num_prompt_tokens)
            for image in request.images:
                if image.start < end and start < image.end:
                    rows, positions = image.rows_between(start, end)
                    wanted.append((image, rows, query_start_loc[i] + positions - start))
        if not wanted:
            return None
        features = self.features([image for image, _, _ in wanted])
        embeds = self.model.get_input_embeddings()(input_ids)
        packed = torch.from_numpy(np.concatenate([where for _, _, where in wanted])).to(embeds.device)
        rows = torch.cat([features[image.digest][torch.from_numpy(taken)] for image, taken, _ in wanted])
        embeds[0, packed] = rows.to(embeds.device, embeds.dtype)
        return embeds

    @staticmethod
    def widen(metadata: AttentionMetadata, requests: Sequence[Request], starts: np.ndarray, ends: np.ndarray
              ) -> AttentionMetadata:
        """The step's metadata, with the images among its queries whose tokens attend both ways (`widened`)."""
        widened = {}
        for i, request in enumerate(requests):
            if request.images and starts[i] < request.num_prompt_tokens:
                spans = widened_spans(request.images, int(starts[i]), int(ends[i]))
                if spans:
                    widened[i] = spans
        return dataclasses.replace(metadata, widened=widened) if widened else metadata

    @staticmethod
    def rope_positions(requests: Sequence[Request], starts: np.ndarray, counts: np.ndarray, positions: np.ndarray,
                       query_start_loc: np.ndarray) -> np.ndarray:
        """The step's multi-axis positions `[3, T]`: a request with images takes its own (RopePositions), the
        others their sequence positions on every axis."""
        out = np.broadcast_to(positions, (3, len(positions))).copy()
        for i, request in enumerate(requests):
            if request.rope is not None:
                first, start, count = int(query_start_loc[i]), int(starts[i]), int(counts[i])
                out[:, first:first + count] = request.rope.between(start, start + count)
        return out

    def features(self, images: Sequence[ImageSpan]) -> dict[int, torch.Tensor]:
        """Each image's embeddings by digest: from the cache, the others encoded in one batch (and kept)."""
        found: dict[int, torch.Tensor] = {}
        missing: dict[int, ImageSpan] = {}
        for image in images:
            if image.digest in found or image.digest in missing:
                continue
            cached = self.cache.get(image.digest)
            if cached is not None:
                found[image.digest] = cached
            else:
                missing[image.digest] = image
        if missing:
            began = time.perf_counter()
            encoded = self.family.encode(self.model, [image.inputs for image in missing.values()])
            for image, rows in zip(missing.values(), encoded):
                if rows.shape[0] != image.num_tokens:
                    raise ValueError(f"the vision encoder gave {rows.shape[0]} rows for an image of "
                                     f"{image.num_tokens} placeholder tokens")
                found[image.digest] = rows
                self.cache.put(image.digest, rows)
            self.cache.stats.images_encoded += len(missing)
            self.cache.stats.encoder_seconds += time.perf_counter() - began
        return found
