"""generate(cache_implementation="paged") against transformers' own generate on tiny models: the same
tensors for greedy configs, the same distribution when sampling, HF's streamer and error rules."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers.engine import one_thread  # noqa: F401  (autouse: this module runs on one thread)
from helpers.models import build, build_from_config
from helpers.tolerances import tolerance
from paged_backend.integrations import transformers_generate as tg
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TextIteratorStreamer,
    TextStreamer,
)
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerationMixin

from paged_backend import EngineConfig
from paged_backend.model.loading.default_model import default_model_path

ARCHS = ("llama", "gpt2", "qwen3", "gpt_neox")
PAGED = {"cache_implementation": "paged"}
# Two left-padded rows of different lengths.
INPUT_IDS = torch.tensor([[0, 0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]])
MASK = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7])


@pytest.fixture(scope="module", autouse=True)
def enabled():
    """The hook is on for this module and left as it was found afterwards: importing the package turns it
    on, and later modules (PEFT's generate test) rely on that."""
    was_enabled = tg.is_enabled()
    tg.enable()
    yield
    if not was_enabled:
        tg.disable()


class Pair:
    """A reference model (never touched by the engine) and an identical one that runs paged."""

    def __init__(self, arch: str) -> None:
        self.ref = build(arch)
        self.paged = build(arch)
        tg.engine_for(self.paged, EngineConfig(num_kv_blocks=96, max_num_seqs=64))

    def both(self, *args, **kwargs):
        expected = self.ref.generate(*args, **kwargs)
        actual = self.paged.generate(*args, **kwargs, **PAGED)
        return expected, actual


@pytest.fixture(scope="module")
def pairs():
    return {arch: Pair(arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def llama(pairs):
    return pairs["llama"]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_path())


def greedy_tokens(pair: Pair, n: int = 12) -> torch.Tensor:
    return pair.ref.generate(INPUT_IDS, attention_mask=MASK, max_new_tokens=n, do_sample=False)[:, 7:]


def eos_options(pair: Pair) -> dict:
    """Two eos ids that end the rows at different steps, so the shorter row gets padded."""
    new = greedy_tokens(pair)
    first, second = int(new[0, 3]), int(new[1, 6])
    return {"eos_token_id": [first, second], "pad_token_id": 1}


def unused_token(pair: Pair) -> int:
    used = set(greedy_tokens(pair, 20).flatten().tolist())
    return next(t for t in range(255, 0, -1) if t not in used)


# ---------------------------------------------------------------- greedy equivalence


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", ["plain", "eos_list", "max_length", "min_new_tokens", "penalties", "bans"])
def test_greedy_equals_generate(pairs, arch, case):
    pair = pairs[arch]
    options = {"do_sample": False, "max_new_tokens": 10}
    if case == "eos_list":
        options |= eos_options(pair)
    elif case == "max_length":
        options = {"do_sample": False, "max_length": 13}
    elif case == "min_new_tokens":
        options |= eos_options(pair) | {"min_new_tokens": 6}
    elif case == "penalties":
        options |= {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2}
    elif case == "bans":
        new = greedy_tokens(pair)
        options |= {"bad_words_ids": [[int(new[0, 1])], [int(new[1, 2]), int(new[1, 3])]],
                    "suppress_tokens": [int(new[1, 0])]}
    expected, actual = pair.both(INPUT_IDS, attention_mask=MASK, **options)
    assert torch.equal(actual, expected)


def test_eos_rows_are_padded(llama):
    options = eos_options(llama)
    _, actual = llama.both(INPUT_IDS, attention_mask=MASK, max_new_tokens=10, do_sample=False, **options)
    assert actual.shape == (2, 7 + 7)  # the second row ends at its 7th new token
    assert actual[0, 7 + 4 :].eq(options["pad_token_id"]).all()


def test_right_padding_is_stripped_per_row(llama):
    right_ids = torch.tensor([[5, 6, 7, 8, 0, 0, 0], [9, 10, 11, 12, 13, 14, 15]])
    right_mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0], [1] * 7])
    expected = llama.ref.generate(INPUT_IDS, attention_mask=MASK, max_new_tokens=8, do_sample=False)
    actual = llama.paged.generate(right_ids, attention_mask=right_mask, max_new_tokens=8, do_sample=False, **PAGED)
    assert torch.equal(actual[:, :7], right_ids)  # the input comes back as given
    assert torch.equal(actual[:, 7:], expected[:, 7:])


