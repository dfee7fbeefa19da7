"""/metrics for deployers: route latencies and queue time, every metric vLLM has also under vLLM's name (so its
dashboards work), and the Grafana dashboard in the docs reading only metrics the server writes."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.server import KEY, Served, build_chat_tokenizer, parse_metrics, serve, tiny_llama
from paged_backend.integrations.server.metrics import VLLM_ALSO, VLLM_NAMES

from paged_backend import LLM

DASHBOARD = Path(__file__).resolve().parents[3] / "docs" / "assets" / "grafana" / "paged-backend.json"


@pytest.fixture(scope="module")
def scraped() -> Iterator[tuple[Served, dict[str, float]]]:
    tokenizer = build_chat_tokenizer(["tell me about rivers and bridges"] * 3)
    with serve(LLM(tiny_llama(tokenizer), tokenizer, num_kv_blocks=64, compile=False), "tiny") as served:
        for _ in range(2):
            answer = httpx.post(f"{served.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                                json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True})
            assert answer.status_code == 200
        yield served, parse_metrics(httpx.get(f"{served.url}/metrics").text)


def test_route_latency_queue_time_and_start_up_are_observed(scraped: tuple[Served, dict[str, float]]) -> None:
    _, values = scraped
    assert values['paged_backend_http_request_duration_seconds_count{path="/v1/completions"}'] == 2
    assert values['paged_backend_http_request_duration_seconds_sum{path="/v1/completions"}'] > 0
    assert values['paged_backend_request_queue_time_seconds_count{path="/v1/completions"}'] == 2
    assert values["paged_backend_structured_requests_started_total"] == 0
    assert "paged_backend_startup_graphs_loaded" not in values  # an eager engine: nothing compiled or loaded


def test_every_vllm_metric_is_written_under_vllms_name_too(scraped: tuple[Served, dict[str, float]]) -> None:
    _, values = scraped
    label = '{model_name="tiny"}'
    assert values[f"vllm:prompt_tokens_total{label}"] == values["paged_backend_prompt_tokens_total"] == 6
    assert values[f"vllm:prefix_cache_queries_total{label}"] == 6
    assert values[f"vllm:generation_tokens_total{label}"] == 6
    assert values['vllm:request_success_total{finished_reason="length",model_name="tiny"}'] == 2
    assert values[f"vllm:num_preemptions_total{label}"] == values["paged_backend_num_preemptions"]
    assert values[f"vllm:kv_cache_usage_perc{label}"] == values["paged_backend_kv_cache_usage_ratio"]
    routed = '{model_name="tiny",path="/v1/completions"}'  # the engine requests' latencies carry their route
    assert values[f"vllm:time_to_first_token_seconds_count{routed}"] == 2
    assert values['vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="tiny",path="/v1/completions"}'] == 2
    # Two requests of three tokens: two gaps each between outputs; each request's mean once.
    assert values['paged_backend_inter_token_latency_seconds_count{path="/v1/completions"}'] == 4
    assert values[f"vllm:inter_token_latency_seconds_count{routed}"] == 4
    assert values[f"vllm:time_per_output_token_seconds_count{routed}"] == 4
    assert values[f"vllm:request_time_per_output_token_seconds_count{routed}"] == 2
    written = {key.split("{")[0] for key in values}
    for name, _ in [*VLLM_NAMES.values(), *[(also, None) for also in VLLM_ALSO.values()]]:
        assert written & {name, f"{name}_total", f"{name}_count"}, name


def test_the_grafana_dashboard_reads_only_metrics_the_server_writes(scraped: tuple[Served, dict[str, float]]) -> None:
    _, values = scraped
    written = {key.split("{")[0] for key in values}
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\bpaged_backend_[a-z0-9_]+", expr)}
    assert len(dashboard["panels"]) >= 10 and used
    assert sorted(used - written) == []
