"""Speculative decoding: proposals verified in the step change nothing but the speed.

Greedy output with speculation equals output without it (and HF generate) through mixed batches,
chunked prefill, preemption, prefix hits and stop strings; sampled output keeps the target
distribution (checked against exact probabilities) and a seeded request gets the very tokens it gets
without speculation; every block comes back. Besides the n-gram proposer, an oracle proposer that
knows the answer and corrupts some positions drives long accepted runs, partial acceptance and
rejections on purpose.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers as tf
from helpers.engine import (
    assert_all_blocks_free,
    hf_case,
    hf_greedy,
    mixed_prompts,
    one_thread,  # noqa: F401  (autouse: this module runs on one thread)
    run_to_completion,
)
from helpers.models import build, build_from_config
from helpers.tolerances import approx
from tokenizers import Tokenizer, models, pre_tokenizers

from paged_backend import Engine, EngineConfig, SamplingParams
from paged_backend.speculative.ngram_proposer import propose_ngram
from paged_backend.speculative.speculative_config import SpeculativeConfig

MAX_NEW = 20
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "max_step_tokens": 512}


# ---------------------------------------------------------------- the pieces


def test_ngram_proposes_what_followed_the_earliest_longest_match():
    tokens = np.array([5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7])
    assert propose_ngram(tokens, 3, 1, 2) == [8, 9]  # "6 7" first occurred at 1, then "8 9"
    assert propose_ngram(tokens, 3, 3, 2) == []  # "3 6 7" never occurred before
    assert propose_ngram(np.array([1, 2, 3, 1, 2]), 2, 1, 5) == [3, 1, 2]  # overlapping the suffix
    assert propose_ngram(np.array([4]), 3, 1, 3) == []


def test_config_from_dict_and_errors():
    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                              "prompt_lookup_max": 4})
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=4,
                                                          prompt_lookup_min=2)
    draft = EngineConfig(speculative_config={"model": "some/folder", "num_speculative_tokens": 2}).speculative_config
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "some/folder", 2)
    with pytest.raises(ValueError, match="needs 'model'"):
        EngineConfig(speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="'model' is for method 'draft_model'"):
        EngineConfig(speculative_config={"method": "ngram", "model": "x"})
    with pytest.raises(ValueError, match="unknown keys"):
        EngineConfig(speculative_config={"method": "ngram", "k": 2})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(speculative_config={"prompt_lookup_min": 3, "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_config={"num_speculative_tokens": 0})


# ---------------------------------------------------------------- an oracle proposer


def oracle(engine: Engine, answers: dict[tuple[int, ...], list[int]], wrong_every: int = 5):
    """A proposer that proposes the known answer, with every `wrong_every`-th position (counted along the
    output) replaced by a wrong token: long accepted runs, partial acceptance and rejections."""
    k = engine.speculator.config.num_speculative_tokens
    vocab = engine.vocab_size

    def propose(request, limit):
        answer = answers[tuple(request.prompt_token_ids)]
        start = request.num_output_tokens
        proposals = answer[start : start + min(k, limit)]
        return [(t + 1) % vocab if (start + j) % wrong_every == wrong_every - 1 else t
                for j, t in enumerate(proposals)]

    engine.speculator.propose = propose
    return engine


def run(model, prompts, params, config: EngineConfig, answers=None, tokenizer=None, late_from=None):
    """Outputs of `prompts` (the ones from `late_from` on joining after three steps), the engine checked for
    leaked blocks."""
    engine = Engine(model, tokenizer, config)
    if answers is not None:
        oracle(engine, answers)
    late_from = len(prompts) if late_from is None else late_from
    ids = [engine.add_request(p, params) for p in prompts[:late_from]]
    finals = {}
    for _ in range(3):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    ids += [engine.add_request(p, params) for p in prompts[late_from:]]
    finals.update(run_to_completion(engine))
    assert_all_blocks_free(engine)
    return [finals[i].outputs[0] for i in ids], engine


def greedy(max_tokens: int = MAX_NEW, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


ARCHS = ["llama", "gemma", "gpt_neox"]


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request):
    return hf_case(request.param, build(request.param), MAX_NEW)


SCENARIOS = {
    "mixed": dict(num_kv_blocks=64),
    "chunked": dict(num_kv_blocks=64, max_num_batched_tokens=16),
    "preemption": dict(num_kv_blocks=20, block_size=4, max_num_batched_tokens=24),
}


def draft_config(draft, k: int = 3, **extra) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k, "max_step_tokens": 512, **extra}


def spec_config(proposer: str, model, arch: str) -> dict:
    """ngram/oracle: n-gram lookup (the oracle replaces its proposals); draft: a tiny random draft model of
    the same architecture (other weights: nearly every proposal rejected); self: the target as its own draft."""
    if proposer == "draft":
        return draft_config(build(arch, seed=1))
    if proposer == "self":
        return draft_config(model)
    return NGRAM


@pytest.mark.parametrize("scenario, proposer", [(s, "oracle") for s in sorted(SCENARIOS)] + [("chunked", "ngram")]
                         + [("mixed", "draft"), ("preemption", "draft"), ("chunked", "self"), ("preemption", "self")])
def test_greedy_identity(arch_case, scenario, proposer):
    arch, model, prompts, refs = arch_case
    answers = {tuple(p): r for p, r in zip(prompts, refs)} if proposer == "oracle" else None
    config = EngineConfig(speculative_config=spec_config(proposer, model, arch), **SCENARIOS[scenario])
    outputs, engine = run(model, prompts, greedy(), config, answers, late_from=5)
    assert [o.token_ids for o in outputs] == refs
    assert all(o.finish_reason == "length" for o in outputs)
    stats = engine.stats()
    assert stats["spec_num_draft_tokens"] > 0
    if proposer == "oracle":
        assert stats["spec_acceptance_rate"] > 0.5 and stats["spec_mean_accepted_length"] > 2
        assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    if proposer == "self":  # the same weights propose what the target picks (up to batched rounding)
        assert stats["spec_acceptance_rate"] > 0.9 and stats["spec_mean_accepted_length"] > 3
    if scenario == "preemption":
        assert stats["num_preemptions"] > 0


def test_draft_follows_prefix_hits_and_recomputes_only_what_it_never_wrote(arch_case):
    """Prefix hits with the target as its own draft: identical output, nearly every proposal accepted (the
    draft's K/V in shared blocks is right), and the draft skips the blocks its own runs already wrote."""
    arch, model, prompts, _ = arch_case
    shared = max(prompts, key=len)[:32]
    family = [shared + p[:5] for p in prompts[:6]]
    plain, _ = run(model, family, greedy(), EngineConfig(num_kv_blocks=64, block_size=4), late_from=1)
    computed = {}
    for caching in (True, False):
        spec, engine = run(model, family, greedy(), EngineConfig(
            num_kv_blocks=64, block_size=4, enable_prefix_caching=caching,
            speculative_config=draft_config(model)), late_from=1)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
        assert engine.stats()["spec_acceptance_rate"] > 0.9
        computed[caching] = engine.speculator.draft.num_computed_tokens
    assert engine.stats()["prefix_cache_hit_tokens"] == 0
    # Five requests hit the 32 shared tokens; their drafts skip them too.
    assert computed[True] <= computed[False] - 5 * 28


@pytest.mark.parametrize("proposer", ["draft", "self"])
def test_draft_forwards_stay_within_the_step_budget(arch_case, proposer):
    """Prompts up to 40 tokens with a step budget of 8, all joining at once: the draft catches each prompt
    up in forwards of at most 8 tokens (never one forward of the whole prompt), output unchanged."""
    arch, model, prompts, refs = arch_case
    config = EngineConfig(num_kv_blocks=96, max_num_batched_tokens=8,
                          speculative_config=spec_config(proposer, model, arch))
    engine = Engine(model, None, config)
    draft_runner = engine.speculator.draft.runner
    sizes = []
    original = draft_runner.forward

    def forward(inputs):
        sizes.append(inputs.input_ids.shape[1])
        return original(inputs)

    draft_runner.forward = forward
    ids = [engine.add_request(p, greedy()) for p in prompts]
    finals = run_to_completion(engine)
    assert [finals[i].outputs[0].token_ids for i in ids] == refs
    assert max(len(p) for p in prompts) > 8 and max(sizes) == 8  # long prompts were caught up in full chunks
    assert engine.stats()["spec_num_draft_tokens"] > 0
    assert_all_blocks_free(engine)


def test_draft_model_from_a_folder_and_vocabulary_mismatch(tmp_path):
    target = build("llama")
    folder = tmp_path / "draft"
    build("llama", seed=1).save_pretrained(folder)
    engine = Engine(target, None, EngineConfig(num_kv_blocks=32, speculative_config=draft_config(str(folder))))
    assert engine.speculator.draft.model is not target
    prompt = mixed_prompts(1)[0]
    ids = engine.add_request(prompt, greedy(8))
    assert run_to_completion(engine)[ids].outputs[0].token_ids == hf_greedy(target, prompt, 8)
    assert engine.stats()["spec_num_draft_tokens"] > 0
    assert_all_blocks_free(engine)
    other = build_from_config(lambda: tf.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                                     num_hidden_layers=1, num_attention_heads=2,
                                                     num_key_value_heads=1))
    with pytest.raises(ValueError, match="vocabulary has 128 tokens, the target's 256"):
        Engine(target, None, EngineConfig(num_kv_blocks=32, speculative_config=draft_config(other)))
    sharded = build("llama", seed=1)
    sharded._tp_size = 2  # what transformers records on a model it sharded while loading
    with pytest.raises(ValueError, match="tensor-parallel"):
        Engine(target, None, EngineConfig(num_kv_blocks=32, speculative_config=draft_config(sharded)))