def test_single_unbatched_prompt_and_no_mask(llama):
    ids = torch.tensor([[3, 4, 5]])
    expected, actual = llama.both(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(actual, expected)


def test_scores_and_logits_match(llama):
    options = {"return_dict_in_generate": True, "output_scores": True, "output_logits": True,
               "repetition_penalty": 1.2, "max_new_tokens": 8, "do_sample": False} | eos_options(llama)
    expected, actual = llama.both(INPUT_IDS, attention_mask=MASK, **options)
    assert type(actual) is type(expected)
    assert torch.equal(actual.sequences, expected.sequences)
    assert len(actual.scores) == len(expected.scores) == len(actual.logits)
    for step, (ours, theirs) in enumerate(zip(actual.scores, expected.scores)):
        torch.testing.assert_close(ours[1], theirs[1], msg=f"scores at step {step}",
                                   **tolerance(torch.float32, "forward"))
        if step < 4:  # row 0 finished after its 4th token; later rows are -inf fillers
            torch.testing.assert_close(ours[0], theirs[0], **tolerance(torch.float32, "forward"))
        else:
            assert torch.isinf(ours[0]).all()
    for ours, theirs in zip(actual.logits[:4], expected.logits[:4]):
        torch.testing.assert_close(ours, theirs, **tolerance(torch.float32, "forward"))


def test_custom_logits_processor_runs_per_request(llama):
    class BanToken(LogitsProcessor):
        def __init__(self, token: int) -> None:
            self.token = token
            self.batch_sizes: list[int] = []

        def __call__(self, input_ids, scores):
            self.batch_sizes.append(input_ids.shape[0])
            scores = scores.clone()
            scores[:, self.token] = float("-inf")
            return scores

    banned = int(greedy_tokens(llama)[0, 2])
    ref_proc, paged_proc = BanToken(banned), BanToken(banned)
    expected = llama.ref.generate(INPUT_IDS, attention_mask=MASK, max_new_tokens=8, do_sample=False,
                                  logits_processor=LogitsProcessorList([ref_proc]))
    actual = llama.paged.generate(INPUT_IDS, attention_mask=MASK, max_new_tokens=8, do_sample=False,
                                  logits_processor=LogitsProcessorList([paged_proc]), **PAGED)
    assert torch.equal(actual, expected)
    assert set(paged_proc.batch_sizes) == {1} and len(paged_proc.batch_sizes) == 16


# ---------------------------------------------------------------- stopping


def test_custom_stopping_criteria(llama):
    stop_token = int(greedy_tokens(llama)[1, 3])

    class StopAt(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == stop_token

    options = {"max_new_tokens": 10, "do_sample": False, "eos_token_id": unused_token(llama), "pad_token_id": 1,
               "stopping_criteria": StoppingCriteriaList([StopAt()])}
    expected, actual = llama.both(INPUT_IDS, attention_mask=MASK, **options)
    assert torch.equal(actual, expected)
    assert actual[1, 7 + 4 :].eq(1).all()  # row 1 stopped at its 4th token and was padded


def test_stop_strings_with_tokenizer(llama, tokenizer):
    ids = torch.tensor([[40, 41, 42, 43]])
    new = llama.ref.generate(ids, max_new_tokens=10, do_sample=False)[0, 4:]
    stop = tokenizer.decode(new[4:6])
    assert stop.strip(), "the tiny model's tokens must decode to text for this test"
    expected, actual = llama.both(ids, max_new_tokens=10, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    assert torch.equal(actual, expected)
    assert actual.shape[1] <= 4 + 6


def test_max_time_stops_every_row(llama):
    out = llama.paged.generate(INPUT_IDS, attention_mask=MASK, max_new_tokens=10, do_sample=False,
                               max_time=1e-9, **PAGED)
    assert out.shape == (2, 8)


# ---------------------------------------------------------------- sampling


def test_seeded_sampling_is_reproducible_with_num_return_sequences(llama):
    def run():
        torch.manual_seed(7)
        return llama.paged.generate(INPUT_IDS, attention_mask=MASK, do_sample=True, num_return_sequences=3,
                                    max_new_tokens=6, top_k=20, **PAGED)

    first, second = run(), run()
    assert first.shape == (6, 13)
    assert torch.equal(first, second)
    assert torch.equal(first[:, :7], INPUT_IDS.repeat_interleave(3, dim=0))
    assert len({tuple(row) for row in first[:3, 7:].tolist()}) > 1  # the copies of a prompt differ


def test_first_token_distribution_matches_generate(llama):
    ids = torch.tensor([[20, 21, 22, 23]])
    options = {"do_sample": True, "temperature": 1.7, "top_k": 12, "top_p": 0.95, "max_new_tokens": 1}
    scores = llama.ref.generate(ids, return_dict_in_generate=True, output_scores=True, **options).scores[0][0]
    probs = torch.softmax(scores, dim=-1)
    torch.manual_seed(0)
    n = 1000
    out = llama.paged.generate(ids, num_return_sequences=n, **options, **PAGED)
    freq = torch.bincount(out[:, -1], minlength=probs.numel()).float() / n
    assert freq[probs == 0].sum() == 0  # nothing outside top-k / top-p
    assert 0.5 * (freq - probs).abs().sum() < 0.08  # total variation distance


# ---------------------------------------------------------------- streamers


class Recorder(BaseStreamer):
    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = False

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended = True


def test_streamer_receives_what_generate_puts(llama):
    options = {"max_new_tokens": 10, "do_sample": False} | eos_options(llama)
    ref_rec, paged_rec = Recorder(), Recorder()
    llama.ref.generate(INPUT_IDS[1:], max_new_tokens=6, do_sample=False, streamer=ref_rec)
    llama.paged.generate(INPUT_IDS[1:], max_new_tokens=6, do_sample=False, streamer=paged_rec, **PAGED)
    assert paged_rec.puts == ref_rec.puts and paged_rec.ended
    ref_rec, paged_rec = Recorder(), Recorder()
    llama.ref.generate(INPUT_IDS, attention_mask=MASK, streamer=ref_rec, **options)
    out = llama.paged.generate(INPUT_IDS, attention_mask=MASK, streamer=paged_rec, **options, **PAGED)
    assert paged_rec.puts == ref_rec.puts  # the prompt batch, then one [B] column per step, pad when finished
    assert torch.tensor(paged_rec.puts[1:]).T.tolist() == out[:, 7:].tolist()


def test_text_streamers(llama, tokenizer, capsys):
    ids = torch.tensor([[40, 41, 42, 43]])
    text = tokenizer.decode(llama.ref.generate(ids, max_new_tokens=8, do_sample=False)[0, 4:])
    llama.paged.generate(ids, max_new_tokens=8, do_sample=False, streamer=TextStreamer(tokenizer, skip_prompt=True),
                         **PAGED)
    assert capsys.readouterr().out == text + "\n"
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    thread = threading.Thread(target=llama.paged.generate, args=(ids,),
                              kwargs={"max_new_tokens": 8, "do_sample": False, "streamer": streamer, **PAGED})
    thread.start()
    assert "".join(streamer) == text
    thread.join()


def test_text_streamer_batch_rule_is_hf_rule(llama, tokenizer):
    with pytest.raises(ValueError, match="batch size 1"):
        llama.paged.generate(INPUT_IDS, attention_mask=MASK, max_new_tokens=4, streamer=TextStreamer(tokenizer),
                             **PAGED)
    assert_engine_idle(llama.paged)


# ---------------------------------------------------------------- routing


def test_generation_config_forms_route_to_engine(llama):
    generator = tg.generator_for(llama.paged)
    expected = llama.ref.generate(INPUT_IDS, attention_mask=MASK, max_new_tokens=5, do_sample=False)
    before = generator.next_id
    config = GenerationConfig(cache_implementation="paged", max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(llama.paged.generate(INPUT_IDS, attention_mask=MASK, generation_config=config), expected)
    assert generator.next_id == before + 2
    llama.paged.generation_config.cache_implementation = "paged"
    try:
        out = llama.paged.generate(INPUT_IDS, attention_mask=MASK, max_new_tokens=5, do_sample=False)
    finally:
        llama.paged.generation_config.cache_implementation = None
    assert torch.equal(out, expected)
    assert generator.next_id == before + 4
    llama.paged.generate(INPUT_IDS, attention_mask=MASK, max_new_tokens=5, do_sample=False)  # not paged
    assert generator.next_id == before + 4


def test_disable_restores_generate():
    tg.disable()
    try:
        assert GenerationMixin.generate is tg.ORIGINAL_GENERATE and not tg.is_enabled()
    finally:
        tg.enable()
    assert tg.is_enabled()


def test_engine_is_reused_and_rebuilt_only_when_needed(llama):
    engine = tg.engine_for(llama.paged)
    llama.paged.generate(INPUT_IDS, attention_mask=MASK, max_new_tokens=3, **PAGED)
    assert tg.engine_for(llama.paged) is engine
    assert tg.engine_for(llama.paged, engine.config) is engine
    model = build("llama")
    first = tg.engine_for(model, EngineConfig(num_kv_blocks=8))
    assert tg.engine_for(model, EngineConfig(num_kv_blocks=16)) is not first


def test_a_compiled_engine_is_rebuilt_when_the_model_changes(monkeypatch):
    """A compiled forward does not see modules changed after it was compiled (an adapter loaded between
    generate calls), so a model its engine's forward no longer fits gets a new engine."""
    model = build("llama")
    config = EngineConfig(num_kv_blocks=8)
    engine = tg.engine_for(model, config)
    monkeypatch.setattr(engine.runner, "model_unchanged", lambda: False)
    assert tg.engine_for(model, config) is not engine


def test_an_engine_rebuilt_for_a_cast_model_keeps_its_config() -> None:
    """A trainer sizes the engine once (`engine_for(model, config)`), then casts the model between rollouts
    (TRL: `model.to(torch.bfloat16)`): the engine its next `generate` builds has the same config."""
    model = build("llama")
    config = EngineConfig(num_kv_blocks=8, compile=False)
    first = tg.engine_for(model, config)
    model.to(torch.bfloat16)
    model.generate(INPUT_IDS, attention_mask=MASK, max_new_tokens=2, **PAGED)
    rebuilt = tg.engine_for(model)
    assert rebuilt is not first and rebuilt.config == config and rebuilt.cache.kv.dtype == torch.bfloat16


def test_weights_changed_in_place_between_calls_are_seen(llama):
    """A training step between two evaluations changes the weights in place: the reused engine's prefix cache
    must not answer the same prompt with K/V of the old weights (it used to)."""
    model = build("llama")
    prompt = torch.arange(3, 23)[None]  # 20 tokens: full blocks in the prefix cache
    answers = []
    for step in range(3):
        with torch.no_grad():
            ref = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)
            out = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False, **PAGED)
            assert out.tolist() == ref.tolist(), step
            answers.append(tuple(ref[0].tolist()))
            for param in model.parameters():  # what an optimizer step does
                param.add_(torch.randn_like(param), alpha=0.05)
    assert len(set(answers)) == 3, "the steps should change the answer, or this test could not fail"


# ---------------------------------------------------------------- refusals and errors


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("options", [
    {"num_beams": 3},
    {"num_beams": 3, "num_return_sequences": 2, "length_penalty": 0.5, "early_stopping": True},
    {"num_beams": 2, "eos": True},
])
def test_beam_search_equals_generate(pairs, arch, options):
    pair = pairs[arch]
    options = dict(options)
    if options.pop("eos", False):
        options |= eos_options(pair)
    expected, actual = pair.both(INPUT_IDS, attention_mask=MASK, max_new_tokens=8, do_sample=False, **options)
    assert torch.equal(expected, actual)


@pytest.mark.parametrize("options, name", [
    ({"num_beams": 2, "repetition_penalty": 1.3}, "RepetitionPenaltyLogitsProcessor"),
    ({"num_beams": 2, "return_dict_in_generate": True}, "return_dict_in_generate"),
    ({"num_beams": 2, "do_sample": True}, "beam_sample"),
    ({"output_attentions": True, "return_dict_in_generate": True}, "output_attentions"),
    ({"prefix_allowed_tokens_fn": lambda batch_id, ids: [1, 2]}, "prefix_allowed_tokens_fn"),
    ({"token_type_ids": torch.zeros_like(INPUT_IDS)}, "token_type_ids"),
])
def test_unsupported_options_raise(llama, options, name):
    with pytest.raises(NotImplementedError, match=name):
        llama.paged.generate(INPUT_IDS, attention_mask=MASK, max_new_tokens=3, **options, **PAGED)


def test_inputs_embeds_is_refused(llama):
    embeds = llama.paged.get_input_embeddings()(INPUT_IDS)
    with pytest.raises(NotImplementedError, match="inputs_embeds"):
        llama.paged.generate(inputs_embeds=embeds, max_new_tokens=3, **PAGED)


def test_failing_processor_raises_its_error_and_frees_the_engine(llama):
    class Broken(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] > 9:
                raise KeyError("broken processor")
            return scores

    with pytest.raises(KeyError, match="broken processor"):
        llama.paged.generate(INPUT_IDS, attention_mask=MASK, max_new_tokens=6,
                             logits_processor=LogitsProcessorList([Broken()]), **PAGED)
    assert_engine_idle(llama.paged)
    expected, actual = llama.both(INPUT_IDS, attention_mask=MASK, max_new_tokens=4, do_sample=False)
    assert torch.equal(actual, expected)


def test_too_long_prompt_leaves_engine_untouched(llama):
    long_ids = torch.ones(1, 600, dtype=torch.long)
    with pytest.raises(ValueError):
        llama.paged.generate(long_ids, max_new_tokens=3, **PAGED)
    assert_engine_idle(llama.paged)


def assert_engine_idle(model) -> None:
    engine = tg.engine_for(model)
    stats = engine.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert not tg.generator_for(model).rows


# ---------------------------------------------------------------- prompt lookup


@pytest.mark.parametrize("options", [{}, {"repetition_penalty": 1.3}])
def test_prompt_lookup_runs_on_engine_speculation(llama, options):
    """generate(prompt_lookup_num_tokens=k) gives transformers' own prompt-lookup output (which takes one row
    at a time), for a batch of rows at once; the engine speculated, and a plain call afterwards does not."""
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8], [9, 10, 11, 9, 10, 11, 9, 10, 11, 9, 10, 11]])
    args = dict(prompt_lookup_num_tokens=3, max_new_tokens=16, do_sample=False, **options)
    expected = torch.cat([llama.ref.generate(ids[i : i + 1], **args) for i in range(len(ids))])
    assert torch.equal(llama.paged.generate(ids, **args, **PAGED), expected)
    engine = tg.engine_for(llama.paged)
    spec = engine.config.speculative_config
    assert (spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == (3, 2, 1)
    assert engine.stats()["spec_num_draft_tokens"] > 0
    assert engine.stats()["spec_num_accepted_tokens"] > 0 or options  # the penalty breaks the repeats
    assert engine.config.num_kv_blocks == 96  # the rest of the engine's config is kept
    plain = {k: v for k, v in args.items() if k != "prompt_lookup_num_tokens"}
    assert torch.equal(llama.paged.generate(ids, **plain, **PAGED), expected)
    assert tg.engine_for(llama.paged).config.speculative_config is None


SCORED = {"return_dict_in_generate": True, "output_scores": True, "output_logits": True, "max_new_tokens": 12,
          "do_sample": False}


def assert_same_scores(actual, expected) -> None:
    """The same tokens, and per emitted token the same processed scores and raw logits (finished rows' -inf
    fillers included); speculation's multi-token verification forwards may round differently."""
    assert torch.equal(actual.sequences, expected.sequences)
    assert len(actual.scores) == len(expected.scores) == len(actual.logits) == len(expected.logits)
    for ours, theirs in zip(actual.scores + actual.logits, expected.scores + expected.logits):
        torch.testing.assert_close(ours, theirs, **tolerance(torch.float32, "forward"))


@pytest.mark.parametrize("options", [{}, {"repetition_penalty": 1.3}])
def test_prompt_lookup_returns_scores_of_kept_tokens(llama, options):
    """With output_scores/output_logits, speculation returns one entry per emitted token, as without it:
    the target's scores at the kept positions, never those of rejected proposals."""
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8], [9, 10, 11, 9, 10, 11, 9, 10, 11, 9, 10, 11]])
    args = SCORED | options | {"max_new_tokens": 24}
    expected = llama.paged.generate(ids, **args, **PAGED)
    actual = llama.paged.generate(ids, prompt_lookup_num_tokens=3, **args, **PAGED)
    stats = tg.engine_for(llama.paged).stats()
    assert stats["spec_num_draft_tokens"] > stats["spec_num_accepted_tokens"] > 0 or options
    assert_same_scores(actual, expected)
    assert_same_scores(actual, llama.ref.generate(ids, **args))


