"""DraftProposer: a smaller model, in the same engine, proposes the next tokens of decoding requests.

The draft has its own paged K/V tensors with as many blocks as the target's, and reads and writes them
through the target's block tables: position p of a request lives in the same slot of both caches. So
the draft needs no allocator of its own; a request's blocks are allocated, shared, trimmed and freed
once, for both models, and preemption (which frees them) simply sends the draft back to recompute.

Per step, `propose` runs k batched forwards of the draft over the requests that get proposals: the
first also catches up every token the draft has not seen (the prompt after prefill, the tokens the
target kept last step), each later one feeds the previous proposal. No draft forward holds more tokens
than the engine's step budget (`max_num_batched_tokens`): when the unseen tokens do not fit, catch-up
forwards of at most that many tokens run first (`catch_up`), so a long prompt never becomes one huge
draft forward. The proposing forwards then hold at most one token per request plus what is left of
the catch-up, and the requests themselves fit the target's step, so within the budget. A request's
`num_draft_computed` counts the positions whose draft K/V is written; it never runs ahead of the
target's progress once the step is verified (`settle`).

Prefix caching: a cached block's target K/V says nothing of the draft's slots in it, which only hold
that block's K/V if some draft run wrote them. `settle` records, for each full block the draft has
written, the block's hash; a write into a block clears that record first. A request catching up skips
the leading blocks whose record matches its own block hash (a prefix hit, or its own blocks after a
preemption), so the draft recomputes only what it never wrote.

Greedy requests propose the draft's argmax. Sampled requests draw each proposal from q, the draft's
distribution at the request's temperature with its top-k/top-p/min-p filters; q's rows are kept for
the rejection sampling in the sampler (accept x with probability min(1, p(x)/q(x)), else draw from
the normalised max(p - q, 0)), which makes the output distributed as the target's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from paged_backend.kernels import pack_sequences
from paged_backend.core.request import Request
from paged_backend.model.paged.attention import ATTENTION_NAME
from paged_backend.model.loading.model_check import prepare_model
from paged_backend.model.loading.model_loader import load_model
from paged_backend.model.model_runner import ModelRunner
from paged_backend.model.step_inputs import StepInputs
from paged_backend.model.paged.paged_cache import KVShape, PagedCache
from paged_backend.sampling.sampler import race, sampling_probs


class DraftProposer:
    def __init__(self, model: PreTrainedModel, shape: KVShape) -> None:
        self.model = model
        self.shape = shape
        self.runner: ModelRunner | None = None
        self.filled: list[int | None] = []  # block id -> the hash of the block content its draft slots hold
        self.pending: list[tuple[Request, int]] = []  # (request, catch-up start) of this step's proposals
        self.num_computed_tokens = 0  # tokens run through the draft (catch-up and proposals)
        self.max_forward_tokens = 0  # the most tokens one draft forward may hold (set by `allocate`)

    @classmethod
    def prepare(cls, model: PreTrainedModel, self_check: bool) -> DraftProposer:
        """Switch the draft to the paged attention (checked as the target is) and size its K/V blocks."""
        shape = prepare_model(model, model.config.get_text_config().num_hidden_layers, self_check)
        return cls(model.eval(), shape)

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 max_forward_tokens: int) -> None:
        """The draft's K/V tensors, with the target's number of blocks so its block tables fit; its forwards
        hold at most `max_forward_tokens` tokens (the target's step budget)."""
        self.runner = ModelRunner(self.model, PagedCache(self.shape, num_blocks, block_size, dtype, device))
        self.filled = [None] * num_blocks
        self.max_forward_tokens = max_forward_tokens

    # ------------------------------------------------------------ proposing

    def propose(self, requests: list[Request], counts: list[int]) -> list[list[int]]:
        """`counts[i]` proposed tokens for each request (decoding: all but its last token computed, blocks
        allocated for the last token and its proposals); sampled requests get `draft_probs` set."""
        bs = self.runner.cache.block_size
        for request in requests:
            self.skip_cached_blocks(request, bs)
            self.pending.append((request, request.num_draft_computed))
        tables = self.runner.block_table_array(requests)
        starts = np.array([r.num_draft_computed for r in requests], dtype=np.int64)
        self.catch_up(requests, tables, starts)
        tokens = [r.token_slice(int(s), r.num_tokens) for r, s in zip(requests, starts)]
        proposals: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = np.arange(len(requests))
        for j in range(max(counts)):
            if j:  # feed each still-proposing request its previous proposal
                active = active[np.asarray(counts)[active] > j]
                tokens = [proposals[i][-1:] for i in active]
            chosen, q = self.draft_step([requests[i] for i in active], tables[active], starts[active], tokens)
            for row, i in enumerate(active.tolist()):
                proposals[i].append(chosen[row])
                if q is not None and q[row] is not None:
                    probs[i].append(q[row])
            starts[active] += [len(t) for t in tokens]
        for i, request in enumerate(requests):
            # Written: everything before its last token, the last token and all proposals but the last.
            request.num_draft_computed = int(starts[i])
            request.draft_probs = torch.stack(probs[i]) if probs[i] else None
        return proposals

    def catch_up(self, requests: list[Request], tables: np.ndarray, starts: np.ndarray) -> None:
        """While the requests' unseen tokens exceed one forward's budget, run a forward of up to that many of
        them (never a request's last token, which the proposing forward feeds); advances `starts`."""
        ends = np.array([r.num_tokens for r in requests], dtype=np.int64)
        while int((ends - starts).sum()) > self.max_forward_tokens:
            # Fill the budget with each request's spare tokens in turn (its unseen tokens but the last).
            filled = np.minimum(np.cumsum(ends - starts - 1), self.max_forward_tokens)
            counts = np.diff(filled, prepend=0)
            rows = np.flatnonzero(counts)
            tokens = [requests[i].token_slice(int(starts[i]), int(starts[i] + counts[i])) for i in rows]
            self.forward([requests[i] for i in rows], tables[rows], starts[rows], tokens)
            starts += counts

    def draft_step(self, requests: list[Request], tables: np.ndarray, starts: np.ndarray,
                   tokens: list[list[int]]) -> tuple[list[int], list[torch.Tensor | None] | None]:
        """One proposing draft forward: return the token each sequence proposes next and, for sampled
        requests, the distribution it was drawn from."""
        return choose_tokens(self.forward(requests, tables, starts, tokens), requests)

    def forward(self, requests: list[Request], tables: np.ndarray, starts: np.ndarray,
                tokens: list[list[int]]) -> torch.Tensor:
        """One draft forward where sequence i computes `tokens[i]` from `starts[i]`: the logits of each
        sequence's last token."""
        counts = np.array([len(t) for t in tokens], dtype=np.int64)
        self.num_computed_tokens += int(counts.sum())
        self.forget_blocks(tables, starts, counts)
        positions, query_start_loc, metadata = pack_sequences(tables, starts, counts, self.runner.cache.block_size,
                                                               self.runner.device)
        inputs = StepInputs(
            input_ids=self.runner.to_device(np.concatenate([np.asarray(t, dtype=np.int64) for t in tokens]))[None],
            position_ids=self.runner.to_device(positions)[None],
            logits_indices=self.runner.to_device(query_start_loc[1:] - 1),
            sampling_requests=requests,
            metadata=metadata,
        )
        return self.runner.forward(inputs).float()

    # ------------------------------------------------------------ keeping track of the draft's K/V

    def skip_cached_blocks(self, request: Request, block_size: int) -> None:
        """Advance the request's draft progress over leading full blocks whose draft slots already hold
        exactly these tokens' K/V (never to its last token, which the draft must see to propose)."""
        computed = request.num_draft_computed
        hashes = request.block_hashes
        while computed % block_size == 0 and computed // block_size < len(hashes) \
                and computed + block_size < request.num_tokens:
            index = computed // block_size
            if self.filled[request.block_ids[index]] != hashes[index]:
                break
            computed += block_size
        request.num_draft_computed = computed

    def forget_blocks(self, tables: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> None:
        """Blocks this forward writes into no longer hold the draft K/V of any recorded content."""
        bs = self.runner.cache.block_size
        for row, start, count in zip(tables, starts.tolist(), counts.tolist()):
            for index in range(start // bs, (start + count - 1) // bs + 1):
                self.filled[row[index]] = None

    def settle(self) -> None:
        """After the target verified this step's proposals, registered its full blocks and advanced its
        progress: the draft's progress is what the target kept of what it wrote, and every full block it
        has now written is recorded under its hash."""
        bs = self.runner.cache.block_size
        for request, start in self.pending:
            request.draft_probs = None
            request.num_draft_computed = min(request.num_draft_computed, request.num_computed_tokens)
            if request.is_finished:
                continue
            for index in range(start // bs, min(len(request.block_hashes), request.num_draft_computed // bs)):
                self.filled[request.block_ids[index]] = request.block_hashes[index]
        self.pending = []

    def cancel(self) -> None:
        """A failed step: nothing it wrote is recorded."""
        for request, _ in self.pending:
            request.draft_probs = None
            request.num_draft_computed = 0
        self.pending = []


def choose_tokens(logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list[torch.Tensor | None] | None]:
    """Greedy rows: the argmax. Sampled rows: a draw from the draft's distribution at the request's
    temperature and filters (the request's own generator when seeded), with that distribution."""
    greedy = [r.params.temperature == 0.0 for r in requests]
    tokens = logits.argmax(dim=-1)
    if all(greedy):
        return tokens.tolist(), None
    probs = sampling_probs(logits, requests)
    sampled = race(probs, requests, [not g for g in greedy])
    chosen = torch.where(torch.tensor(greedy, device=logits.device), tokens, sampled)
    return chosen.tolist(), [None if g else probs[i] for i, g in enumerate(greedy)]


def load_draft(source: Any, target: PreTrainedModel, tokenizer: Any, self_check: bool) -> DraftProposer:
    """Load (or adopt) the draft model on the target's device and dtype; it must share the target's
    vocabulary, since its proposals are token ids the target verifies."""
    if getattr(source, "tp_size", None) not in (None, 1):
        # Its forwards would wait on collectives the other ranks never join: the draft runs whole on rank 0.
        raise ValueError("a tensor-parallel (sharded) model cannot be a draft model: pass its folder or hub id, "
                         "and it is loaded whole")
    param = next(target.parameters())
    draft, draft_tokenizer = load_model(source, None, dtype=param.dtype, device=param.device,
                                        attn_implementation=ATTENTION_NAME)
    check_same_vocabulary(target, tokenizer, draft, draft_tokenizer)
    return DraftProposer.prepare(draft, self_check)


def check_same_vocabulary(target: PreTrainedModel, tokenizer: Any, draft: PreTrainedModel, draft_tokenizer: Any) -> None:
    sizes = (output_vocab_size(target), output_vocab_size(draft))
    if sizes[0] != sizes[1]:
        raise ValueError(f"the draft model's vocabulary has {sizes[1]} tokens, the target's {sizes[0]}: a draft "
                         "model must share the target's tokenizer")
    if tokenizer is not None and draft_tokenizer is not None and tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError("the draft model's tokenizer differs from the target's: a draft model must share the "
                         "target's tokenizer")


def output_vocab_size(model: PreTrainedModel) -> int:
    """The rows of `model`'s LM head: `out_features` for a linear one of any weight format (the engine's int8 and
    16-bit heads hold no `weight`), else its weight's rows; the input vocabulary without a head."""
    head = model.get_output_embeddings()
    if head is None:
        return model.get_input_embeddings().num_embeddings
    return head.out_features if hasattr(head, "out_features") else head.weight.shape[0]
