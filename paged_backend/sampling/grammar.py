"""Grammar-constrained decoding: compiled grammars, each request's matcher, and the step's token bitmask.

`Grammars` belongs to one engine (one vocabulary). It compiles each spec once, on a background
thread, and caches the result by the spec's key, so a request whose grammar is still compiling waits
outside the scheduler while the others keep stepping. Once compiled, each sample gets its own
`GrammarMatcher`, advanced with every token it accepts. A step fills the bitmask of all its
constrained rows in one batched xgrammar call; the sampler applies it to the logits before it picks.

The engine never discards a token it has accepted (preemption recomputes the K/V of tokens it keeps,
stop strings only trim text), so a matcher only ever moves forward.
"""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING

import torch

from paged_backend.sampling.structured_outputs import GrammarKey, build_grammar

if TYPE_CHECKING:
    from paged_backend.core.request import Request

GrammarMask = tuple[torch.Tensor, list[int]]  # the bitmask [B, ceil(V / 32)] and the rows it constrains


class GrammarState:
    """One request's place in its grammar: compiling, then a matcher."""

    __slots__ = ("future", "matcher")

    def __init__(self, future: concurrent.futures.Future) -> None:
        self.future = future
        self.matcher = None

    def is_compiling(self) -> bool:
        return not self.future.done()

    def start(self, stop_token_ids: list[int]) -> None:
        """Make the matcher; raises the compile error if compiling failed."""
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(self.future.result(), override_stop_tokens=stop_token_ids or None)

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class Grammars:
    """The compiled grammars of one vocabulary and the bitmask buffer a step fills."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar

        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=1)
        # One worker: compiles queue behind each other, never beside the step loop's own threads.
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self.compiled: dict[GrammarKey, concurrent.futures.Future] = {}
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def state_for(self, key: GrammarKey) -> GrammarState:
        """A fresh state for a request with this spec; compiling starts now unless it is cached."""
        future = self.compiled.get(key)
        if future is None or (future.done() and future.exception() is not None):
            future = self.compiled[key] = self.executor.submit(self.compile, key)
        return GrammarState(future)

    def compile(self, key: GrammarKey):
        return self.compiler.compile_grammar(build_grammar(key))

    def fill_bitmask(self, requests: list[Request]) -> GrammarMask | None:
        """The allowed-token bitmask of this step's constrained rows, in one batched call; None if none."""
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        if not rows:
            return None
        if self.bitmask.shape[0] < len(requests):
            import xgrammar

            self.bitmask = xgrammar.allocate_token_bitmask(len(requests), self.bitmask.shape[1] * 32)
        bitmask = self.bitmask[: len(requests)]
        self.batch.batch_fill_next_token_bitmask([requests[i].grammar.matcher for i in rows], bitmask, rows)
        return bitmask, rows

    def wait_for_any(self, states: list[GrammarState], timeout: float) -> None:
        """Block until one of these grammars is compiled (the engine has nothing else to do)."""
        concurrent.futures.wait([s.future for s in states], timeout, concurrent.futures.FIRST_COMPLETED)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def apply_bitmask(logits: torch.Tensor, mask: GrammarMask | None) -> None:
    """Set the logits of tokens the grammar forbids to -inf, for the masked rows only, in place."""
    if mask is None:
        return
    import xgrammar

    bitmask, rows = mask
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
