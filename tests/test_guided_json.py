"""Guided JSON: the writers follow a schema's shape, the token rules keep each value valid JSON, and a
random model held to the rules writes only valid values."""

from __future__ import annotations

import json
from typing import Any

import pytest
import transformers as tf
from engine_helpers import assert_all_blocks_free, run_to_completion
from paged_backend.integrations.guided_json import (
    MAX_FREE_DEPTH,
    NUMBER_STOPS,
    Ask,
    ChoiceRule,
    NumberRule,
    UnsupportedSchema,
    check_writer,
    default_answer,
    repair_number,
    resolve_choice,
    value_params,
    value_processor,
    value_starts,
    vocab_for,
    write_free_object,
    write_value,
)
from pydantic import BaseModel
from tiny_models import build
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from paged_backend import Engine, EngineConfig, SamplingParams


def answer_writer(writer, answers: list[str]) -> tuple[str, list[Ask]]:
    """Drive a guided writer with canned model answers; return its text and what it asked for."""
    asks = []
    try:
        ask = next(writer)
        for answer in answers:
            asks.append(ask)
            ask = writer.send(answer)
    except StopIteration as end:
        return end.value, asks
    raise AssertionError(f"the writer asked for more values than given; next: {ask}")


def run(schema: dict[str, Any], answers: list[str]) -> tuple[str, list[Ask]]:
    return answer_writer(write_value("", schema), answers)


class Address(BaseModel):
    city: str
    zip_code: int | None


class Person(BaseModel):
    name: str
    height_m: float
    admin: bool
    address: Address
    tags: list[str]


def test_a_nested_pydantic_schema_is_written_with_only_the_values_asked():
    answers = ['Ada "L"', "1.7", "true", "Paris", "75001", 'x', ",", "y", "]"]
    text, asks = run(Person.model_json_schema(), answers)
    assert json.loads(text) == {"name": 'Ada "L"', "height_m": 1.7, "admin": True,
                                "address": {"city": "Paris", "zip_code": 75001}, "tags": ["x", "y"]}
    assert text.startswith('{"name": "')
    assert [type(a.rule).__name__ for a in asks] == ["NoneType", "NumberRule", "ChoiceRule", "NoneType",
                                                     "NumberRule", "NoneType", "ChoiceRule", "NoneType", "ChoiceRule"]
    assert asks[1].rule == NumberRule(integer=False) and asks[4].rule == NumberRule(integer=True)
    assert asks[1].stops == NUMBER_STOPS and asks[0].stops == ['"']
    assert asks[2].rule == ChoiceRule(("true", "false")) and asks[6].rule == ChoiceRule((",", "]"))


def test_enums_consts_nulls_and_item_bounds():
    schema = {"type": "object", "properties": {
        "colour": {"enum": ["red", "green", 3]},
        "kind": {"const": "fixed"},
        "nothing": {"type": "null"},
        "pair": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
    }}
    text, asks = run(schema, ["3", "4", "5"])
    assert json.loads(text) == {"colour": 3, "kind": "fixed", "nothing": None, "pair": [4, 5]}
    assert asks[0].rule == ChoiceRule(('"red"', '"green"', "3")) and len(asks) == 3  # no choice between 2 items


def test_a_free_object_lets_the_model_choose_keys_types_and_ends():
    answers = ['"', 'a "b"', " [", "1", "2", ",", " {", "}", "]", ",", "x", " -", "5", "}"]
    text, asks = answer_writer(write_free_object(""), answers)
    assert json.loads(text) == {'a "b"': [12, {}], "x": -5}
    assert text == '{"a \\"b\\"": [12, {}], "x": -5}'
    assert asks[0].rule == ChoiceRule(('"', "}")) and asks[-2].rule == NumberRule(integer=False, prefix="-")
    # Past MAX_FREE_DEPTH the model may no longer open objects or arrays.
    assert "{" not in value_starts(MAX_FREE_DEPTH) and value_starts(0)[-1] == "null"
    # Defaults (a spent max_tokens) close whatever is open.
    walker = write_free_object("")
    check_writer(walker)


def test_what_the_model_wrote_is_made_valid_when_cut_short():
    assert repair_number("12.", integer=False) == "12" and repair_number("-", integer=True) == "0"
    assert repair_number("1e5", integer=False) == "1e5" and repair_number("1e5", integer=True) == "1"
    assert resolve_choice("fal", ["true", "false"]) == "false" and resolve_choice("", ["true", "false"]) == "true"


@pytest.mark.parametrize("schema, feature", [
    ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, "anyOf with several"),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, "additionalProperties"),
    ({"$ref": "http://example.com/s.json"}, "non-local"),
    ({"type": "array", "prefixItems": [{"type": "string"}]}, "without one 'items'"),
    ({"type": ["string", "integer"]}, "several non-null types"),
    ({"description": "no type"}, "without a type"),
    ({"type": "object", "properties": {"next": {"$ref": "#"}}}, "nested deeper"),  # a linked list
])
def test_unsupported_schemas_are_named_before_anything_runs(schema, feature):
    with pytest.raises(UnsupportedSchema, match=feature):
        check_writer(write_value("", schema))