# ---------------------------------------------------------------- assistant model


def test_assistant_model_runs_on_engine_draft_speculation(llama):
    """generate(assistant_model=draft) gives transformers' own assisted output (one row at a time there) for a
    batch of left-padded rows at once, with a random draft (most proposals rejected) and with the target's
    own weights as the draft (nearly all accepted)."""
    args = dict(max_new_tokens=16, do_sample=False, num_assistant_tokens=3)
    for seed, expect_high in ((1, False), (0, True)):  # build("llama") is seed 0: the target's own weights
        ref_draft, paged_draft = build("llama", seed=seed), build("llama", seed=seed)
        rows = [llama.ref.generate(INPUT_IDS[i : i + 1, 3 * (1 - i):], assistant_model=ref_draft, **args)
                for i in range(2)]
        plain = llama.ref.generate(INPUT_IDS, attention_mask=MASK, max_new_tokens=16, do_sample=False)
        assert [r[0, -16:].tolist() for r in rows] == plain[:, -16:].tolist()
        actual = llama.paged.generate(INPUT_IDS, attention_mask=MASK, assistant_model=paged_draft, **args, **PAGED)
        assert torch.equal(actual, plain)
        engine = tg.engine_for(llama.paged)
        spec = engine.config.speculative_config
        assert (spec.method, spec.model, spec.num_speculative_tokens) == ("draft_model", paged_draft, 3)
        stats = engine.stats()
        assert stats["spec_num_draft_tokens"] > 0
        assert (stats["spec_acceptance_rate"] > 0.9) == expect_high
        assert_engine_idle(llama.paged)
    assert torch.equal(llama.paged.generate(INPUT_IDS, attention_mask=MASK, max_new_tokens=16, do_sample=False,
                                            **PAGED), plain)
    assert tg.engine_for(llama.paged).config.speculative_config is None