def test_greedy_identity_with_prefix_hits(arch_case):
    _, model, prompts, _ = arch_case
    shared = max(prompts, key=len)[:32]
    family = [shared + p[:5] for p in prompts[:6]]  # the first runs alone for three steps, then the rest hit
    plain, _ = run(model, family, greedy(), EngineConfig(num_kv_blocks=64, block_size=4), late_from=1)
    answers = {tuple(p): o.token_ids for p, o in zip(family, plain)}
    spec, engine = run(model, family, greedy(), EngineConfig(num_kv_blocks=64, block_size=4,
                                                             speculative_config=NGRAM), answers, late_from=1)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert engine.stats()["prefix_cache_hit_tokens"] > 0


# ---------------------------------------------------------------- stops, limits, logprobs, processors


def word_tokenizer(vocab: int) -> tf.PreTrainedTokenizerFast:
    """Token i is the word `w{i}`: decoding joins words with spaces, so stop strings are easy to aim."""
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def llama():
    model = build("llama")
    prompts = mixed_prompts(8)
    plain, _ = run(model, prompts, greedy(), EngineConfig(num_kv_blocks=64))
    return model, prompts, {tuple(p): o.token_ids for p, o in zip(prompts, plain)}


def compare(model, prompts, params, answers, tokenizer=None, expect_accepted=True, spec=NGRAM, **config):
    """Outputs without and with speculation (n-gram driven by the oracle unless `spec` is a draft model)."""
    plain, _ = run(model, prompts, params, EngineConfig(num_kv_blocks=64, **config), tokenizer=tokenizer)
    spec, engine = run(model, prompts, params, EngineConfig(num_kv_blocks=64, speculative_config=spec, **config),
                       answers if spec is NGRAM else None, tokenizer=tokenizer)
    for a, b in zip(plain, spec):
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (a.token_ids, a.text, a.finish_reason,
                                                                         a.stop_reason)
    assert (engine.stats()["spec_num_accepted_tokens"] > 0) == expect_accepted
    return plain, spec


