"""Prometheus metrics of one server: requests, tokens, latencies, and the engine's live state.

Each app gets its own registry, so several servers (e.g. in one test process) never collide.
Engine gauges are read at scrape time from the client's `stats()` rather than pushed on every step;
the client answers from the engine's own thread, so a scrape may run on any thread.

Every metric vLLM also has is written a second time under vLLM's name (`VLLM_NAMES`, with its
`model_name` label), from the same collected values, so dashboards built for vLLM read this server as
they are. The time between a request's outputs is observed as each output arrives (one observation per
engine step that gave the request tokens, as vLLM's inter-token latency); a finished request's mean time
per output token is observed once (vLLM's `request_time_per_output_token`).
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from paged_backend.core.outputs import RequestOutput
from paged_backend.entrypoints.engine_client import EngineClient

PREFIX = "paged_backend"
# The ASGI scope of the HTTP request the current task answers, so that latencies recorded deep in a route
# (fanout.merge_streams) carry its route: set by app.HTTPStatusCounter, seen by the tasks the route starts.
CURRENT_SCOPE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("paged_backend_http_scope", default=None)
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)

# Our metric -> (vLLM's name for it, vLLM's type where it differs from ours).
VLLM_NAMES: dict[str, tuple[str, str | None]] = {
    f"{PREFIX}_num_requests_running": ("vllm:num_requests_running", None),
    f"{PREFIX}_num_requests_waiting": ("vllm:num_requests_waiting", None),
    f"{PREFIX}_kv_cache_usage_ratio": ("vllm:kv_cache_usage_perc", None),  # a fraction in vLLM too
    f"{PREFIX}_num_preemptions": ("vllm:num_preemptions", "counter"),
    f"{PREFIX}_requests": ("vllm:request_success", None),
    f"{PREFIX}_prompt_tokens": ("vllm:prompt_tokens", None),
    f"{PREFIX}_generation_tokens": ("vllm:generation_tokens", None),
    f"{PREFIX}_prefix_cache_hit_tokens": ("vllm:prefix_cache_hits", None),
    f"{PREFIX}_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds", None),
    f"{PREFIX}_time_per_output_token_seconds": ("vllm:request_time_per_output_token_seconds", None),
    f"{PREFIX}_inter_token_latency_seconds": ("vllm:inter_token_latency_seconds", None),
    f"{PREFIX}_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds", None),
    f"{PREFIX}_request_queue_time_seconds": ("vllm:request_queue_time_seconds", None),
}
# vLLM's prefix-cache queries are the prompt tokens looked up: ours are the prompt tokens.
# vLLM's older name for the inter-token latency, which its dashboards still read.
VLLM_ALSO = {f"{PREFIX}_prompt_tokens": "vllm:prefix_cache_queries",
             f"{PREFIX}_inter_token_latency_seconds": "vllm:time_per_output_token_seconds"}


class ServerMetrics:
    def __init__(self, client: EngineClient, model_name: str = "") -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.http_requests = Counter(f"{PREFIX}_http_requests", "HTTP requests by path and status code",
                                     ["path", "status"], registry=self.registry)
        self.requests = Counter(f"{PREFIX}_requests", "Engine requests finished, by finish reason",
                                ["finished_reason"], registry=self.registry)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=self.registry)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Generated tokens of finished requests",
                                         registry=self.registry)
        self.cached_tokens = Counter(f"{PREFIX}_prefix_cache_hit_tokens", "Prompt tokens served from the "
                                     "prefix cache", registry=self.registry)
        # The engine requests' latencies, by the route that submitted them (`path`, as http_duration's).
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time from arrival to first token",
                              ["path"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds", "Mean time between output tokens "
                              "of a request", ["path"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Time between two outputs of a request that "
                             "carry new tokens", ["path"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Time from arrival to finish",
                             ["path"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.queue_time = Histogram(f"{PREFIX}_request_queue_time_seconds", "Time from arrival to first being "
                                    "scheduled", ["path"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.http_duration = Histogram(f"{PREFIX}_http_request_duration_seconds", "Time from a request's arrival "
                                       "to its answer's last byte, by route", ["path"], buckets=LATENCY_BUCKETS,
                                       registry=self.registry)
        # Plain totals for the hit-rate gauge (prometheus counters keep theirs private).
        self.total_prompt_tokens = 0
        self.total_cached_tokens = 0
        self.registry.register(EngineCollector(client, self))

    def record_finished(self, output: RequestOutput) -> None:
        completion = output.outputs[0]
        reason = "error" if output.error else (completion.finish_reason or "abort")
        self.requests.labels(reason).inc()
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(len(completion.token_ids))
        self.cached_tokens.inc(output.num_cached_tokens)
        self.total_prompt_tokens += len(output.prompt_token_ids)
        self.total_cached_tokens += output.num_cached_tokens
        observe_latencies(self, output)

    def record_tokens(self, last_output_at: dict[int, float], choice: int, output: RequestOutput) -> None:
        """Observe the time since the choice's previous output with tokens (none for its first: that is the
        time to first token), keeping the times per choice in the caller's `last_output_at`."""
        if not output.delta_token_ids:
            return
        now = time.monotonic()
        previous = last_output_at.get(choice)
        if previous is not None:
            self.itl.labels(current_route()).observe(now - previous)
        last_output_at[choice] = now

    def record_aborted(self, count: int) -> None:
        """Requests the server abandoned (the client went away); their engine output is never read."""
        if count:
            self.requests.labels("abort").inc(count)

    def record_http(self, route: str | None, status: int, seconds: float) -> None:
        """One answer that took `seconds`, labelled with its route's path template
        (`/v1/responses/{response_id}`, never an id): the routes bound the labels; a path no route matched
        counts as "other"."""
        self.http_requests.labels(route or "other", str(status)).inc()
        self.http_duration.labels(route or "other").observe(seconds)

    def render(self) -> bytes:
        """The text exposition: every metric once under its own name, and once under vLLM's where it has one."""
        families = list(self.registry.collect())
        return generate_latest(Collected(families + vllm_families(families, self.model_name)))


