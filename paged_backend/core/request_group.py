"""RequestGroup: the samples of one user request (its n, or best_of > n, samples) and the rules they share.

A request with n > 1 runs as n engine requests with derived seeds. The group owns what only makes
sense for all of them together: the user's request id, which sample leads (sample 0 computes the
prompt; the others wait for it so they can share its cached blocks), when the user's request is
finished (every sample is), and for best_of > n which samples the user gets (the `keep_best` with
the best mean token logprob, best first). A plain request is a group of one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paged_backend.core.request import Request


class RequestGroup:
    __slots__ = ("keep_best", "request_id", "samples")

    def __init__(self, request_id: str, keep_best: int | None = None) -> None:
        self.request_id = request_id  # the id the user gave; every sample's output carries it
        self.keep_best = keep_best  # best_of > n: only this many samples are returned, ranked
        self.samples: list[Request] = []  # in index order; a sample joins when it is constructed

    def join(self, sample: Request) -> int:
        """Add a newly constructed sample; return its index in the group."""
        self.samples.append(sample)
        return len(self.samples) - 1

    @property
    def leader(self) -> Request:
        return self.samples[0]

    @property
    def ranked(self) -> bool:
        """Whether samples are scored and the group returns only its best (so it is never streamed)."""
        return self.keep_best is not None

    @property
    def finished(self) -> bool:
        return all(sample.is_finished for sample in self.samples)

    def waits_for_leader(self, sample: Request) -> bool:
        """A later sample starts only once the leader has computed the prompt (or ended), so it can share
        the prompt's cached blocks instead of computing them again."""
        leader = self.samples[0]
        return sample is not leader and not leader.is_finished and leader.num_computed_tokens < leader.num_prompt_tokens

    def selected(self) -> list[Request]:
        """The samples the user's final output carries: all of them in index order, or with best_of the
        keep_best best by mean token logprob, best first (ties keep the lower index)."""
        if self.keep_best is None:
            return list(self.samples)
        return sorted(self.samples, key=lambda r: -r.mean_logprob)[: self.keep_best]