def test_stop_strings_and_stop_ids(llama):
    model, prompts, answers = llama
    tokenizer = word_tokenizer(model.config.vocab_size)
    # Stop on tokens each answer reaches in its middle, where a proposal run crosses them.
    stop_ids = [answers[tuple(p)][9] for p in prompts[:4]]
    stop_words = [f"w{answers[tuple(p)][13]}" for p in prompts[4:]]
    plain, _ = compare(model, prompts, greedy(stop_token_ids=stop_ids, stop=stop_words), answers, tokenizer)
    assert all(o.finish_reason == "stop" for o in plain)
    plain, _ = compare(model, prompts, greedy(stop=stop_words, include_stop_str_in_output=True), answers,
                       tokenizer)
    assert sum(o.finish_reason == "stop" for o in plain) >= 4


def test_stops_logprobs_and_penalties_with_a_draft_model(llama):
    """The target as its own draft accepts long runs, so they cross stop ids, stop strings and min_tokens."""
    model, prompts, answers = llama
    tokenizer = word_tokenizer(model.config.vocab_size)
    stop_ids = [answers[tuple(p)][9] for p in prompts[:4]]
    stop_words = [f"w{answers[tuple(p)][13]}" for p in prompts[4:]]
    spec = draft_config(model)
    plain, _ = compare(model, prompts, greedy(stop_token_ids=stop_ids, stop=stop_words), answers, tokenizer,
                       spec=spec)
    assert all(o.finish_reason == "stop" for o in plain)
    compare(model, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=stop_ids[:1],
                                           min_tokens=12), answers, spec=spec)
    plain, drafted = compare(model, prompts[:4], greedy(logprobs=2, repetition_penalty=1.3), answers, spec=spec)
    for a, b in zip(plain, drafted):
        assert [sorted(e) for e in a.logprobs] == [sorted(e) for e in b.logprobs]


