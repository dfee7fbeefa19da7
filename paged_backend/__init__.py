"""paged-backend: a paged KV cache and continuous-batching engine for HuggingFace transformers."""

from .beam_search import BeamSearchOutput, BeamSearchParams, BeamSequence
from .config import EngineConfig
from .default_model import DEFAULT_MODEL
from .async_engine import AsyncEngine
from .engine import Engine
from .llm import LLM
from .lora import LoRARequest
from .model_loader import UnsupportedArchitectureError
from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams
from .structured_outputs import StructuredOutputsParams
from .integrations.pipeline import PagedTextGenerationPipeline, pipeline
from .integrations.transformers_generate import disable, enable

enable()  # model.generate(..., cache_implementation="paged") now runs on this engine; disable() undoes it

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
    "PagedTextGenerationPipeline",
    "SamplingParams",
    "StructuredOutputsParams",
    "UnsupportedArchitectureError",
    "disable",
    "enable",
    "pipeline",
]
