"""Command-line flags generated from dataclass fields: `EngineConfig` for the engine, `SamplingParams`
for sampling. A field's flag is its name with dashes; its type comes from the field's annotation, its
help from the comment on or above the field, so adding a field adds its flag to every command.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import json
import re
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterable
from functools import cache
from typing import Any

from paged_backend.config import KV_CACHE_DTYPES, PREEMPTION_MODES, EngineConfig
from paged_backend.sampling.sampling_params import SamplingParams

from . import defaults
from .vocabularies import CLI

# Engine fields whose value is one of a few names.
ENGINE_CHOICES: dict[str, list[str]] = {"kv_cache_dtype": list(KV_CACHE_DTYPES),
                                         "preemption_mode": list(PREEMPTION_MODES)}


ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineConfig))


def add_engine_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                     names: Iterable[str] = ENGINE_FIELDS) -> None:
    """One flag per EngineConfig field named (all by default). Each defaults to None, meaning EngineConfig's
    own default (named in the help), so `engine_options` passes on only what the user set."""
    hints, docs = field_types(EngineConfig), field_comments(EngineConfig)
    fields = EngineConfig.__dataclass_fields__
    for field in (fields[name] for name in names):
        default = field.default if field.default is not dataclasses.MISSING else None
        help_text = join_help(docs.get(field.name), default)
        add_flag(parser, field.name, hints[field.name], None, help_text, ENGINE_CHOICES.get(field.name))


def add_quantization_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--quantization auto|none|int8|int4|gptq|awq|compressed-tensors`, LLM's `quantization=` ("none" is None)."""
    from paged_backend.model.quantized.quantization import AUTO, CHECKPOINT_METHODS, METHODS

    parser.add_argument("--quantization", default=AUTO, type=lambda text: None if text == "none" else text,
                        choices=[AUTO, None, *METHODS, *CHECKPOINT_METHODS],
                        metavar="{auto,none,int8,int4,gptq,awq,compressed-tensors}",
                        help="weight-only quantization of the linear layers: auto (the default model as int4 on CPU "
                             "unless --dtype float32 is named, else none), none, int8 (torchao) or int4 (CPU; a GGUF "
                             "file's Q4_1 tensors as they are); a GPTQ, AWQ or compressed-tensors folder loads as it "
                             "is, and naming its method refuses a folder in any other format")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields the user set on the command line (flags left out keep the config's default)."""
    return {name: getattr(args, name) for name in ENGINE_FIELDS if getattr(args, name, None) is not None}


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    """The command's sampling flags (vocabularies.CLI), each with defaults.CLI's default or SamplingParams' own."""
    hints, docs = field_types(SamplingParams), field_comments(SamplingParams)
    own = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
           for f in dataclasses.fields(SamplingParams)}
    for name, rule in CLI.rules.items():
        default = defaults.CLI.get(name, own[rule.field])
        add_flag(parser, name, hints[rule.field], default, join_help(docs.get(rule.field), default))


def sampling_options(args: argparse.Namespace) -> dict[str, Any]:
    """The command's sampling flags by option name, for vocabularies.CLI."""
    return {name: getattr(args, name) for name in CLI.names}


def add_flag(parser: Any, name: str, hint: Any, default: Any, help_text: str, choices: list[str] | None = None) -> None:
    flag = "--" + name.replace("_", "-")
    kind = flag_kind(hint)
    if kind is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
    elif kind is list:
        item = list_item(hint)
        if item is str:  # repeatable, one value each: a greedy list would swallow the prompts after it
            parser.add_argument(flag, action="append", default=default, help=help_text + " (repeatable)")
        else:
            parser.add_argument(flag, nargs="*", type=item, default=default, help=help_text)
    elif kind is dict:
        parser.add_argument(flag, type=json.loads, default=default, help=help_text + " (as JSON)")
    else:
        parser.add_argument(flag, type=kind, default=default, choices=choices, help=help_text)


def flag_kind(hint: Any) -> type:
    """The argument type a field's annotation asks for: bool, int, float, list or dict, else str."""
    options = [a for a in typing.get_args(hint) if a is not type(None)] if is_union(hint) else [hint]
    for kind in (bool, int, float):
        if kind in options:
            return kind
    for option in options:
        origin = typing.get_origin(option) or option
        if origin is list:
            return list
        if origin is dict:
            return dict
    return str


def list_item(hint: Any) -> type:
    for option in typing.get_args(hint) if is_union(hint) else [hint]:
        if typing.get_origin(option) is list:
            return typing.get_args(option)[0]
    return str


def is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def join_help(doc: str | None, default: Any) -> str:
    """The field's comment, then its default unless that is None or empty (the comment says what those mean)."""
    shown = "" if default in (None, []) else f"default: {default}"
    text = f"{doc} ({shown})" if doc and shown else doc or shown
    return text.replace("%", "%%")  # argparse formats help with %


@cache
def field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@cache
def field_comments(cls: type) -> dict[str, str]:
    """Each dataclass field's comment: the comment lines right above it, then the one at its end of line.
    Empty when the source cannot be read (the flags then have their defaults as help)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments = {token.start[0]: token.string.lstrip("#").strip()
                for token in tokenize.generate_tokens(io.StringIO(source).readline) if token.type == tokenize.COMMENT}
    lines = source.splitlines()
    names = set(cls.__dataclass_fields__)
    docs: dict[str, str] = {}
    for number, line in enumerate(lines, start=1):
        match = re.match(r"\s+(\w+)\s*:", line)
        if not match or match.group(1) not in names or match.group(1) in docs:
            continue
        above, previous = [], number - 1
        while previous in comments and lines[previous - 1].lstrip().startswith("#"):
            above.insert(0, comments[previous])
            previous -= 1
        docs[match.group(1)] = " ".join(above + ([comments[number]] if number in comments else []))
    return docs