def test_eos_and_min_tokens(llama):
    model, prompts, answers = llama
    eos = answers[tuple(prompts[0])][3]
    for params in (SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=[eos]),
                   SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=[eos], min_tokens=8)):
        compare(model, prompts, params, answers)


def test_proposals_never_pass_max_tokens_or_the_budget(llama):
    model, prompts, answers = llama
    for max_tokens in (1, 2, 3, 6):  # the first token comes from the prompt's step; the second needs no proposal
        compare(model, prompts, greedy(max_tokens), answers, expect_accepted=max_tokens > 2)
    engine = oracle(Engine(model, None, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=6,
                                                     speculative_config=NGRAM)), answers)
    for p in prompts[:3]:
        engine.add_request(p[:4], greedy(12))  # prompts that fit the budget in one step
    seen = []
    original = engine.runner.execute

    def execute(batch):
        seen.append(sum(batch.num_new_tokens))
        return original(batch)

    engine.runner.execute = execute
    answers.update({tuple(p[:4]): answers[tuple(p)] for p in prompts[:3]})
    run_to_completion(engine)
    assert max(seen) <= 6 and engine.stats()["spec_num_draft_tokens"] > 0
    assert_all_blocks_free(engine)


def test_logprobs_penalties_and_processors(llama):
    model, prompts, answers = llama
    prompts = prompts[:4]
    tokenizer = word_tokenizer(model.config.vocab_size)
    plain, spec = compare(model, prompts, greedy(logprobs=3), answers, tokenizer)
    for a, b in zip(plain, spec):
        assert [sorted(e) for e in a.logprobs] == [sorted(e) for e in b.logprobs]
        for ea, eb in zip(a.logprobs, b.logprobs):
            for token in ea:
                assert eb[token].logprob == approx(ea[token].logprob)
                assert eb[token].rank == ea[token].rank
    # Penalties and a processor depend on the history: each verified position must see its own.
    compare(model, prompts, greedy(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
            answers)

    def ban_last(output_ids, row):
        if output_ids:
            row[output_ids[-1] + 1 if output_ids[-1] + 1 < row.shape[0] else 0] = float("-inf")
        return row

    for processor in (ban_last,):
        engine = Engine(model, None, EngineConfig(num_kv_blocks=64))
        ids = [engine.add_request(p, greedy(), logits_processor=processor) for p in prompts]
        plain = run_to_completion(engine)
        spec_engine = oracle(Engine(model, None, EngineConfig(num_kv_blocks=64, speculative_config=NGRAM)),
                             {tuple(p): plain[i].outputs[0].token_ids for p, i in zip(prompts, ids)})
        spec_ids = [spec_engine.add_request(p, greedy(), logits_processor=processor) for p in prompts]
        spec = run_to_completion(spec_engine)
        assert [spec[i].outputs[0].token_ids for i in spec_ids] == [plain[i].outputs[0].token_ids for i in ids]
        assert spec_engine.stats()["spec_num_accepted_tokens"] > 0
        assert_all_blocks_free(spec_engine)


# ---------------------------------------------------------------- sampling


def test_seeded_sampling_gets_the_same_tokens(llama):
    model, prompts, _ = llama
    params = [SamplingParams(temperature=t, top_k=k, seed=s, max_tokens=MAX_NEW, ignore_eos=True)
              for s, (t, k) in enumerate([(0.7, 0), (1.0, 20), (0.5, 0), (1.3, 50)] * 2)]

    def go(config, answers=None):
        engine = Engine(model, None, config)
        if answers is not None:
            oracle(engine, answers, wrong_every=3)
        ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
        finals = run_to_completion(engine)
        assert_all_blocks_free(engine)
        return [finals[i].outputs[0].token_ids for i in ids], engine

    plain, _ = go(EngineConfig(num_kv_blocks=64))
    again, _ = go(EngineConfig(num_kv_blocks=64))
    assert plain == again
    spec, engine = go(EngineConfig(num_kv_blocks=64, speculative_config=NGRAM),
                      {tuple(p): t for p, t in zip(prompts, plain)})
    assert spec == plain
    assert engine.stats()["spec_num_accepted_tokens"] > 0
    # A draft model's proposals are sampled and verified by rejection sampling: another stream of draws,
    # so other tokens than without speculation, but the same ones for the same seeds.
    drafted = [go(EngineConfig(num_kv_blocks=64, speculative_config=draft_config(model)))[0] for _ in range(2)]
    assert drafted[0] == drafted[1]


def tiny_vocab_model(seed: int = 3) -> tf.PreTrainedModel:
    return build_from_config(lambda: tf.LlamaConfig(vocab_size=6, hidden_size=32, intermediate_size=64,
                                                    num_hidden_layers=1, num_attention_heads=2,
                                                    num_key_value_heads=1, max_position_embeddings=64), seed=seed)


def exact_pair_probs(model, prompt: list[int]) -> torch.Tensor:
    """P(second, third output token) of sampling at temperature 1, by enumeration: [V, V]."""
    vocab = model.config.vocab_size
    with torch.no_grad():
        p1 = model(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        firsts = torch.tensor([prompt + [a] for a in range(vocab)])
        p2 = model(firsts).logits[:, -1].softmax(-1)  # [a, b]
        pairs = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
        p3 = model(pairs).logits[:, -1].softmax(-1).view(vocab, vocab, vocab)  # [a, b, c]
    joint = p1[:, None, None] * p2[:, :, None] * p3
    return joint.sum(0)  # [b, c]


def test_unseeded_sampling_keeps_the_target_distribution():
    """Tokens 2 and 3 are verified proposals (token 1 comes from the prompt's step): their joint frequency
    over many unseeded requests must fit the exact probabilities, with and without speculation."""
    model = tiny_vocab_model()
    prompt = [1, 4, 2, 5, 3]
    exact = exact_pair_probs(model, prompt).flatten().double()
    # Propose the two most likely continuations of token 1 as a fixed guess: accepted often, not always.
    guess = exact.view(6, 6).sum(1).argmax().item()
    torch.manual_seed(0)
    n = 600
    draft = tiny_vocab_model()  # the target sharpened: q overweights what p favours, so accepting
    with torch.no_grad():      # too often or resampling from p instead of the residual shows
        draft.lm_head.weight.mul_(3.0)
    # 600 requests in one step: lift the per-request bar, which would rightly keep such a step plain.
    unbarred = {"max_step_tokens": 8192, "knee_tokens": 10**6}
    for spec in (None, {**NGRAM, **unbarred}, draft_config(draft, k=2, **unbarred)):
        engine = Engine(model, None, EngineConfig(num_kv_blocks=1024, block_size=4, max_num_seqs=1000,
                                                  max_num_batched_tokens=8192, speculative_config=spec))
        if spec and spec["method"] == "ngram":
            engine.speculator.propose = lambda request, limit: [guess, guess][:limit]
        # A salt each: the samples prefill together, none waiting for another's prompt (scheduler.waits_for_twin),
        # so every proposal is checked at tokens 1 and 2, where the bar below was set.
        ids = [engine.add_request(prompt, SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True),
                                  cache_salt=str(i)) for i in range(n)]
        finals = run_to_completion(engine)
        counts = torch.zeros(36, dtype=torch.float64)
        for i in ids:
            tokens = finals[i].outputs[0].token_ids
            counts[tokens[1] * 6 + tokens[2]] += 1
        expected = exact * n
        keep = expected >= 5  # chi-square needs enough expected counts per cell; pool the rest
        observed = torch.cat([counts[keep], counts[~keep].sum()[None]])
        expected = torch.cat([expected[keep], expected[~keep].sum()[None]])
        chi2 = ((observed - expected) ** 2 / expected).sum()
        dof = len(observed) - 1
        p_value = torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), chi2 / 2).item()
        assert p_value > 1e-3, f"speculation={bool(spec)}: chi2={chi2:.1f} dof={dof} p={p_value:.2g}"
        if spec:
            stats = engine.stats()
            assert 0.1 < stats["spec_acceptance_rate"] < 0.9, stats
        assert_all_blocks_free(engine)