def test_value_params_keep_sampling_but_cap_rule_values():
    user = SamplingParams(temperature=0.5, max_tokens=200, stop=["END"], ignore_eos=True, n=2)
    number = value_params(Ask("x", NUMBER_STOPS, NumberRule(integer=True)), user)
    assert (number.temperature, number.n, number.ignore_eos) == (0.5, 1, False)
    assert number.max_tokens == 24 and number.stop == ["END", *NUMBER_STOPS]
    assert value_params(Ask("x", [], ChoiceRule(("true", "false"))), user).max_tokens == 6
    # Later values get what is left of the call's max_tokens; once it is spent, the model is not asked.
    string = Ask('x"', ['"'])
    assert value_params(string, user, generated=150).max_tokens == 50
    assert value_params(Ask("x", [], ChoiceRule(("true", "false"))), user, generated=198).max_tokens == 2
    assert value_params(string, user, generated=200) is None
    assert value_params(string, SamplingParams(max_tokens=None), generated=10**6).max_tokens is None


# ------------------------------------------------------------------ the rules, on a byte-level vocabulary


@pytest.fixture(scope="module")
def tokenizer() -> tf.PreTrainedTokenizerFast:
    """Byte-level BPE without merges: token i is one byte, so every rule decision is visible."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    raw = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_object=raw)
    tokenizer.add_special_tokens({"eos_token": "<eos>"})
    return tokenizer


def allowed_texts(tokenizer, rule, written: str) -> set[str]:
    import torch

    vocab = vocab_for(tokenizer)
    row = value_processor(rule, vocab)(tokenizer(written)["input_ids"] if written else [], torch.zeros(len(tokenizer)))
    return {vocab.texts[i] if i not in vocab.eos_ids else "EOS" for i in torch.nonzero(row == 0).flatten().tolist()}


def test_number_rule_follows_the_json_grammar(tokenizer):
    digits = set("0123456789")
    assert allowed_texts(tokenizer, NumberRule(integer=False), "") == digits | {"-"}
    assert allowed_texts(tokenizer, NumberRule(integer=False), "0") == {".", "e", "E", ",", "}", "]", "\n", "EOS"}
    assert allowed_texts(tokenizer, NumberRule(integer=False), "1.") == digits
    assert allowed_texts(tokenizer, NumberRule(integer=False), "1.5e") == digits | {"+", "-"}
    assert allowed_texts(tokenizer, NumberRule(integer=True), "12") == digits | {",", "}", "]", "\n", "EOS"}


def test_choice_rule_allows_only_the_options_prefixes(tokenizer):
    rule = ChoiceRule(("true", "false", '"t"'))
    assert allowed_texts(tokenizer, rule, "") == {"t", "f", '"'}
    assert allowed_texts(tokenizer, rule, "tr") == {"u"}
    assert allowed_texts(tokenizer, rule, "true") == {"EOS"}


def test_a_random_model_held_to_the_rules_writes_valid_values(tokenizer):
    """A tiny random Llama left alone writes noise; under each rule every sample is a valid value."""
    model = build("llama")
    model.resize_token_embeddings(len(tokenizer))  # room for the tokenizer's <eos>, which ends a choice
    engine = Engine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    vocab = vocab_for(tokenizer)
    asks = [Ask("n: ", NUMBER_STOPS, NumberRule(integer=False)), Ask("i: ", NUMBER_STOPS, NumberRule(integer=True)),
            Ask("b: ", [], ChoiceRule(("true", "false", "null")))]
    ids = {}
    for k, ask in enumerate(asks):
        for seed in range(8):
            params = value_params(ask, SamplingParams(temperature=1.0, max_tokens=40, seed=seed))
            ids[engine.add_request(ask.text, params, logits_processor=value_processor(ask.rule, vocab))] = k
    finals = run_to_completion(engine)
    for request_id, k in ids.items():
        text = finals[request_id].outputs[0].text
        if k < 2:
            value = repair_number(text, integer=k == 1)
            assert text.startswith(value) and text[len(value):] in ("", *NUMBER_STOPS), text
            assert isinstance(json.loads(value), int if k == 1 else (int, float))
        else:
            assert text in ("true", "false", "null"), text
    assert_all_blocks_free(engine)



def drive(engine: Engine, vocab, writer, prompt: str, params: SamplingParams) -> str:
    """A minimal adapter: each value is one engine request on the prompt plus the text so far."""
    generated = 0
    try:
        ask = next(writer)
        while True:
            value = value_params(ask, params, generated)
            if value is None:
                ask = writer.send(default_answer(ask))
                continue
            processor = None if ask.rule is None else value_processor(ask.rule, vocab)
            rid = engine.add_request(prompt + ask.text, value, logits_processor=processor)
            out = run_to_completion(engine)[rid].outputs[0]
            generated += len(out.token_ids)
            ask = writer.send(out.text)
    except StopIteration as end:
        return end.value


@pytest.mark.parametrize("max_tokens", [6, 60])
def test_a_random_model_writes_valid_free_json_objects(tokenizer, max_tokens):
    """json_object on noise: whatever the model picks, and wherever max_tokens cuts it, the answer parses."""
    model = build("llama")
    model.resize_token_embeddings(len(tokenizer))
    engine = Engine(model, tokenizer, EngineConfig(num_kv_blocks=256, max_model_len=2048))
    vocab = vocab_for(tokenizer)
    for seed in range(4):
        text = drive(engine, vocab, write_free_object(""), "json: ",
                     SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens))
        assert isinstance(json.loads(text), dict), text
    assert_all_blocks_free(engine)