class Collected:
    """Families collected once, as a registry for generate_latest (the engine's stats are read once a scrape)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def vllm_families(families: list[Metric], model_name: str) -> list[Metric]:
    """`families` that vLLM also has, renamed to vLLM's names and labelled with `model_name`."""
    renamed = []
    for family in families:
        names = [VLLM_NAMES[family.name]] if family.name in VLLM_NAMES else []
        if family.name in VLLM_ALSO:
            names.append((VLLM_ALSO[family.name], None))
        for name, kind in names:
            copy = Metric(name, family.documentation, kind or family.type)
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                suffix = sample.name[len(family.name):] or ("_total" if kind == "counter" else "")
                copy.add_sample(name + suffix, {**sample.labels, "model_name": model_name}, sample.value)
            renamed.append(copy)
    return renamed


def observe_latencies(metrics: ServerMetrics, output: RequestOutput) -> None:
    m, route = output.metrics, current_route()
    if m.first_scheduled_time is not None:
        metrics.queue_time.labels(route).observe(m.first_scheduled_time - m.arrival_time)
    if m.first_token_time is None:
        return
    metrics.ttft.labels(route).observe(m.first_token_time - m.arrival_time)
    num_tokens = len(output.outputs[0].token_ids)
    if m.finished_time is not None:
        metrics.e2e.labels(route).observe(m.finished_time - m.arrival_time)
        if num_tokens > 1:
            metrics.tpot.labels(route).observe((m.finished_time - m.first_token_time) / (num_tokens - 1))


def current_route() -> str:
    """The path template of the route whose request is being answered (the ASGI scope `HTTPStatusCounter`
    keeps for it; the route is set once routing chose it); "other" outside a request."""
    scope = CURRENT_SCOPE.get()
    route = getattr(scope.get("route"), "path", None) if scope is not None else None
    return route or "other"