# ---------------------------------------------------------------- policy and metrics


def test_policy_adds_no_proposals_to_a_full_step(llama):
    model, prompts, answers = llama
    config = EngineConfig(num_kv_blocks=64, speculative_config={**NGRAM, "max_step_tokens": 8})
    engine = oracle(Engine(model, None, config), answers)
    sizes = []
    original = engine.runner.execute

    def execute(batch):
        sizes.append((sum(batch.num_new_tokens), sum(len(r.spec_token_ids) for r in batch.requests)))
        return original(batch)

    engine.runner.execute = execute
    for i, p in enumerate(prompts):  # staggered lengths: the batch shrinks as requests finish
        engine.add_request(p, greedy(MAX_NEW - 2 * i))
    run_to_completion(engine)
    assert all(proposed == 0 or size <= 8 for size, proposed in sizes)
    assert any(proposed for _, proposed in sizes)  # steps with few running requests still speculate
    assert any(size >= 8 and not proposed for size, proposed in sizes)


def test_per_request_policy_backs_off_rejected_proposals(llama):
    """Proposals that are always wrong make a request propose one token after growing pauses; proposals that
    are always right keep k per step; without the per-request policy both propose k every step."""
    model, prompts, answers = llama
    proposed = {}
    for adapt in (True, False):
        for wrong_every in (1, 10**6):
            config = EngineConfig(num_kv_blocks=64, speculative_config={**NGRAM, "adapt_per_request": adapt})
            engine = oracle(Engine(model, None, config), answers, wrong_every)
            outputs, engine = run_engine(engine, prompts)
            assert [o.token_ids for o in outputs] == [answers[tuple(p)] for p in prompts]
            proposed[adapt, wrong_every] = engine.stats()["spec_num_draft_tokens"]
    assert proposed[True, 1] < proposed[False, 1] / 4
    assert proposed[True, 10**6] == proposed[False, 10**6]


