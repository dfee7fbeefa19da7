"""Sampler: the next token of every sampling request in one vectorised pass over the batch.

Greedy rows are an argmax. Random rows use the exponential race (argmax of p / q with
q ~ Exp(1)), which samples from p exactly; a seeded request draws its q row from its own
generator, so its tokens do not depend on what else is in the batch (race_noise.py).

On a GPU the step waits for the device once, for the sampled ids (and the logprobs asked for, in
the same wait): per-row values go to the device as non-blocking copies, results come back through
`to_host`, and nothing reads a device value on the way.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from paged_backend.core.request import PenaltyState, Request
from paged_backend.sampling.grammar import GrammarMask, apply_bitmask
from paged_backend.sampling.race_noise import race_noise


class DraftRows(NamedTuple):
    """Rows that verify a proposal a draft model sampled: rejection sampling needs the distribution q it
    was drawn from (a deterministic proposal, q one-hot, needs none: see speculation.py)."""

    rows: list[int]  # sampler rows
    tokens: list[int]  # the proposal each row verifies
    probs: torch.Tensor  # [len(rows), V]: q of each proposal


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    # Only when some request asked for logprobs; rows of the others are computed but unused.
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


def sample(logits: torch.Tensor, requests: list[Request], grammar_mask: GrammarMask | None = None,
           extras: list[list[int]] | None = None, drafts: DraftRows | None = None) -> SamplerOutput:
    """Pick one token per row of `logits [B, V]`; row i belongs to `requests[i]`. `grammar_mask` forbids
    the tokens each constrained row's grammar does not allow (the logprobs reported stay the model's own).
    With `extras`, row i follows `extras[i]` after the request's output (speculation verifies proposed
    tokens this way): processors, penalties and min_tokens see that longer history. `drafts` rows emit
    their proposal or a token of the residual distribution (rejection sampling against the draft's q)."""
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any_wants_logprobs(requests) else None
    extras = extras or [()] * len(requests)
    apply_bitmask(logits, grammar_mask)  # first, so that top-k and friends choose among allowed tokens
    apply_request_processors(logits, requests, extras)
    apply_penalties(logits, requests, extras)
    ban_stop_tokens_before_min(logits, requests, extras)
    tokens = pick_tokens(logits, requests, drafts)
    if raw_logprobs is None:
        return SamplerOutput(to_host(tokens)[0])
    return gather_logprobs(raw_logprobs, tokens, requests)


def any_wants_logprobs(requests: list[Request]) -> bool:
    return any(r.wants_logprob for r in requests)


def pick_tokens(logits: torch.Tensor, requests: list[Request], drafts: DraftRows | None = None) -> torch.Tensor:
    greedy = [r.params.temperature == 0.0 for r in requests]
    if all(greedy):
        return argmax_rows(logits)
    probs = sampling_probs(logits, requests)
    sampled = race(probs, requests, [not g for g in greedy])
    if drafts is not None:
        rows = torch.tensor(drafts.rows, device=logits.device)
        sampled[rows] = verify_drafts(probs[rows], drafts, [requests[r] for r in drafts.rows])
    if not any(greedy):
        return sampled
    greedy_rows = on_device(greedy, logits.device)
    return torch.where(greedy_rows, argmax_rows(logits), sampled)


def sampling_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Each row's distribution at its request's temperature (1 for greedy rows) after its top-k, top-p and min-p."""
    temps = on_device([r.params.temperature or 1.0 for r in requests], logits.device)
    return torch.softmax(filter_logits(logits / temps[:, None], requests), dim=-1)


def race(probs: torch.Tensor, requests: list[Request], drawn: list[bool]) -> torch.Tensor:
    """A token per row of `probs [B, V]` drawn from it by the exponential race (race_noise.py), for the rows that
    are `drawn` (the others' entries are meaningless); a seeded request's row from its own generator."""
    noise = race_noise(probs.shape, [r.generator for r in requests], drawn, probs.device)
    return argmax_rows(torch.div(probs, noise, out=noise))  # into the noise buffer: one buffer of the batch fewer


ARGMAX_BLOCK = 1024  # vocabulary entries per block of argmax_rows()


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits [B, V].argmax(-1)`, the first of equal maxima included. On CPU torch's argmax walks each row
    in one scalar loop where its max is vectorised: so each block of ARGMAX_BLOCK entries' max is taken, then
    the argmax of the first block holding the row's maximum, in a fraction of the time (docs/design.md has the
    measurement). An earlier block wins a tie, as an earlier entry does in a block."""
    rows, vocab = logits.shape
    whole = vocab // ARGMAX_BLOCK * ARGMAX_BLOCK
    if logits.device.type != "cpu" or whole == 0 or rows == 0:  # no rows: a step of embeddings only
        return logits.argmax(dim=-1)
    block_max = logits[:, :whole].view(rows, -1, ARGMAX_BLOCK).amax(-1)
    if whole < vocab:
        block_max = torch.cat([block_max, logits[:, whole:].amax(-1, keepdim=True)], 1)
    starts = block_max.argmax(dim=-1) * ARGMAX_BLOCK
    entries = (starts[:, None] + torch.arange(ARGMAX_BLOCK)).clamp_max(vocab - 1)  # the last block may be short
    return starts + logits.gather(1, entries).argmax(dim=-1)


def verify_drafts(p: torch.Tensor, drafts: DraftRows, requests: list[Request]) -> torch.Tensor:
    """Rejection sampling of proposals x ~ q against the target's p: keep x with probability
    min(1, p(x) / q(x)), else draw from max(p - q, 0) normalised. The emitted token is distributed as p
    (and differs from x whenever x is rejected, since the residual is zero at a rejected x). A seeded
    request draws its uniform and its residual race from its own generator."""
    q = drafts.probs.to(p)
    x = torch.tensor(drafts.tokens, device=p.device)
    p_x = p.gather(1, x[:, None])[:, 0]
    q_x = q.gather(1, x[:, None])[:, 0]
    uniform = torch.rand(len(x), device=p.device)
    residual = (p - q).clamp_min(0)
    mass = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)  # p == q: nothing is ever rejected
    for i, request in enumerate(requests):
        if request.generator is not None:
            uniform[i] = torch.rand(1, generator=request.generator, device=p.device)[0]
    accept = uniform * q_x < p_x
    return torch.where(accept, x, race(residual, requests, [True] * len(requests)))


def filter_logits(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Top-k, then top-p, then min-p (transformers' warper order), as -inf outside the kept set."""
    params = [r.params for r in requests]
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    use_k = any(k < vocab for k in top_k)
    use_p = any(p.top_p < 1.0 for p in params)
    use_min_p = any(p.min_p > 0.0 for p in params)
    if not (use_k or use_p or use_min_p):
        return logits
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    ranks = torch.arange(vocab, device=device)
    if use_k:
        remove |= ranks[None, :] >= on_device(top_k, device)[:, None]
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    if use_p:
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        top_p = on_device([p.top_p for p in params], device)
        remove |= before >= top_p[:, None]
    if use_min_p:
        probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        min_p = on_device([p.min_p for p in params], device)
        remove |= probs < min_p[:, None] * probs[:, :1]
    remove[:, 0] = False  # the most likely token always survives
    return logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))


def apply_request_processors(logits: torch.Tensor, requests: list[Request], extras: list) -> None:
    """User-supplied per-request processors (e.g. transformers' LogitsProcessors), in place."""
    for i, request in enumerate(requests):
        if request.logits_processor is not None:
            history = request.output_token_ids + extras[i] if extras[i] else request.output_token_ids
            logits[i] = request.logits_processor(history, logits[i])


def apply_penalties(logits: torch.Tensor, requests: list[Request], extras: list) -> None:
    """Repetition penalty (transformers' rule, prompt + output) and OpenAI presence/frequency
    penalties (output only), in place, for the rows that ask for them."""
    for i, request in enumerate(requests):
        p = request.params
        if p.repetition_penalty == 1.0 and not (p.presence_penalty or p.frequency_penalty):
            continue
        state = sync_penalty_state(request, logits.shape[-1], logits.device)
        seen, counts = with_extra_tokens(state, extras[i]) if extras[i] else (state.seen, state.counts)
        if p.repetition_penalty != 1.0:
            row = logits[i]
            penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            logits[i] = torch.where(seen, penalised, row)
        if p.presence_penalty or p.frequency_penalty:
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()


def with_extra_tokens(state: PenaltyState, extra: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The seen mask and counts as if `extra` followed the output (the request's state is left as it is)."""
    ids = on_device(extra, state.counts.device, torch.long)
    seen = state.seen.clone()
    seen[ids] = True
    return seen, state.counts.clone().index_add_(0, ids, torch.ones(len(extra), device=ids.device))


def sync_penalty_state(request: Request, vocab: int, device: torch.device) -> PenaltyState:
    """The request's seen-token mask and output-token counts, brought up to date with only the tokens
    added since the last step (rebuilding them from the whole history each step would be quadratic)."""
    state = request.penalty_state
    if state is None or state.counts.shape[0] != vocab:
        state = request.penalty_state = PenaltyState(
            seen=torch.zeros(vocab, dtype=torch.bool, device=device),
            counts=torch.zeros(vocab, device=device),
            synced=0,
        )
        state.seen[on_device(request.prompt_token_ids, device, torch.long)] = True
    new = request.output_token_ids[state.synced:]
    if new:
        ids = on_device(new, device, torch.long)
        state.seen[ids] = True
        state.counts.index_add_(0, ids, torch.ones(len(new), device=device))
        state.synced = len(request.output_token_ids)
    return state


def ban_stop_tokens_before_min(logits: torch.Tensor, requests: list[Request], extras: list) -> None:
    for i, request in enumerate(requests):
        if request.num_output_tokens + len(extras[i]) < request.params.min_tokens and request.stop_ids:
            logits[i, on_device(sorted(request.stop_ids), logits.device, torch.long)] = float("-inf")


def gather_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, requests: list[Request]) -> SamplerOutput:
    k = max(r.params.logprobs or 0 for r in requests)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    top = logprobs.topk(k, dim=-1) if k > 0 else None
    if top is None:
        return SamplerOutput(*to_host(tokens, chosen))
    return SamplerOutput(*to_host(tokens, chosen, top.indices, top.values))


def on_device(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host values as a tensor on `device`, copied without waiting for the device's queued work."""
    tensor = torch.tensor(values, dtype=dtype)
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)


def to_host(*tensors: torch.Tensor) -> list[list]:
    """The tensors as Python lists, waiting for the device once: every copy is queued before the wait."""
    if tensors[0].device.type != "cuda":
        return [t.tolist() for t in tensors]
    copies = [t.to("cpu", non_blocking=True) for t in tensors]
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return [c.tolist() for c in copies]
