"""The option vocabularies' translation tables, the defaults table, and the flags generated from
EngineConfig and SamplingParams: each table maps every option it claims onto its field, options outside
a table are refused by name, and every engine field has a flag under its old name."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from paged_backend.integrations.langchain.options import PagedOptions
from paged_backend.integrations.options import defaults
from paged_backend.integrations.options.flags import add_engine_flags, engine_options, field_comments
from paged_backend.integrations.options.schema import options_model
from paged_backend.integrations.options.translation import table, wire
from paged_backend.integrations.options.vocabularies import (
    CLI,
    GENERATION_CONFIG,
    LANGCHAIN,
    OPENAI,
    SAMPLING_PARAMS,
)
from paged_backend.integrations.server.cli import add_serve_arguments
from paged_backend.integrations.server.protocol import (
    NEUTRAL_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from paged_backend.integrations.server.sampling import to_sampling_params
from pydantic import ConfigDict, ValidationError

from paged_backend import EngineConfig, SamplingParams, StructuredOutputsParams
from paged_backend.integrations.cli import build_parser, make_params

# A value for each option that differs from its field's default, in the option's own vocabulary.
VALUES = {
    "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2,
    "presence_penalty": 0.5, "frequency_penalty": -0.5, "seed": 7, "max_tokens": 9, "min_tokens": 2, "n": 2,
    "best_of": 3, "stop": "END", "stop_token_ids": [3, 4], "ignore_eos": True, "skip_special_tokens": False,
    "include_stop_str_in_output": True, "logprobs": 2, "prompt_logprobs": 1,
    "structured_outputs": {"regex": "a+"}, "truncate_prompt_tokens": 4,
    "do_sample": False, "max_new_tokens": 9, "eos_token_id": 5,
}
EXPECTED = {"stop": ["END"], "stop_token_ids": [3, 4], "structured_outputs": StructuredOutputsParams(regex="a+"),
            "temperature": 0.5}
DEFAULT = SamplingParams()


@pytest.mark.parametrize("vocabulary", [OPENAI, SAMPLING_PARAMS, LANGCHAIN, GENERATION_CONFIG, CLI],
                         ids=lambda v: v.vocabulary)
def test_every_option_of_a_vocabulary_reaches_its_field(vocabulary) -> None:
    for name, rule in vocabulary.rules.items():
        value = VALUES[name]
        params = vocabulary.params({name: value} | ({"n": 2} if name == "best_of" else {}))
        got = getattr(params, rule.field)
        assert got != getattr(DEFAULT, rule.field), name
        if name == "do_sample":
            assert got == 0.0  # greedy
        elif name == "eos_token_id":
            assert got == [5]
        else:
            assert got == EXPECTED.get(rule.field, value), name


def test_options_outside_a_vocabulary_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown LangChain options: colour"):
        LANGCHAIN.params({"colour": "red", "temperature": 0})
    assert SAMPLING_PARAMS.unknown({"beam_width": 3, "n": 1}) == ["beam_width"]
    with pytest.raises(NotImplementedError, match="frobnicate"):  # LangChain's own wording, engine never built
        PagedOptions().sampling_params(None, {"frobnicate": True})


def test_openai_request_fields_go_through_the_table() -> None:
    """Every field OPENAI names is a request field, and a request setting each one gets each one."""
    fields = {name: VALUES[name] for name in OPENAI.names}
    request = CompletionRequest(model="m", prompt="x", **fields)
    params = to_sampling_params(request, max_tokens=9, logprobs=2)
    for name, rule in OPENAI.rules.items():
        assert getattr(params, rule.field) == EXPECTED.get(rule.field, VALUES[name]), name
    assert (params.max_tokens, params.logprobs) == (9, 2)


def test_a_schema_vocabulary_declares_its_options_from_its_rows() -> None:
    """A table's Wire gives the generated field its type, default, range, item range and description."""
    rows = table("test", {"top_k": ("top_k", wire(int, 3, "how many", ge=1)),
                          "stop_token_ids": ("stop_token_ids", wire(list[int] | None, items={"ge": 0}))})
    model = options_model("TestOptions", rows, ConfigDict(extra="forbid", strict=True))
    assert model().top_k == 3 and model.model_fields["top_k"].description == "how many"
    assert model(stop_token_ids=[0, 2]).stop_token_ids == [0, 2]
    for bad in ({"top_k": 0}, {"top_k": "2"}, {"stop_token_ids": [-1]}, {"colour": "red"}):
        with pytest.raises(ValidationError):
            model(**bad)
    with pytest.raises(TypeError, match="no Wire"):
        options_model("Untyped", table("untyped", {"seed": "seed"}), ConfigDict())


@pytest.mark.parametrize(("vocabulary", "front_end"), [(OPENAI, SamplingFields), (LANGCHAIN, PagedOptions)],
                         ids=["server", "langchain"])
def test_front_end_sampling_fields_are_their_tables_rows(vocabulary, front_end) -> None:
    for name, rule in vocabulary.rules.items():
        declared = front_end.model_fields[name]
        assert (declared.default, declared.description) == (rule.wire.default, rule.wire.description), name
    with pytest.raises(ValidationError, match="less than or equal to 2"):
        CompletionRequest(model="m", prompt="x", temperature=2.5)  # OPENAI's range on the server


def test_langchain_constructor_fields_and_call_overrides_go_through_the_table() -> None:
    options = PagedOptions(top_k=5, stop=["A"])
    params = options.sampling_params(["B"], {"seed": 7, "stop": None})
    assert (params.top_k, params.seed, params.stop) == (5, 7, ["A", "B"])
    assert set(PagedOptions.model_fields) >= LANGCHAIN.names