def test_acceptance_bar_rises_with_the_step_size():
    """The per-request gate: a request proposes in a step of T scheduled tokens only while its estimated
    share of proposals kept is at least T / (T + knee). Keeping a quarter of its proposals bars it from a
    16-token step (bar 1/3 with knee 32) but not from a single stream's (bar 1/33); a barred request
    drifts back towards the prior and is let through again; one that keeps everything is never barred."""
    from paged_backend.speculative.speculation import ACCEPTANCE_PRIOR, Speculator

    speculator = Speculator(SpeculativeConfig(knee_tokens=32))
    assert speculator.bar(16) == pytest.approx(1 / 3) and speculator.bar(1) == pytest.approx(1 / 33)
    copier, guesser = SimpleNamespace(**FRESH), SimpleNamespace(**FRESH)
    verifications = 0
    while speculator.allowance(guesser, 4, 16):
        speculator.adapt(guesser, 4, 1)
        assert speculator.allowance(copier, 4, 16) == 4
        speculator.adapt(copier, 4, 4)
        verifications += 1
    assert 2 <= verifications <= 6 and guesser.spec_acceptance < 1 / 3
    assert speculator.allowance(guesser, 4, 1) > 0  # a single stream still takes its proposals
    barred = 0
    while speculator.allowance(guesser, 4, 16) == 0:
        barred += 1
        assert guesser.spec_acceptance < ACCEPTANCE_PRIOR
    assert 0 < barred < 16
    assert copier.spec_acceptance > 0.9
    # A step so large that even the prior is below the bar: only an earned estimate gets through.
    newcomer = SimpleNamespace(**FRESH)
    assert speculator.allowance(newcomer, 4, 64) == 0 and speculator.allowance(copier, 4, 64) > 0


