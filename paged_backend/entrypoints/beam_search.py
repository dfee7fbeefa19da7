"""Beam search on the engine, step for step the algorithm of transformers' `generate(num_beams=...)`.

Each step sends every live beam to the engine as a one-token request asking for the top-K
log-probabilities (K = 2 x beams, enough to hold the global top-K of beam score + log-prob). The
beams of a prompt share its cached blocks through prefix caching; each beam recomputes only its
partial last block, which keeps the engine free of copy-on-write. Then, per prompt, candidates are
ranked, finished hypotheses kept with transformers' length penalty, and its early-stopping rules
(`True`, `False` heuristic, `"never"`) decide when the prompt is done.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paged_backend.engine import Engine
from paged_backend.model.lora import LoRAAdapter, LoRASpec
from paged_backend.sampling.sampling_params import SamplingParams

NEG = -1.0e9  # transformers' stand-in for minus infinity in beam scores


@dataclass(slots=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    ignore_eos: bool = False
    eos_token_ids: tuple[int, ...] | None = None  # None: the engine's (the model's generation config)

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"BeamSearchParams.beam_width={self.beam_width!r}: must be an int >= 1")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"BeamSearchParams.max_tokens={self.max_tokens!r}: must be an int >= 1")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"BeamSearchParams.early_stopping={self.early_stopping!r}: must be True, False or 'never'")


@dataclass(slots=True)
class BeamSequence:
    token_ids: list[int]
    cumulative_logprob: float
    score: float  # cumulative log-prob / generated length ** length_penalty
    text: str = ""


@dataclass(slots=True)
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]  # best first


@dataclass(slots=True)
class PromptBeams:
    """The search state of one prompt: live beams and the best finished hypotheses so far."""

    prompt: list[int]
    running: list[tuple[list[int], float]]
    finished: list[tuple[float, list[int], float]] = field(default_factory=list)  # (score, tokens, logprob)
    heuristic_unsatisfied: bool = True
    done: bool = False


def beam_search(engine: Engine, prompts: list[list[int]], params: BeamSearchParams,
                lora: LoRASpec | None = None) -> list[BeamSearchOutput]:
    """Beam search per prompt; with `lora`, every beam runs with that adapter."""
    adapter = engine.resolve_lora(lora)
    states = [PromptBeams(prompt, [([], 0.0)]) for prompt in prompts]
    eos = frozenset() if params.ignore_eos else frozenset(params.eos_token_ids or engine.eos_token_ids)
    for step in range(params.max_tokens):
        live = [s for s in states if not s.done]
        if not live:
            break
        top = expand(engine, live, max(2, 1 + len(eos)) * params.beam_width, adapter)
        for state, beam_tops in zip(live, top):
            advance(state, beam_tops, step + 1, eos, params)
    return [finalise(s, params) for s in states]


def expand(engine: Engine, states: list[PromptBeams], k: int,
           adapter: LoRAAdapter | None = None) -> list[list[list[tuple[int, float]]]]:
    """Top-k (token, log-prob) of the next token of every live beam, in one engine run."""
    sampling = SamplingParams(temperature=0.0, max_tokens=1, logprobs=k, ignore_eos=True)
    ids = [[engine.add_request(s.prompt + tokens, sampling, stream=False, lora=adapter) for tokens, _ in s.running]
           for s in states]
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    tops = []
    for request_ids in ids:
        beams = []
        for rid in request_ids:
            entry = finals[rid].outputs[0].logprobs[0]
            ranked = sorted(((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank is not None))
            beams.append([(t, lp) for _, t, lp in ranked[:k]])
        tops.append(beams)
    return tops


def advance(state: PromptBeams, beam_tops: list[list[tuple[int, float]]], length: int, eos: frozenset[int],
            params: BeamSearchParams) -> None:
    """One step of transformers' beam search for one prompt; `length` = tokens generated after it."""
    n = params.beam_width
    k = len(beam_tops[0]) if beam_tops else 0
    candidates = sorted(
        ((score + lp, tokens + [tok]) for (tokens, score), top in zip(state.running, beam_tops) for tok, lp in top),
        key=lambda c: c[0], reverse=True,
    )[:k]
    hits = [tokens[-1] in eos or length == params.max_tokens for _, tokens in candidates]
    live = [c for c, hit in zip(candidates, hits) if not hit]
    state.running = [(tokens, score) for score, tokens in live[:n]]
    add_finished(state, candidates[:n], hits[:n], length, params)
    update_heuristic(state, length, params)
    all_finished = len(state.finished) == n
    state.done = (not state.heuristic_unsatisfied or (all_finished and params.early_stopping is True)
                  or all(hits) or not state.running)


def add_finished(state: PromptBeams, top: list[tuple[float, list[int]]], hits: list[bool], length: int,
                 params: BeamSearchParams) -> None:
    n = params.beam_width
    frozen = (len(state.finished) == n and params.early_stopping is True) or not state.heuristic_unsatisfied
    if frozen:
        return
    for (logprob, tokens), hit in zip(top, hits):
        if hit:
            state.finished.append((logprob / length**params.length_penalty, tokens, logprob))
    state.finished = sorted(state.finished, key=lambda f: f[0], reverse=True)[:n]


def update_heuristic(state: PromptBeams, length: int, params: BeamSearchParams) -> None:
    """transformers' early-stop heuristic: stop once no live beam can beat the worst finished one."""
    if not state.running or len(state.finished) < params.beam_width:
        return
    if params.early_stopping == "never" and params.length_penalty > 0.0:
        best_length = params.max_tokens
    else:
        best_length = length
    best_possible = state.running[0][1] / best_length**params.length_penalty
    worst_finished = min(f[0] for f in state.finished)
    state.heuristic_unsatisfied = state.heuristic_unsatisfied and best_possible > worst_finished


def finalise(state: PromptBeams, params: BeamSearchParams) -> BeamSearchOutput:
    sequences = [BeamSequence(tokens, logprob, score) for score, tokens, logprob in state.finished]
    return BeamSearchOutput(state.prompt, sequences)
