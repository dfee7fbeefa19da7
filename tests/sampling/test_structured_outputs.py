"""Structured outputs in the engine: spec validation, constrained answers, and how a grammar request
behaves beside sampling, n > 1, best_of, logprobs, stop strings, preemption, streaming and compile waits.

Mechanics run on a tiny random model with the default model's tokenizer (49,152 tokens), so its
logits are noise and only the grammar can make the answers match. Schema coverage runs on the real
default model, all schemas in one batch.
"""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest
import transformers as tf
from helpers.engine import assert_all_blocks_free, run_to_completion
from helpers.models import build_from_config

from paged_backend import Engine, EngineConfig, SamplingParams
from paged_backend.sampling.structured_outputs import StructuredOutputsParams

PLATE = r"[a-c]{3}-[0-9]{2}"


@pytest.fixture(scope="module")
def tokenizer(default_llm):
    return default_llm.tokenizer


@pytest.fixture(scope="module")
def tiny(tokenizer):
    return build_from_config(lambda: tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                                    num_hidden_layers=1, num_attention_heads=2,
                                                    num_key_value_heads=1, max_position_embeddings=256))


def make_engine(tiny, tokenizer, **config) -> Engine:
    return Engine(tiny, tokenizer, EngineConfig(**({"num_kv_blocks": 64} | config)))


def answers(engine: Engine, prompts_params: list[tuple[str, SamplingParams]]) -> list[list[str]]:
    ids = [engine.add_request(prompt, params) for prompt, params in prompts_params]
    finals = run_to_completion(engine)
    assert_all_blocks_free(engine)
    return [[c.text for c in finals[i].outputs] for i in ids]


# ---------------------------------------------------------------- the spec

@pytest.mark.parametrize("spec, named", [
    ({"json": {"type": "objec"}}, 'Unsupported type "objec"'),
    ({"json": {"$ref": "#/defs/missing"}}, "defs"),
    ({"json": {"type": "string", "minLength": 5, "maxLength": 2}}, "minLength 5 is greater than maxLength 2"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": [1, 2]}, "must be a JSON Schema object"),
    ({"regex": "(ab"}, "parenthesis is not closed"),
    ({"grammar": 'root ::= item\n'}, 'Rule "item" is not defined'),
    ({"grammar": 'start: ( "a"'}, "expected ')' after group"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", 3]}, "non-empty list of non-empty strings"),
    ({"json_object": True, "regex": "a"}, "exactly one of"),
    ({}, "exactly one of"),
    ({"jsn": {}}, "unknown field(s) ['jsn']"),
])
def test_malformed_specs_are_value_errors_naming_the_problem(spec, named):
    with pytest.raises(ValueError) as info:
        SamplingParams(structured_outputs=spec)
    assert named in str(info.value)
    assert "/project/" not in str(info.value)  # xgrammar's source location is trimmed away


def test_a_pydantic_model_is_a_schema():
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int

    spec = StructuredOutputsParams(json=Point)
    assert json.loads(spec.key[1])["properties"]["x"]["type"] == "integer"


def test_structured_outputs_need_a_tokenizer(tiny):
    engine = Engine(tiny, None, EngineConfig(num_kv_blocks=16))
    with pytest.raises(ValueError, match="need a tokenizer"):
        engine.add_request([1, 2, 3], SamplingParams(structured_outputs={"regex": "a"}))


# ---------------------------------------------------------------- mechanics on noise logits

def test_regex_and_choice_under_greedy_sampling_n_best_of_and_logprobs(tiny, tokenizer):
    engine = make_engine(tiny, tokenizer)
    regex = {"regex": PLATE}
    got = answers(engine, [
        ("plate:", SamplingParams(temperature=0, max_tokens=20, structured_outputs=regex)),
        ("plate:", SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=20, structured_outputs=regex)),
        ("plate:", SamplingParams(temperature=1.0, seed=4, n=2, best_of=4, max_tokens=20, structured_outputs=regex)),
        ("plate:", SamplingParams(temperature=1.0, seed=5, logprobs=2, max_tokens=20, structured_outputs=regex)),
        ("pick:", SamplingParams(temperature=1.0, seed=6, n=4, max_tokens=20,
                                 structured_outputs={"choice": ["red", "green", "blue (dark)"]})),
        ("free:", SamplingParams(temperature=1.0, seed=7, max_tokens=20)),
    ])
    for texts in got[:4]:
        assert all(re.fullmatch(PLATE, t) for t in texts), texts
    assert [len(t) for t in got[:4]] == [1, 3, 2, 1]
    assert set(got[4]) <= {"red", "green", "blue (dark)"}
    assert not re.fullmatch(PLATE, got[5][0])  # the unconstrained neighbour is noise


def test_the_grammar_allows_only_its_tokens_and_logprobs_stay_the_models(tiny, tokenizer):
    engine = make_engine(tiny, tokenizer)
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=0, structured_outputs={"choice": ["yes", "no"]})
    rid = engine.add_request("?", params)
    final = run_to_completion(engine)[rid].outputs[0]
    assert final.text in ("yes", "no") and final.finish_reason == "stop"
    first = final.logprobs[0][final.token_ids[0]].logprob
    assert first < 0  # the model's own log probability, not 0 from a renormalised one-token mask