FRESH = {"spec_pause": 0, "spec_allowance": 0, "spec_misses": 0, "spec_acceptance": None}


def test_a_bar_above_every_estimate_stops_proposals_and_changes_no_output(llama):
    model, prompts, answers = llama
    for knee, expect_proposals in ((1, False), (10**6, True)):
        config = EngineConfig(num_kv_blocks=64, speculative_config={**NGRAM, "knee_tokens": knee})
        outputs, engine = run_engine(oracle(Engine(model, None, config), answers), prompts)
        assert [o.token_ids for o in outputs] == [answers[tuple(p)] for p in prompts]
        assert (engine.stats()["spec_num_draft_tokens"] > 0) == expect_proposals


def run_engine(engine: Engine, prompts) -> tuple:
    ids = [engine.add_request(p, greedy()) for p in prompts]
    finals = run_to_completion(engine)
    assert_all_blocks_free(engine)
    return [finals[i].outputs[0] for i in ids], engine


def test_structured_requests_decode_without_proposals(default_llm):
    """A grammar-constrained request takes no proposals (its matcher only moves forward); the others in the
    same steps still speculate, and every answer is the one without speculation."""
    tokenizer = default_llm.tokenizer
    model = build_from_config(lambda: tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                                     num_hidden_layers=1, num_attention_heads=2,
                                                     num_key_value_heads=1, max_position_embeddings=256))
    params = [SamplingParams(temperature=0.0, max_tokens=12, structured_outputs={"regex": r"[a-c]{3}-[0-9]{2}"}),
              greedy(12)]
    texts = {}
    for spec in (None, NGRAM):
        engine = Engine(model, tokenizer, EngineConfig(num_kv_blocks=64, speculative_config=spec))
        proposed_for = set()
        if spec:
            def propose(request, limit):
                proposed_for.add(request.request_id)
                return [request.output_token_ids[-1]] * min(limit, 2)

            engine.speculator.propose = propose
        ids = [engine.add_request("Plate number: ", p) for p in params]
        finals = run_to_completion(engine)
        assert_all_blocks_free(engine)
        texts[bool(spec)] = [finals[i].outputs[0].text for i in ids]
        if spec:
            assert proposed_for == {ids[1]} and engine.stats()["spec_num_draft_tokens"] > 0
    assert texts[True] == texts[False]
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", texts[True][0])


