"""The `paged-backend` command: generate, chat, and (with the serve extra) an OpenAI-compatible server."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from paged_backend.integrations.options.flags import (
    add_engine_flags,
    add_quantization_flag,
    add_sampling_flags,
    engine_options,
    sampling_options,
)
from paged_backend.integrations.options.vocabularies import CLI
from paged_backend.model.loading.default_model import CacheNotWritableError
from paged_backend.sampling.sampling_params import SamplingParams


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.run(args) or 0
    except CacheNotWritableError as exc:  # the user's setup to change, not a bug: the message says what to set
        sys.exit(f"paged-backend: {exc}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paged-backend", description=__doc__)
    commands = parser.add_subparsers(dest="command")
    gen = commands.add_parser("generate", help="generate text for prompts (arguments or a file)")
    gen.add_argument("prompts", nargs="*", help="prompts; each is sent through the chat template unless --raw")
    gen.add_argument("--file", type=Path, help="a file with one prompt per line")
    gen.add_argument("--raw", action="store_true", help="send prompts as plain text, without the chat template")
    add_model_arguments(gen)
    add_sampling_flags(gen)
    gen.set_defaults(run=run_generate)
    chat = commands.add_parser("chat", help="an interactive chat loop")
    chat.add_argument("--system", help="a system message")
    add_model_arguments(chat)
    add_sampling_flags(chat)
    chat.set_defaults(run=run_chat)
    add_serve_command(commands)
    return parser


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="hub id, folder, .gguf file (default: SmolLM2-135M-Instruct)")
    add_quantization_flag(parser)
    add_engine_flags(parser.add_argument_group("engine"))


def add_serve_command(commands) -> None:
    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the serve extra)")
    try:
        from paged_backend.integrations.server.cli import add_serve_arguments, run_serve
    except ImportError as exc:
        message = f"the server needs the serve extra: pip install 'paged-backend[serve]' ({exc})"
        serve.set_defaults(run=lambda args: sys.exit(message))
        return
    add_serve_arguments(serve)
    serve.set_defaults(run=run_serve)


def make_llm(args: argparse.Namespace):
    from transformers.utils import logging as hf_logging

    from paged_backend.entrypoints.llm import LLM

    hf_logging.disable_progress_bar()  # the terminal is for the answer, not transformers' weight-loading bar
    return LLM(args.model, quantization=args.quantization, **engine_options(args))


def make_params(args: argparse.Namespace) -> SamplingParams:
    return CLI.params(sampling_options(args))


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.file:
        prompts += [line.strip() for line in args.file.read_text().splitlines() if line.strip()]
    if not prompts and not sys.stdin.isatty():
        prompts = [line.strip() for line in sys.stdin if line.strip()]
    return prompts


def run_generate(args: argparse.Namespace) -> int:
    prompts = read_prompts(args)
    if not prompts:
        sys.exit("no prompts: pass them as arguments, with --file, or on standard input")
    params = make_params(args)  # validate before the model loads
    llm = make_llm(args)
    inputs = prompts if args.raw or not has_chat_template(llm) else [chat_ids(llm, [user(p)]) for p in prompts]
    if len(inputs) == 1:
        stream_one(llm, inputs[0], params)
        return 0
    for prompt, output in zip(prompts, llm.generate(inputs, params, use_tqdm=True)):
        print(f"### {prompt}\n{output.outputs[0].text}\n")
    return 0


def run_chat(args: argparse.Namespace) -> int:
    params = make_params(args)
    llm = make_llm(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    print("Type a message; an empty line or Ctrl-D quits.")
    while True:
        try:
            message = input("> ").strip()
        except EOFError:
            break
        if not message:
            break
        history.append(user(message))
        answer = stream_one(llm, chat_ids(llm, history), params)
        history.append({"role": "assistant", "content": answer})
    return 0


def stream_one(llm, prompt, params: SamplingParams) -> str:
    """Print the answer as it is generated; return its full text."""
    engine = llm.engine
    request_id = engine.add_request(prompt, params)
    text = ""
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id:
                print(output.delta_text, end="", flush=True)
                text = output.outputs[0].text
    print()
    return text


def has_chat_template(llm) -> bool:
    return llm.tokenizer is not None and getattr(llm.tokenizer, "chat_template", None) is not None


def chat_ids(llm, conversation: list[dict]) -> list[int]:
    return llm.render_chat(conversation, add_generation_prompt=True, tools=None, extra={})


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


if __name__ == "__main__":
    sys.exit(main())
