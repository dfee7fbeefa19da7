"""paged-backend: a paged KV cache and continuous-batching engine for HuggingFace transformers."""

from paged_backend.config import EngineConfig
from paged_backend.core.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from paged_backend.core.pooling import PoolingParams
from paged_backend.engine import Engine
from paged_backend.entrypoints.async_engine import AsyncEngine
from paged_backend.entrypoints.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    BeamSequence,
)
from paged_backend.entrypoints.llm import LLM
from paged_backend.integrations.pipeline import PagedImageTextToTextPipeline, PagedTextGenerationPipeline, pipeline
from paged_backend.integrations.hooks import disable, enable
from paged_backend.model.loading.default_model import DEFAULT_MODEL, default_model_path
from paged_backend.model.lora import LoRARequest
from paged_backend.model.quantized.checkpoint_quantizer import install as install_checkpoint_quantizers
from paged_backend.errors import ContextLengthError
from paged_backend.model.loading.model_loader import UnsupportedArchitectureError
from paged_backend.sampling.sampling_params import SamplingParams
from paged_backend.sampling.structured_outputs import StructuredOutputsParams

enable()  # model.generate(..., cache_implementation="paged") and generate_batch now run on this engine; disable() undoes it
install_checkpoint_quantizers()  # GPTQ, AWQ and compressed-tensors folders load into the engine's own layers

__all__ = [
    "DEFAULT_MODEL",
    "AsyncEngine",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSequence",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "LLM",
    "Logprob",
    "LoRARequest",
    "RequestMetrics",
    "RequestOutput",
    "PagedImageTextToTextPipeline",
    "PagedTextGenerationPipeline",
    "PoolingParams",
    "SamplingParams",
    "StructuredOutputsParams",
    "UnsupportedArchitectureError",
    "ContextLengthError",
    "default_model_path",
    "disable",
    "enable",
    "pipeline",
]