def test_a_lark_grammar_holds_the_answer_like_ebnf(tiny, tokenizer):
    engine = make_engine(tiny, tokenizer)
    lark = 'start: pair\npair: WORD "=" DIGIT\nWORD: /[a-c]{2}/\nDIGIT: /[0-9]/\n'
    rid = engine.add_request("?", SamplingParams(temperature=0, max_tokens=10, structured_outputs={"grammar": lark}))
    final = run_to_completion(engine)[rid].outputs[0]
    assert re.fullmatch(r"[a-c]{2}=[0-9]", final.text) and final.finish_reason == "stop"


def test_stop_strings_cut_a_constrained_answer(tiny, tokenizer):
    engine = make_engine(tiny, tokenizer)
    params = SamplingParams(temperature=0, max_tokens=20, stop=["-"], structured_outputs={"regex": PLATE})
    rid = engine.add_request("plate:", params)
    final = run_to_completion(engine)[rid].outputs[0]
    assert re.fullmatch(r"[a-c]{3}", final.text) and final.stop_reason == "-"


def test_ignore_eos_still_ends_when_the_grammar_is_complete(tiny, tokenizer):
    engine = make_engine(tiny, tokenizer)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, structured_outputs={"regex": PLATE})
    rid = engine.add_request("plate:", params)
    final = run_to_completion(engine)[rid].outputs[0]
    assert re.fullmatch(PLATE, final.text) and final.finish_reason == "stop"


def test_preempted_constrained_requests_resume_in_their_grammar(tiny, tokenizer):
    engine = make_engine(tiny, tokenizer, num_kv_blocks=8, block_size=4)  # 32 slots for eight requests
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 3,
              "maxItems": 3}
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=24,
                            structured_outputs={"json": schema, "disable_any_whitespace": True})
    got = answers(engine, [(f"numbers {i}:", params) for i in range(8)])
    assert engine.stats()["num_preemptions"] > 0
    for (text,) in got:
        jsonschema.validate(json.loads(text), schema)


def test_streamed_deltas_concatenate_to_the_answer(tiny, tokenizer):
    engine = make_engine(tiny, tokenizer)
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=30, structured_outputs={"regex": PLATE})
    rid = engine.add_request("plate:", params, stream=True)
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            deltas.append(output.delta_text)
            final = output
    assert len(deltas) > 2 and "".join(deltas) == final.outputs[0].text
    assert re.fullmatch(PLATE, final.outputs[0].text) and final.request_id == rid


def test_a_compiling_grammar_holds_up_no_one(tiny, tokenizer, monkeypatch):
    from paged_backend.sampling import grammar

    release = threading.Event()
    real_compile = grammar.Grammars.compile
    monkeypatch.setattr(grammar.Grammars, "compile", lambda self, key: release.wait(30) and real_compile(self, key))
    engine = make_engine(tiny, tokenizer)
    slow = engine.add_request("plate:", SamplingParams(temperature=0, max_tokens=20,
                                                       structured_outputs={"regex": "z{2}[0-9]"}))
    added = time.perf_counter()
    plain = engine.add_request("free:", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    finished = []
    while plain not in finished:
        finished += [o.request_id for o in engine.step() if o.finished]
    assert slow not in finished and engine.has_unfinished_requests()
    held = time.perf_counter() - added
    release.set()
    final = run_to_completion(engine)[slow].outputs[0]
    assert re.fullmatch("z{2}[0-9]", final.text)
    assert_all_blocks_free(engine)
    stats = engine.stats()  # what /metrics reports of grammar waits
    assert stats["structured_requests_started"] == 1 and stats["structured_grammar_wait_seconds"] >= held


def test_a_grammar_that_fails_to_compile_ends_only_its_request(tiny, tokenizer, monkeypatch):
    from paged_backend.sampling import grammar

    def fail(self, key):
        raise RuntimeError("out of memory while compiling")

    monkeypatch.setattr(grammar.Grammars, "compile", fail)
    engine = make_engine(tiny, tokenizer)
    bad = engine.add_request("x", SamplingParams(n=2, max_tokens=5, structured_outputs={"regex": "q+"}))
    good = engine.add_request("y", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    finals = run_to_completion(engine)
    assert "could not be compiled: out of memory" in finals[bad].error
    assert [c.finish_reason for c in finals[bad].outputs] == ["abort", "abort"]
    assert len(finals[good].outputs[0].token_ids) == 4 and finals[good].error is None
    assert_all_blocks_free(engine)


def test_an_aborted_request_waiting_for_its_grammar_is_gone(tiny, tokenizer, monkeypatch):
    from paged_backend.sampling import grammar

    release = threading.Event()
    monkeypatch.setattr(grammar.Grammars, "compile", lambda self, key: release.wait(30))
    engine = make_engine(tiny, tokenizer)
    rid = engine.add_request("x", SamplingParams(max_tokens=5, structured_outputs={"regex": "q+"}))
    engine.step()
    engine.abort_request(rid)
    release.set()
    finals = run_to_completion(engine)
    assert finals[rid].outputs[0].finish_reason == "abort" and not engine.has_unfinished_requests()


# ---------------------------------------------------------------- schema coverage

# Every string, number, array and map is bounded: on noise logits only the grammar ends an answer.
NODE = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                         "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#"}}},
        "required": ["name", "children"]}

