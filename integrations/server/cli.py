"""`paged-backend serve`: its flags and the function that loads the model and runs the server."""

from __future__ import annotations

import argparse
import logging
import threading
from typing import TYPE_CHECKING

from paged_backend import tracing
from paged_backend.integrations.options.flags import (
    ENGINE_FIELDS,
    add_engine_flags,
    add_quantization_flag,
    engine_options,
)

from .response_store import DEFAULT_MAX_STORED_RESPONSES
from .state import DEFAULT_MAX_SEQS_PER_REQUEST

if TYPE_CHECKING:
    from .lifecycle import DrainingServer, Lifecycle

logger = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 30.0  # on SIGTERM, how long requests in flight have to finish (lifecycle.py)

# EngineConfig fields whose flags sit with the LoRA options below.
LORA_FIELDS = ("enable_lora", "max_loras", "max_lora_rank")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="hub id, folder or .gguf file (default: the built-in SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: local only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 and /generate")
    parser.add_argument("--served-model-name", default=None, help="the name clients send as `model`")
    parser.add_argument("--max-seqs-per-request", type=int, default=DEFAULT_MAX_SEQS_PER_REQUEST,
                        help="the most sequences (prompts x n or best_of) one request may start; more is a 400 "
                        f"(default {DEFAULT_MAX_SEQS_PER_REQUEST})")
    parser.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                        help="on SIGTERM, seconds the requests in flight have to finish before they are aborted "
                        f"(default {DEFAULT_DRAIN_TIMEOUT_S:g})")
    parser.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                        help="send OpenTelemetry traces of every request to this OTLP/HTTP collector, e.g. "
                        "http://localhost:4318/v1/traces (needs the trace extra; default: no traces)")
    add_parser_flags(parser)
    parser.add_argument("--max-stored-responses", type=int, default=DEFAULT_MAX_STORED_RESPONSES,
                        help="how many /v1/responses answers to keep for previous_response_id (least recently used "
                        f"forgotten first; 0 keeps none; default {DEFAULT_MAX_STORED_RESPONSES})")
    engine = parser.add_argument_group("engine")
    add_quantization_flag(engine)
    add_engine_flags(engine, [name for name in ENGINE_FIELDS if name not in LORA_FIELDS])
    lora = parser.add_argument_group("LoRA adapters")
    add_engine_flags(lora, LORA_FIELDS)
    lora.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH", type=parse_lora_module,
                      help="PEFT adapter folders to serve; clients send NAME as `model`")
    lora.add_argument("--allow-runtime-lora-updating", action="store_true",
                      help="expose /v1/load_lora_adapter and /v1/unload_lora_adapter (they read server-side paths)")
    engine.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="shard the model over N processes (spawned here; rank 0 serves HTTP)")


def add_parser_flags(parser: argparse.ArgumentParser) -> None:
    """The model's reasoning and tool-call formats (docs/reasoning.md, docs/tool-calling.md)."""
    from paged_backend.entrypoints.reasoning import AUTO, NONE, reasoning_parser_names
    from paged_backend.entrypoints.tool_calls import tool_parser_names

    group = parser.add_argument_group("reasoning and tool calls")
    group.add_argument("--reasoning-parser", default=AUTO, choices=[AUTO, NONE, *reasoning_parser_names()],
                       help="split the model's thinking into `reasoning` (default auto: the chat template's "
                       "markers, when they name one format; none: never)")
    group.add_argument("--tool-call-parser", default=AUTO, choices=[AUTO, *tool_parser_names()],
                       help="the format the model writes tool calls in (default auto: the chat template's, "
                       "else hermes)")


def parse_lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules takes NAME=PATH, got {text!r}")
    return name, path


def lora_config(args: argparse.Namespace) -> dict:
    """The engine's LoRA fields from the flags: adapters to serve or runtime loading turn LoRA on."""
    enabled = bool(args.enable_lora) or bool(args.lora_modules) or args.allow_runtime_lora_updating
    if not enabled:
        return {}
    fields = {"max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank}
    return {"enable_lora": True} | {k: v for k, v in fields.items() if v is not None}


def run_serve(args: argparse.Namespace) -> None:
    """Bind the port, load the model behind it (lifecycle.py: 503 until warmed up), serve until SIGTERM or
    Ctrl-C, drain, then free the engine. A model that fails to load ends the process with its error."""
    try:
        import uvicorn
    except ImportError as exc:
        raise ImportError("`serve` needs the serve extra: pip install 'paged-backend[serve]'") from exc

    from .lifecycle import DrainingServer, Lifecycle

    if args.otlp_traces_endpoint:
        tracing.export_otlp(args.otlp_traces_endpoint)
    lifecycle = Lifecycle(args.drain_timeout)
    server = DrainingServer(uvicorn.Config(lifecycle, host=args.host, port=args.port), lifecycle)
    loaded: dict = {}
    loader = threading.Thread(target=load_then_serve, args=(args, lifecycle, server, loaded), name="model-loader",
                              daemon=True)  # a signal during the load exits without waiting for it
    loader.start()
    try:
        server.run()
    finally:
        if "client" in loaded:
            loaded["client"].shutdown()
        if "llm" in loaded:
            loaded["llm"].close()
    if "error" in loaded:
        raise loaded["error"]


def load_then_serve(args: argparse.Namespace, lifecycle: Lifecycle, server: DrainingServer, loaded: dict) -> None:
    """Load and warm up the model, then hand its app to `lifecycle`; on failure, stop `server`. What it
    built goes into `loaded`, for the caller to free."""
    from paged_backend.entrypoints.async_engine import AsyncEngine
    from paged_backend.entrypoints.llm import LLM
    from paged_backend.model.loading.default_model import DEFAULT_MODEL

    from .app import create_app
    from .lifecycle import TrackedClient

    try:
        config = {name: value for name, value in engine_options(args).items() if name not in LORA_FIELDS}
        llm = loaded["llm"] = LLM(args.model, tensor_parallel_size=args.tensor_parallel_size,
                                  quantization=args.quantization, **config, **lora_config(args))
        for lora_name, path in args.lora_modules:
            llm.add_lora(lora_name, path)
        aengine = loaded["client"] = AsyncEngine(llm.engine)
        client = TrackedClient(aengine)
        name = args.served_model_name or args.model or DEFAULT_MODEL
        app = create_app(client, name, args.api_key, args.max_seqs_per_request, args.allow_runtime_lora_updating,
                         max_stored_responses=args.max_stored_responses, reasoning_parser=args.reasoning_parser,
                         tool_call_parser=args.tool_call_parser)
    except BaseException as exc:  # noqa: BLE001  (re-raised by run_serve, on the main thread)
        logger.error("the model failed to load: %s: %s", type(exc).__name__, exc)
        loaded["error"] = exc
        server.should_exit = True
        return
    lifecycle.serve(app, client)
    logger.info("ready: serving %s", name)