def test_each_front_end_default_comes_from_the_defaults_table() -> None:
    assert SamplingParams().temperature == 1.0 and SamplingParams().max_tokens == 16
    completion = to_sampling_params(CompletionRequest(model="m", prompt="x"), 16, None)
    assert completion.temperature == defaults.OPENAI["temperature"] == 1.0
    assert CompletionRequest(model="m", prompt="x").max_tokens == defaults.OPENAI["completion_max_tokens"] == 16
    assert ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}]).max_tokens is None
    langchain = PagedOptions().sampling_params(None, {})
    assert (langchain.temperature, langchain.max_tokens) == (0.7, 512)
    cli = make_params(build_parser().parse_args(["generate", "hi"]))
    assert (cli.temperature, cli.max_tokens, cli.greedy) == (0.0, 256, True)


def test_cli_sampling_flags_keep_their_names() -> None:
    args = build_parser().parse_args(["generate", "--max-tokens", "5", "--temperature", "0.3", "--top-k", "4",
                                      "--top-p", "0.8", "--min-p", "0.05", "--repetition-penalty", "1.1",
                                      "--seed", "3", "--stop", "A", "--stop", "B", "--truncate-prompt-tokens", "8",
                                      "hi"])
    params = make_params(args)
    assert (params.max_tokens, params.temperature, params.top_k, params.top_p, params.min_p,
            params.repetition_penalty, params.seed, params.stop, params.truncate_prompt_tokens) == (
        5, 0.3, 4, 0.8, 0.05, 1.1, 3, ["A", "B"], 8)
    assert args.prompts == ["hi"]  # a repeatable flag takes one value: the prompt after it stays a prompt


OLD_ENGINE_FLAGS = ["--block-size", "8", "--num-kv-blocks", "10", "--kv-cache-bytes", "4096",
                    "--max-num-batched-tokens", "64", "--max-num-seqs", "4", "--max-model-len", "128",
                    "--dtype", "float32", "--device", "cpu", "--kv-cache-dtype", "int8"]
OLD_ENGINE_VALUES = {"block_size": 8, "num_kv_blocks": 10, "kv_cache_bytes": 4096, "max_num_batched_tokens": 64,
                     "max_num_seqs": 4, "max_model_len": 128, "dtype": "float32", "device": "cpu",
                     "kv_cache_dtype": "int8"}


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser


def test_engine_flags_keep_their_names_and_pass_on_only_what_was_set() -> None:
    cli = build_parser().parse_args(["generate", *OLD_ENGINE_FLAGS, "--quantization", "int8", "hi"])
    assert engine_options(cli) == OLD_ENGINE_VALUES and cli.quantization == "int8"
    serve = serve_parser().parse_args([*OLD_ENGINE_FLAGS, "--quantization", "int8", "--tensor-parallel-size", "2",
                                       "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                                       "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"])
    assert engine_options(serve) == OLD_ENGINE_VALUES | {
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 2},
        "enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    EngineConfig(**engine_options(serve))  # what the flags give is a valid config
    assert engine_options(build_parser().parse_args(["generate", "hi"])) == {}  # EngineConfig's own defaults


def test_every_engine_field_has_a_flag_of_its_type_with_its_comment_as_help() -> None:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    actions = {action.dest: action for action in parser._actions}
    for field in dataclasses.fields(EngineConfig):
        assert field.name in actions, field.name
    args = parser.parse_args(["--no-enable-prefix-caching", "--cuda-graph-sizes", "1", "2", "--compile",
                              "--num-threads", "2"])
    assert engine_options(args) == {"enable_prefix_caching": False, "cuda_graph_sizes": [1, 2], "compile": True,
                                    "num_threads": 2}
    assert engine_options(parser.parse_args(["--cuda-graph-sizes"])) == {"cuda_graph_sizes": []}
    assert "token budget of one step" in actions["max_num_batched_tokens"].help
    assert "default: 512" in actions["max_num_batched_tokens"].help
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp8"])


def test_field_comments_read_the_comment_above_and_at_the_end_of_a_field() -> None:
    comments = field_comments(EngineConfig)
    assert comments["num_kv_blocks"] == "wins over kv_cache_bytes when set"
    assert comments["self_check"].startswith("At start-up, run a few tokens")
    assert field_comments(SamplingParams)["temperature"] == "0 means greedy"


# Request fields that are not sampling options, or reach SamplingParams by another path (named where).
OPENAI_ELSEWHERE = {"model", "stream", "stream_options", "user",  # what to run and how to answer
                    "n",  # with_choices: the request's samples
                    "logit_bias",  # a per-request logits processor (server/sampling.py)
                    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"}  # structured.py
LANGCHAIN_ELSEWHERE = {"model", "tokenizer", "engine_config", "model_name", "timeout", "streaming", "lora"}


def test_no_front_end_field_is_left_out_of_its_table() -> None:
    """A sampling field a front end declares but its table lacks would be silently ignored: every field is
    in the table, refused at any non-neutral value, or reaches the engine by a path named above."""
    assert set(SamplingFields.model_fields) - OPENAI.names - set(NEUTRAL_FIELDS) == OPENAI_ELSEWHERE
    assert set(PagedOptions.model_fields) - LANGCHAIN.names == LANGCHAIN_ELSEWHERE
    assert not OPENAI.names & set(NEUTRAL_FIELDS)