class EngineCollector(Collector):
    """Gauges read from the engine when Prometheus scrapes."""

    def __init__(self, client: EngineClient, metrics: ServerMetrics) -> None:
        self.client = client
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self.client.stats()
        yield gauge("num_requests_running", "Requests in the running batch", stats["num_running"])
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled", stats["num_waiting"])
        yield gauge("kv_cache_usage_ratio", "Fraction of KV blocks in use", stats["kv_usage"])
        yield gauge("kv_cache_blocks_free", "Free KV blocks", stats["kv_blocks_free"])
        yield gauge("num_preemptions", "Requests preempted so far", stats["num_preemptions"])
        yield gauge("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens",
                    prefix_hit_rate(self.metrics))
        yield counter("structured_grammar_wait_seconds", "Seconds structured requests waited for their grammar "
                      "(compiled, or found in the cache), in all", stats.get("structured_grammar_wait_seconds", 0))
        yield counter("structured_requests_started", "Structured requests whose grammar was ready and that started",
                      stats.get("structured_requests_started", 0))
        if "startup_graphs_loaded" in stats:
            yield gauge("startup_compile_seconds", "Seconds the compiled forward took at start-up (compile or "
                        "load, and warm-up)", stats["startup_compile_seconds"])
            yield gauge("startup_graphs_loaded", "1 when the compiled forward's graphs came from the compile cache "
                        "at start-up, 0 when they were compiled", stats["startup_graphs_loaded"])
        yield from speculation_metrics(stats)
        yield from group_metrics(stats)
        yield from offload_metrics(stats)


def group_metrics(stats: dict[str, float]) -> Iterator[GaugeMetricFamily]:
    """KV blocks in use per layer group, labelled with the group's window (0: full attention); only for
    an engine whose window layers free their blocks (one group otherwise: total minus free)."""
    if "kv_num_groups" not in stats:
        return
    family = GaugeMetricFamily(f"{PREFIX}_kv_cache_group_blocks_in_use", "KV blocks in use by a layer group",
                               labels=["group", "window"])
    for g in range(int(stats["kv_num_groups"])):
        family.add_metric([str(g), str(int(stats[f"kv_group_{g}_window"]))], float(stats[f"kv_group_{g}_blocks"]))
    yield family


OFFLOAD_TIERS = ("host", "disk")


def offload_metrics(stats: dict[str, float]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The second KV tier's blocks, bytes and hits per tier, and the time spent storing and reading back blocks;
    nothing for an engine without one."""
    if "kv_offload_restore_seconds" not in stats:
        return
    tiers = [tier for tier in OFFLOAD_TIERS if f"kv_offload_{tier}_blocks" in stats]
    for name, kind, doc in (("blocks", GaugeMetricFamily, "KV blocks stored in a second tier"),
                            ("bytes", GaugeMetricFamily, "Bytes of KV blocks stored in a second tier"),
                            ("hit_blocks", CounterMetricFamily, "KV blocks read back from a second tier"),
                            ("saved_blocks", CounterMetricFamily, "KV blocks stored in a second tier so far")):
        family = kind(f"{PREFIX}_kv_offload_{name}", doc, labels=["tier"])
        for tier in tiers:
            family.add_metric([tier], float(stats[f"kv_offload_{tier}_{name}"]))
        yield family
    yield counter("kv_offload_restore_seconds", "Seconds spent reading KV blocks back from a second tier",
                  stats["kv_offload_restore_seconds"])
    yield counter("kv_offload_save_seconds", "Seconds steps spent copying KV blocks off the pool for a second tier",
                  stats["kv_offload_save_seconds"])
    yield counter("kv_offload_swapped_in_blocks", "KV blocks read back for preempted requests (swap)",
                  stats["kv_offload_swapped_in_blocks"])
    yield counter("kv_offload_swap_seconds", "Seconds spent reading KV blocks back for preempted requests",
                  stats["kv_offload_swap_seconds"])


def speculation_metrics(stats: dict[str, float]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Speculative decoding's counters and rates (zero when the engine does not speculate)."""
    yield counter("spec_decode_num_drafts", "Request-steps that carried proposed tokens",
                  stats.get("spec_num_drafts", 0))
    yield counter("spec_decode_num_draft_tokens", "Proposed tokens verified", stats.get("spec_num_draft_tokens", 0))
    yield counter("spec_decode_num_accepted_tokens", "Proposed tokens accepted",
                  stats.get("spec_num_accepted_tokens", 0))
    yield gauge("spec_decode_acceptance_rate", "Accepted / proposed tokens", stats.get("spec_acceptance_rate", 0))
    yield gauge("spec_decode_mean_accepted_length", "Tokens gained per request-step that carried proposals "
                "(accepted + 1)", stats.get("spec_mean_accepted_length", 0))


def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", documentation, value=float(value))


def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"{PREFIX}_{name}", documentation, value=float(value))


def prefix_hit_rate(metrics: ServerMetrics) -> float:
    queried = metrics.total_prompt_tokens
    return metrics.total_cached_tokens / queried if queried else 0.0
