"""ReplicaFront: what a set of replicas looks like from the client: one model's tokenizer and limits,
and the replicas' stats summed.

It tokenizes and checks requests on the client with the replicas' own tokenizer and limits through the
engine's own input processor (`paged_backend.input_processor`), so a bad request is refused before it
travels, with the message one engine would give. `ReplicatedAsyncEngine` answers the `EngineClient`
protocol through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray
from ray.actor import ActorHandle

from paged_backend.core.pooling import PoolingParams
from paged_backend.input_processor import InputProcessor
from paged_backend.sampling.sampling_params import SamplingParams

from .replica import Prompt, ReplicaInfo
from .router import Router

STATS_TIMEOUT_S = 5.0
SUMMED = ("num_running", "num_waiting", "kv_blocks_total", "kv_blocks_free", "num_preemptions",
          "prefix_cache_hit_tokens", "prefix_cache_queried_tokens", "num_computed_tokens")


class ReplicaFront:
    def __init__(self, infos: Sequence[ReplicaInfo], replicas: Sequence[ActorHandle], router: Router) -> None:
        check_same_model(infos)
        first = infos[0]
        self.tokenizer = first.tokenizer
        self.max_model_len = first.max_model_len
        self.vocab_size = first.vocab_size
        self.eos_token_ids = first.eos_token_ids
        self.context_note = first.context_note
        self.hidden_size = first.hidden_size
        self.embedding_sizes = first.embedding_sizes
        self.inputs = InputProcessor(first.tokenizer, max_model_len=first.max_model_len, vocab_size=first.vocab_size,
                                     context_note=first.context_note, hidden_size=first.hidden_size,
                                     embedding_sizes=first.embedding_sizes, eos_token_ids=first.eos_token_ids)
        self.replicas = replicas
        self.router = router

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        return self.inputs.tokenize(prompt)

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        self.inputs.validate(token_ids, params)

    def validate_pooling(self, token_ids: list[int], pooling: PoolingParams) -> None:
        self.inputs.validate_pooling(token_ids, pooling)

    def stats(self) -> dict[str, Any]:
        """The live replicas' stats summed (ratios weighted by blocks), plus each replica's own."""
        live = [i for i, up in enumerate(self.router.alive) if up]
        per_replica = dict(zip(live, ray.get([self.replicas[i].stats.remote() for i in live],
                                             timeout=STATS_TIMEOUT_S)))
        total = {key: sum(s[key] for s in per_replica.values()) for key in SUMMED}
        blocks = total["kv_blocks_total"] or 1
        total["kv_usage"] = sum(s["kv_usage"] * s["kv_blocks_total"] for s in per_replica.values()) / blocks
        total["kv_utilisation_mean"] = (sum(s["kv_utilisation_mean"] for s in per_replica.values())
                                        / max(1, len(per_replica)))
        queried = total["prefix_cache_queried_tokens"]
        total["prefix_cache_hit_rate"] = total["prefix_cache_hit_tokens"] / queried if queried else 0.0
        total["num_replicas_alive"] = len(live)
        total["replicas"] = per_replica
        return total


def check_same_model(infos: Sequence[ReplicaInfo]) -> None:
    limits = {(i.max_model_len, i.vocab_size, i.block_size) for i in infos}
    if len(limits) > 1:
        raise ValueError(f"replicas disagree on (max_model_len, vocab_size, block_size): {sorted(limits)}; "
                         "every replica must serve the same model with the same engine settings")