@pytest.mark.parametrize("seed", [1, 0])  # a random draft (most proposals rejected); the target's own weights
def test_assistant_model_returns_scores_of_kept_tokens(llama, seed):
    args = SCORED | {"repetition_penalty": 1.2} | eos_options(llama)
    expected = llama.paged.generate(INPUT_IDS, attention_mask=MASK, **args, **PAGED)
    actual = llama.paged.generate(INPUT_IDS, attention_mask=MASK, assistant_model=build("llama", seed=seed),
                                  num_assistant_tokens=3, **args, **PAGED)
    stats = tg.engine_for(llama.paged).stats()
    assert stats["spec_num_draft_tokens"] > 0 and (stats["spec_acceptance_rate"] > 0.9) == (seed == 0)
    assert_same_scores(actual, expected)
    assert_engine_idle(llama.paged)


def test_assistant_scores_match_transformers_assisted_generation(llama):
    """transformers' own assisted generation (one row) returns the same scores per emitted token."""
    args = SCORED | {"num_assistant_tokens": 3}
    row = INPUT_IDS[1:]
    expected = llama.ref.generate(row, assistant_model=build("llama", seed=1), **args)
    actual = llama.paged.generate(row, assistant_model=build("llama", seed=1), **args, **PAGED)
    assert_same_scores(actual, expected)


def test_assistant_model_refusals(llama):
    with pytest.raises(ValueError, match="vocabulary"):
        small = build_from_config(lambda: LlamaConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1))
        llama.paged.generate(INPUT_IDS, attention_mask=MASK, assistant_model=small, max_new_tokens=4, **PAGED)
    tg.engine_for(llama.paged, EngineConfig(num_kv_blocks=96, max_num_seqs=64))  # the refused build dropped it
    assert torch.equal(*llama.both(INPUT_IDS, attention_mask=MASK, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_generate_under_a_trainers_autocast(arch: str) -> None:
    """A trainer (TRL's, bf16 by default) generates under autocast and builds the engine inside its first `generate`:
    start-up runs outside the autocast, so the self-check compares like with like instead of refusing the model, and
    the steps run inside it, giving HF's own tokens under the same autocast."""
    model = build(arch)
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]])
    options = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = model.generate(prompt, **options)
        paged = model.generate(prompt, cache_implementation="paged", **options)
    assert paged.tolist() == reference.tolist()
