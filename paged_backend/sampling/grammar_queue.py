"""GrammarQueue: structured requests wait here, outside the scheduler, until their grammar is compiled.

Compiling runs on the grammars' background thread and is cached per spec for the engine's vocabulary, so a
request waiting for its grammar holds up no one. Once compiled, each sample gets its own matcher and goes on
to the scheduler; a grammar that failed to compile ends its request with the compile error.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from paged_backend.sampling.grammar import GrammarMask, Grammars

if TYPE_CHECKING:
    from paged_backend.core.request import Request


class GrammarQueue:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.grammars: Grammars | None = None  # built with the first structured request's vocabulary
        self.waiting: list[Request] = []  # structured requests whose grammar is not compiled yet
        self.queued_at: dict[Request, float] = {}  # when each waiting request came
        self.wait_seconds = 0.0  # over every request that left for the scheduler: its wait for its grammar
        self.started = 0  # requests that left for the scheduler, their matcher started

    def __bool__(self) -> bool:
        return bool(self.waiting)

    def __contains__(self, request: Request) -> bool:
        return request in self.waiting

    @property
    def enabled(self) -> bool:
        return self.grammars is not None

    def enable(self, tokenizer: Any) -> None:
        """Constrain structured requests over this tokenizer's vocabulary (the first one given stays)."""
        if self.grammars is None:
            self.grammars = Grammars(tokenizer, self.vocab_size)

    def add(self, request: Request) -> None:
        """Start compiling the request's grammar (or take it from the cache); it waits here meanwhile."""
        request.grammar = self.grammars.state_for(request.params.structured_outputs.key)
        self.waiting.append(request)
        self.queued_at[request] = time.perf_counter()

    def remove(self, request: Request) -> bool:
        """Take a request out (it ends before reaching the scheduler); whether it was waiting here."""
        if request not in self.waiting:
            return False
        self.waiting.remove(request)
        self.queued_at.pop(request, None)
        return True

    def ready(self) -> Iterator[tuple[Request, str | None]]:
        """The waiting requests whose grammar is compiled, each with None once its matcher has started (it has
        left the queue for the scheduler) or why compiling failed (it stays until its request is ended).
        A request ended meanwhile (a sample of a group that an earlier failure ended) is passed over."""
        for request in [r for r in self.waiting if not r.grammar.is_compiling()]:
            if request.is_finished:
                continue
            try:
                request.grammar.start(sorted(request.stop_ids))
            except Exception as exc:  # noqa: BLE001  (compiling failed: this request's error, not the engine's)
                yield request, f"structured_outputs could not be compiled: {exc}"
                continue
            self.waiting.remove(request)
            self.wait_seconds += time.perf_counter() - self.queued_at.pop(request)
            self.started += 1
            yield request, None

    def wait(self, timeout: float) -> None:
        """Sleep until one waiting grammar is compiled, at most `timeout` seconds; at once when none waits."""
        if self.waiting:
            self.grammars.wait_for_any([r.grammar for r in self.waiting], timeout=timeout)

    def stats(self) -> dict[str, float]:
        """How long structured requests waited for their grammar (compiled, or found in the cache), in all."""
        return {"structured_grammar_wait_seconds": self.wait_seconds, "structured_requests_started": self.started}

    def fill_bitmask(self, rows: list[Request]) -> GrammarMask | None:
        """The step's allowed-token bitmask of these sampler rows (see Grammars.fill_bitmask)."""
        return self.grammars.fill_bitmask(rows) if self.grammars else None
