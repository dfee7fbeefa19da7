"""PagedLLM: a LangChain text-completion model (BaseLLM) on the shared paged engine.

BaseLLM, unlike LLM, hands `_generate` the whole batch, so every prompt of a `batch` or
`generate` call joins the engine's continuous batch at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import ConfigDict

from paged_backend.core.outputs import CompletionOutput, RequestOutput
from paged_backend.sampling.sampling_params import SamplingParams

from ..logprobs import completion_logprobs, positions
from .options import PagedOptions
from .submit import astream_outputs, run_batch, stream_outputs


class PagedLLM(PagedOptions, BaseLLM):
    """Text completion on paged_backend's continuous-batching engine; construction is cheap."""

    # LangChain's base classes ignore unknown fields; an unknown option here is a mistake to report.
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    logprobs: int | None = None
    """Return this many top logprobs per generated token (0: only the chosen token's)."""

    @property
    def _llm_type(self) -> str:
        return "paged-backend"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.resolved_model_name, "temperature": self.temperature, "max_tokens": self.max_tokens}

    def get_num_tokens(self, text: str) -> int:
        """Counted with the model's own tokenizer, as the engine will see the prompt."""
        return len(self.async_engine.tokenize(text)[1])

    def _generate(self, prompts: list[str], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        timeout = self.call_timeout(kwargs)
        params = self.sampling_params(stop, dict(kwargs), logprobs=self.logprobs)
        finals: list[RequestOutput | None] = [None] * len(prompts)
        # LangChain passes only the first prompt's run manager to a batched _generate, so token
        # callbacks are sent only when that is the whole batch.
        token_sink = run_manager if self.streaming and len(prompts) == 1 and params.n == 1 else None
        for index, output in run_batch(self.async_engine, prompts, params, timeout, self.call_lora(kwargs)):
            if token_sink is not None and output.delta_text:
                token_sink.on_llm_new_token(output.delta_text)
            if output.finished:
                finals[index] = output
        return self.to_result(finals)

    async def _agenerate(self, prompts: list[str], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        timeout = self.call_timeout(kwargs)
        params = self.sampling_params(stop, dict(kwargs), logprobs=self.logprobs)
        token_sink = run_manager if self.streaming and len(prompts) == 1 and params.n == 1 else None
        lora = self.call_lora(kwargs)

        async def run(prompt: str) -> RequestOutput:
            async for output in astream_outputs(self.async_engine, prompt, params, timeout, lora):
                if token_sink is not None and output.delta_text:
                    await token_sink.on_llm_new_token(output.delta_text)
                if output.finished:
                    return output
            raise AssertionError("the engine ended a request without a finished output")

        return self.to_result(list(await asyncio.gather(*(run(p) for p in prompts))))

    def _stream(self, prompt: str, stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[GenerationChunk]:
        params = self.stream_params(stop, dict(kwargs))
        for output in stream_outputs(self.async_engine, prompt, params, self.call_timeout(kwargs),
                                     self.call_lora(kwargs)):
            chunk = self.to_chunk(output)
            if chunk is not None:
                if run_manager is not None:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    async def _astream(self, prompt: str, stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[GenerationChunk]:
        async for output in self._astream_outputs(prompt, stop, dict(kwargs)):
            chunk = self.to_chunk(output)
            if chunk is not None:
                if run_manager is not None:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    def _astream_outputs(self, prompt: str, stop: list[str] | None, kwargs: dict[str, Any]) -> AsyncIterator[RequestOutput]:
        timeout = self.call_timeout(kwargs)
        return astream_outputs(self.async_engine, prompt, self.stream_params(stop, kwargs), timeout,
                               self.call_lora(kwargs))

    def stream_params(self, stop: list[str] | None, kwargs: dict[str, Any]) -> SamplingParams:
        params = self.sampling_params(stop, kwargs, logprobs=self.logprobs)
        if params.num_samples > 1:  # samples' deltas interleave, and best_of's winners are known only at the end
            raise NotImplementedError("streaming with n > 1 or best_of > 1")
        return params

    def to_chunk(self, output: RequestOutput) -> GenerationChunk | None:
        if not output.finished:
            return GenerationChunk(text=output.delta_text) if output.delta_text else None
        return GenerationChunk(text=output.delta_text, generation_info=self.generation_info(output.outputs[0]))

    def to_result(self, finals: list[RequestOutput]) -> LLMResult:
        generations = [[Generation(text=c.text, generation_info=self.generation_info(c)) for c in out.outputs]
                       for out in finals]
        prompt_tokens = sum(len(out.prompt_token_ids) for out in finals)
        completion_tokens = sum(len(c.token_ids) for out in finals for c in out.outputs)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        return LLMResult(generations=generations,
                         llm_output={"token_usage": usage, "model_name": self.resolved_model_name})

    def generation_info(self, completion: CompletionOutput) -> dict[str, Any]:
        info: dict[str, Any] = {"finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}
        if completion.logprobs is not None:
            info["logprobs"] = completion_logprobs(self.async_engine.tokenizer, positions(completion),
                                                   self.logprobs or 0)
        return info
