"""InputProcessor: what a caller gives (a prompt, its SamplingParams or PoolingParams) made into checked
requests: tokenised, validated, truncated, and built into a request group of samples.

The engine holds one; `AsyncEngine` (and so the server and LangChain) checks through the engine's in the
caller's thread, and the Ray front builds one from its replicas' limits, so a bad request is refused before it
travels. The checks raise ValueError naming what is wrong, so every front end accepts and refuses exactly
what one engine does.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from paged_backend.core.image_span import ImageSpan
from paged_backend.core.outputs import RequestMetrics
from paged_backend.core.pooling import PoolingParams, check_pooling
from paged_backend.core.request import LogitsProcessor, Request
from paged_backend.core.request_group import RequestGroup
from paged_backend.sampling.detokenizer import IncrementalDetokenizer
from paged_backend.errors import check_context
from paged_backend.image_prompts import ImagePrompts, ProcessedPrompt, check_images_allowed, is_image_prompt
from paged_backend.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from paged_backend.model.lora import LoRAAdapter

# Text, token ids, or a prompt with images (image_prompts.py: a mapping, or one already processed).
Prompt = str | Sequence[int] | Mapping[str, Any] | ProcessedPrompt


class InputProcessor:
    def __init__(self, tokenizer: Any, *, max_model_len: int, vocab_size: int, context_note: str = "",
                 hidden_size: int = 0, embedding_sizes: Sequence[int] | None = None,
                 eos_token_ids: frozenset[int] = frozenset(), device: torch.device | None = None,
                 images: ImagePrompts | None = None) -> None:
        """`context_note` says why the context is shorter than the model's positions, when it is; `hidden_size`
        and `embedding_sizes` bound an embedding's size; `eos_token_ids` and `device` (for seeded generators)
        are what built requests need; `images` reads prompts with images (None: every one is refused)."""
        self.tokenizer = tokenizer
        self.images = images
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.context_note = context_note
        self.hidden_size = hidden_size
        self.embedding_sizes = embedding_sizes
        self.eos_token_ids = eos_token_ids
        self.device = device
        # Whether grammars can be built (there is a vocabulary to constrain): with a tokenizer, or once the
        # engine was given one for its structured outputs (`Engine.enable_structured_outputs`).
        self.can_constrain = tokenizer is not None

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(the text or None, the token ids) of a prompt; one with images is processed (read_images)."""
        if is_image_prompt(prompt):
            processed = self.read_images(prompt)
            return processed.text, processed.token_ids
        return tokenize_prompt(self.tokenizer, prompt)

    def read_images(self, prompt: Mapping[str, Any] | ProcessedPrompt) -> ProcessedPrompt:
        """A prompt with images through the model's processor (once: a processed prompt is returned as is)."""
        if self.images is None:
            raise ValueError("this engine takes no prompts with images")
        return self.images.read(prompt)

    def image_prompts(self) -> ImagePrompts | None:
        """What reads a chat's images, where the engine runs images for its model (else image parts are refused)."""
        return self.images if self.images is not None and self.images.family is not None else None

    def prompt_tokens(self, prompt: Prompt, prompt_token_ids: list[int] | None
                      ) -> tuple[str | None, list[int], ProcessedPrompt | None]:
        """The prompt's text (None for token ids), its tokens, tokenized here unless the caller already did, and
        for a prompt with images, the processed prompt (its images and positions)."""
        if is_image_prompt(prompt):
            processed = self.read_images(prompt)
            return processed.text, processed.token_ids, processed
        if prompt_token_ids is None:
            return (*self.tokenize(prompt), None)
        return (prompt if isinstance(prompt, str) else None), list(prompt_token_ids), None

    def validate(self, token_ids: list[int], params: SamplingParams, images: Sequence[ImageSpan] = ()) -> None:
        check_request(token_ids, params, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                      has_tokenizer=self.tokenizer is not None, can_constrain=self.can_constrain,
                      context_note=self.context_note)
        check_images_allowed(images, params)

    def validate_pooling(self, token_ids: list[int], pooling: PoolingParams) -> None:
        check_pooling(token_ids, pooling, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                      hidden_size=self.hidden_size, embedding_sizes=self.embedding_sizes,
                      context_note=self.context_note)

    def make_group(self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams, *,
                   stream: bool, arrival_time: float | None, cache_salt: str | None,
                   logits_processor: LogitsProcessor | None, adapter: LoRAAdapter | None,
                   model_state: int, visual: ProcessedPrompt | None = None) -> RequestGroup:
        """The request group of a validated prompt: params.num_samples samples (derived seeds), its prompt
        truncated as the params ask (the one place prompts are truncated). A ranked group (best_of > n) is
        never streamed."""
        token_ids = params.kept_prompt(token_ids, self.max_model_len)
        metrics = RequestMetrics(arrival_time=arrival_time or time.time())
        samples = params.num_samples
        group = RequestGroup(request_id, keep_best=params.n if samples > params.n else None)
        for index in range(samples):
            sample_params = params if samples == 1 else params.for_sample(index)
            internal_id = request_id if samples == 1 else f"{request_id}#{index}"
            request = self.make_request(group, internal_id, text, token_ids, sample_params, metrics,
                                        stream and not group.ranked, cache_salt, logits_processor, adapter, model_state)
            if visual is not None:
                request.images, request.rope = visual.images, visual.rope
        return group

    def make_pooling_request(self, request_id: str, text: str | None, token_ids: list[int], pooling: PoolingParams,
                             model_state: int) -> Request:
        """The one request of a validated pooling prompt, in a group of its own."""
        # Never sampled: max_tokens=1 only keeps speculation's allowance (max_tokens - outputs - 1) at zero.
        return Request(request_id=request_id, prompt=text, prompt_token_ids=token_ids,
                       params=SamplingParams(max_tokens=1), max_tokens=1, stop_ids=frozenset(),
                       metrics=RequestMetrics(arrival_time=time.time()), stream=False,
                       model_state=model_state, group=RequestGroup(request_id), pooling=pooling)

    def make_request(self, group: RequestGroup, request_id: str, text: str | None, token_ids: list[int],
                     params: SamplingParams, metrics: RequestMetrics, stream: bool, cache_salt: str | None,
                     logits_processor: LogitsProcessor | None, adapter: LoRAAdapter | None,
                     model_state: int) -> Request:
        """A new sample of `group`; it joins the group as its next sample."""
        # The samples share one prompt: the leader scores it, the others may take it from the cache.
        scores_prompt = params.prompt_logprobs is not None and not group.samples
        return Request(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            max_tokens=self.resolve_max_tokens(len(token_ids), params),
            stop_ids=frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids),
            metrics=metrics,
            stream=stream,
            generator=self.make_generator(params.seed),
            detokenizer=self.make_detokenizer(token_ids, params),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] if scores_prompt else None,
            cache_salt=cache_salt,
            lora=adapter,
            model_state=model_state,
            logits_processor=logits_processor,
            group=group,
        )

    def resolve_max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        room = self.max_model_len - prompt_len
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def make_generator(self, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(seed)

    def make_detokenizer(self, token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, token_ids, params.stop, params.include_stop_str_in_output,
                                      params.skip_special_tokens)


def tokenize_prompt(tokenizer: Any, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
    """(the text or None, the token ids) of a text or token-id prompt."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids or give the engine a tokenizer")
        return prompt, tokenizer(prompt)["input_ids"]
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise ValueError("a prompt must be a string or a sequence of int token ids")
    return None, list(prompt)


def check_request(token_ids: list[int], params: SamplingParams, *, max_model_len: int, vocab_size: int,
                  has_tokenizer: bool, can_constrain: bool, context_note: str = "") -> None:
    """`can_constrain`: the engine can build grammars (it has a vocabulary to constrain); `context_note`
    says why the context is shorter than the model's positions, when it is."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")  # noqa: TRY004  (a ValueError, as every refusal)
    params.validate()
    token_ids = params.kept_prompt(token_ids, max_model_len)  # what the engine's intake will run
    if not token_ids:
        raise ValueError("the prompt is empty")
    check_context(max_model_len, len(token_ids), 1, note=context_note)  # room for at least one generated token
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if params.stop and not has_tokenizer:
        raise ValueError("stop strings need a tokenizer")
    if params.structured_outputs is not None and not can_constrain:
        raise ValueError("structured_outputs need a tokenizer (its vocabulary is what the grammar constrains)")
