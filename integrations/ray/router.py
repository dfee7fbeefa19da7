"""Router: picks the replica for each request: least outstanding requests, optionally prefix-aware.

Least outstanding requests: the live replica with the fewest requests in flight from this client
(ties go round-robin, so a quiet system still alternates). Prefix-aware: if a live replica was
sent a block-aligned prefix of this prompt, it gets the request, unless it already has more than
`balance_slack` requests beyond the least loaded one (then affinity would only build a queue).
This is the rule of SGLang's cache-aware router, with its absolute balance threshold.

Counts are per client: several clients sharing replicas each balance their own traffic.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence

from .errors import NoLiveReplicaError
from .prefix_table import PrefixTable


class Router:
    def __init__(self, num_replicas: int, prefixes: PrefixTable | None = None, balance_slack: int = 8) -> None:
        self.outstanding = [0] * num_replicas
        self.alive = [True] * num_replicas
        self.routed = [0] * num_replicas  # requests sent to each replica so far, retries included
        self.prefix_hits = 0  # requests sent where their prefix was, against least-loaded order
        self.prefixes = prefixes
        self.balance_slack = balance_slack
        self.next = 0
        self.death_notes: dict[int, str] = {}
        self.lock = threading.Lock()  # sync and async callers may route from different threads

    def choose(self, token_ids: Sequence[int], exclude: Collection[int] = (), salt: str | None = None) -> int:
        """The replica for this request, counted as outstanding until `release`. `salt` (e.g. the LoRA
        adapter) sets the prompt's prefixes apart from the same tokens without it, as in the engines."""
        with self.lock:
            candidates = [i for i, up in enumerate(self.alive) if up and i not in exclude]
            if not candidates:
                raise NoLiveReplicaError(self.describe_failures(exclude))
            index = self.pick(candidates, token_ids, salt)
            self.outstanding[index] += 1
            self.routed[index] += 1
            if self.prefixes is not None:
                self.prefixes.record(token_ids, index, salt)
            return index

    def pick(self, candidates: list[int], token_ids: Sequence[int], salt: str | None = None) -> int:
        n = len(self.alive)
        least = min(candidates, key=lambda i: (self.outstanding[i], (i - self.next) % n))
        self.next = (least + 1) % n
        if self.prefixes is None:
            return least
        owner, _ = self.prefixes.match(token_ids, salt)
        if owner is None or owner == least or owner not in candidates:
            return least
        if self.outstanding[owner] > self.outstanding[least] + self.balance_slack:
            return least
        self.prefix_hits += 1
        return owner

    def release(self, index: int) -> None:
        with self.lock:
            self.outstanding[index] -= 1

    def mark_dead(self, index: int, reason: str) -> None:
        with self.lock:
            self.alive[index] = False
            self.death_notes.setdefault(index, reason)
            if self.prefixes is not None:
                self.prefixes.forget(index)

    def num_alive(self) -> int:
        return sum(self.alive)

    def describe_failures(self, tried: Collection[int]) -> str:
        notes = [f"replica {i}: {note}" for i, note in sorted(self.death_notes.items())]
        notes += [f"replica {i}: already tried for this request" for i in sorted(tried) if i not in self.death_notes]
        return "no live replica left to run this request (" + "; ".join(notes or ["none configured"]) + ")"