SCHEMAS = {
    "anyOf": {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                                                               {"type": "string", "maxLength": 4}]}},
              "required": ["id"]},
    "oneOf": {"oneOf": [{"type": "object", "properties": {"cat": {"type": "string", "maxLength": 5}},
                         "required": ["cat"]},
                        {"type": "object", "properties": {"dog": {"type": "boolean"}}, "required": ["dog"]}]},
    "map": {"type": "object", "additionalProperties": {"type": "boolean"}, "maxProperties": 2,
            "propertyNames": {"maxLength": 3}},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
                "required": ["code"]},
    "enum_const": {"type": "object", "properties": {"colour": {"enum": ["red", "green", 7]}, "v": {"const": [2]}},
                   "required": ["colour", "v"]},
    "nested_array": {"type": "object", "properties": {"people": {"type": "array", "minItems": 1, "maxItems": 2,
                                                                 "items": {"type": "object", "properties": {
                                                                     "name": {"type": "string", "maxLength": 5},
                                                                     "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 120}},
                                                                     "required": ["name", "age"]}}},
                     "required": ["people"]},
    "recursive": NODE,
    "string_length": {"type": "object", "properties": {"word": {"type": "string", "minLength": 3, "maxLength": 5}},
                      "required": ["word"]},
    "number_bounds": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 20},
                                                       "m": {"type": "integer", "exclusiveMinimum": -3,
                                                             "exclusiveMaximum": 0}},
                      "required": ["n", "m"]},
}


@pytest.mark.parametrize("seed", [0, 1])
def test_answers_validate_against_their_schemas(tiny, tokenizer, seed):
    engine = make_engine(tiny, tokenizer, num_kv_blocks=256)
    got = answers(engine, [("json:", SamplingParams(temperature=1.0, seed=seed, max_tokens=200, structured_outputs={
        "json": schema, "disable_any_whitespace": True})) for schema in SCHEMAS.values()])
    for name, (text,) in zip(SCHEMAS, got):
        jsonschema.validate(json.loads(text), SCHEMAS[name])


# ---------------------------------------------------------------- transformers entry points

def test_generate_paged_takes_structured_outputs(tiny, tokenizer):
    import torch

    ids = torch.tensor([tokenizer("plate:")["input_ids"]] * 2)
    out = tiny.generate(ids, cache_implementation="paged", max_new_tokens=20, do_sample=True,
                        structured_outputs={"regex": PLATE}, tokenizer=tokenizer)
    for row in out[:, ids.shape[1]:]:
        assert re.fullmatch(PLATE, tokenizer.decode(row, skip_special_tokens=True))
    with pytest.raises(ValueError, match="pass tokenizer= to generate"):
        tiny.generate(ids, cache_implementation="paged", max_new_tokens=4, structured_outputs={"regex": PLATE})


def test_the_pipeline_takes_structured_outputs(tiny, tokenizer):
    from paged_backend import pipeline

    pipe = pipeline(model=tiny, tokenizer=tokenizer, engine_config=EngineConfig(num_kv_blocks=64))
    results = pipe(["plate:", "another plate:"], max_new_tokens=20, do_sample=True, return_full_text=False,
                   structured_outputs={"choice": ["AB-12", "CD-34"]})
    assert [r[0]["generated_text"] in ("AB-12", "CD-34") for r in results] == [True, True]