def test_metrics_report_speculation(llama):
    pytest.importorskip("prometheus_client")
    from paged_backend.integrations.server.metrics import ServerMetrics

    model, prompts, answers = llama
    _, engine = run(model, prompts, greedy(), EngineConfig(num_kv_blocks=64, speculative_config=NGRAM), answers)
    stats = engine.stats()
    assert stats["spec_num_accepted_tokens"] == pytest.approx(stats["spec_acceptance_rate"]
                                                              * stats["spec_num_draft_tokens"])
    assert stats["spec_mean_accepted_length"] == pytest.approx(1 + stats["spec_num_accepted_tokens"]
                                                               / stats["spec_num_drafts"])
    lines = dict(line.rsplit(" ", 1) for line in ServerMetrics(engine).render().decode().splitlines()
                 if line.startswith("paged_backend_spec"))
    assert float(lines["paged_backend_spec_decode_num_draft_tokens_total"]) == stats["spec_num_draft_tokens"]
    assert float(lines["paged_backend_spec_decode_num_accepted_tokens_total"]) == stats["spec_num_accepted_tokens"]
    assert float(lines["paged_backend_spec_decode_num_drafts_total"]) == stats["spec_num_drafts"]
    assert float(lines["paged_backend_spec_decode_mean_accepted_length"]) == pytest.approx(
        stats["spec_mean_accepted_length"])


def test_serve_takes_a_speculative_config(monkeypatch):
    pytest.importorskip("uvicorn")
    from paged_backend.entrypoints import llm
    from paged_backend.integrations.cli import build_parser

    seen = {}

    class Loaded(Exception):
        pass

    def fake_llm(model, tensor_parallel_size=1, quantization=None, **config):  # LLM's own keywords aside
        seen.update(config)
        raise Loaded

    monkeypatch.setattr(llm, "LLM", fake_llm)  # the server's command builds its LLM from there
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    args = build_parser().parse_args(["serve", "--speculative-config", json.dumps(spec)])
    with pytest.raises(Loaded):
        args.run(args)
    assert seen["speculative_config"] == spec
    assert EngineConfig(**seen).speculative_config.num_speculative_tokens == 3


def test_a_quantized_checkpoint_drafts_for_its_float_model(tmp_path):
    """A GPTQ folder as the draft (the target's own weights rounded to 4 bits; these tiny random models are
    chaotic enough that its proposals are mostly rejected): the draft's quantized layers run, and the answer
    is the target's."""
    from paged_backend.model.quantized.int4_linear import Int4Linear

    from helpers.quantized_checkpoints import write_quantized

    target = build("llama")
    write_quantized(build("llama"), tmp_path, "gptq", bits=4, group_size=32)
    engine = Engine(target, None, EngineConfig(num_kv_blocks=32, speculative_config=draft_config(str(tmp_path))))
    prompt = mixed_prompts(1)[0]
    ids = engine.add_request(prompt, greedy(8))
    assert run_to_completion(engine)[ids].outputs[0].token_ids == hf_greedy(target, prompt, 8)
    assert isinstance(engine.speculator.draft.model.model.layers[0].mlp.up_proj, Int4Linear)
    assert engine.stats()["spec_num_draft_tokens"] > 0
    assert_all_blocks_free(engine)


def test_the_vocabulary_check_reads_heads_of_every_weight_format() -> None:
    """An int4 model's int8 head (the default model's) holds no `weight`: its rows are its `out_features`."""
    from paged_backend.model.quantized.int8_linear import Int8Linear
    from paged_backend.speculative.draft_proposer import output_vocab_size

    model = build("llama")
    model.lm_head = Int8Linear.from_float(model.lm_head)
    assert output_vocab_size(model) == model.config.vocab_size
