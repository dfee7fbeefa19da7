"""The server's routes against a small fake EngineClient: no model, no engine thread.

The fake answers the protocol and nothing more, so these tests show the protocol is all the server
needs, and they pin the route logic (model list, error mapping, context checks, metrics, adapters,
health) on its own.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from paged_backend.integrations.server import create_app
from paged_backend.integrations.server.metrics import group_metrics

from paged_backend import CompletionOutput, Logprob, RequestMetrics, RequestOutput, SamplingParams
from paged_backend.entrypoints.engine_client import EngineClient
from paged_backend.errors import ContextLengthError

pytestmark = pytest.mark.timeout(60)

MODEL = "fake-model"


class CharTokenizer:
    """One token per character (its code point), no specials."""

    chat_template = None
    eos_token_id = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]


class FakeClient:
    """Answers every request with `answer` (one output per character, the last finished), or ends it
    with `error`; asked for k logprobs, ranks the answer's character first and the k - 1 code points after
    it next. Records what it was asked."""

    def __init__(self, answer: str = "ok", error: str | None = None, loras: list[str] | None = None) -> None:
        self.tokenizer = CharTokenizer()
        self.max_model_len = 64
        self.vocab_size = 1000
        self.eos_token_ids = frozenset({0})
        self.image_prompts = None
        self.answer, self.error = answer, error
        self.loras = list(loras or [])
        self.requests: list[tuple[list[int], SamplingParams, Any]] = []
        self.stats_threads: list[str] = []
        self.alive = True

    async def generate(self, prompt, params=None, request_id=None, logits_processor=None,
                       lora=None) -> AsyncIterator[RequestOutput]:
        for output in self.stream(prompt, params, request_id, logits_processor, lora):
            yield output

    def stream(self, prompt, params=None, request_id=None, logits_processor=None, lora=None) -> Iterator[RequestOutput]:
        params = params or SamplingParams()
        _, ids = self.tokenize(prompt)
        self.validate(ids, params, lora)
        self.requests.append((ids, params, lora))
        metrics = RequestMetrics(arrival_time=0.0)
        tokens = [ord(c) for c in self.answer][: params.max_tokens]
        if self.error is not None:
            yield RequestOutput(request_id, None, ids, [CompletionOutput(0, "", [], finish_reason="abort")], True,
                                metrics, error=self.error)
            return
        for i in range(1, len(tokens) + 1):
            done = i == len(tokens)
            completion = CompletionOutput(0, self.answer[:i], tokens[:i], finish_reason="length" if done else None,
                                          logprobs=ranked(tokens[:i], params.logprobs))
            yield RequestOutput(request_id, None, ids, [completion], done, metrics, delta_text=self.answer[i - 1],
                                delta_token_ids=[tokens[i - 1]])

    def submit(self, prompt, params, request_id, sink, logits_processor=None, lora=None) -> str:
        for output in self.stream(prompt, params, request_id, logits_processor, lora):
            sink(output)
        return request_id

    async def embed(self, prompt, pooling=None, request_id=None) -> RequestOutput:
        """An embedding of the prompt's length and first token, in the pooling request's output shape."""
        _, ids = self.tokenize(prompt)
        self.validate_pooling(ids, pooling)
        self.requests.append((ids, pooling, None))
        return RequestOutput(request_id, None, ids, [CompletionOutput(0, "", [], finish_reason="stop")], True,
                             RequestMetrics(arrival_time=0.0), embedding=torch.tensor([len(ids), ids[0]], dtype=torch.float32))

    def submit_pooling(self, prompt, pooling, request_id, sink) -> str:
        raise AssertionError("the server awaits embed")

    def validate_pooling(self, token_ids, pooling) -> None:
        if len(token_ids) > self.max_model_len:
            raise ContextLengthError(self.max_model_len, len(token_ids), what="input")

    def abort(self, request_id: str) -> None:
        pass

    def tokenize(self, prompt):
        return (prompt, self.tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else (None, list(prompt))

    def validate(self, token_ids, params, lora=None) -> None:
        if lora is not None and lora not in self.loras:
            raise ValueError(f"unknown LoRA adapter {lora!r}")
        if params.temperature > 1.5:
            raise ValueError(f"temperature must be at most 1.5, got {params.temperature}")

    def stats(self) -> dict[str, Any]:
        self.stats_threads.append(threading.current_thread().name)
        return {"num_running": 3, "num_waiting": 2, "kv_usage": 0.25, "kv_blocks_free": 30, "num_preemptions": 1}

    def is_alive(self) -> bool:
        return self.alive

    def shutdown(self) -> None:
        self.alive = False

    @property
    def supports_lora(self) -> bool:
        return bool(self.loras)

    def list_loras(self) -> list[str]:
        return list(self.loras)

    def add_lora(self, name: str, source: Any) -> None:
        self.loras.append(name)

    def remove_lora(self, name: str) -> None:
        if name not in self.loras:
            raise ValueError(f"unknown LoRA adapter {name!r}")
        self.loras.remove(name)


def ranked(tokens: list[int], k: int | None) -> list[dict[int, Logprob]] | None:
    if k is None:
        return None
    return [{token + r: Logprob(-1.0 - r, rank=r + 1) for r in range(max(1, k))} for token in tokens]


def serve(client: FakeClient, **options) -> TestClient:
    assert isinstance(client, EngineClient)
    return TestClient(create_app(client, MODEL, **options))


def complete(http: TestClient, **body):
    return http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", **body})


def test_completion_text_and_params_come_from_the_client():
    fake = FakeClient(answer="hello")
    reply = complete(serve(fake), max_tokens=4, temperature=0.5, seed=7)
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["text"] == "hell" and reply.json()["choices"][0]["finish_reason"] == "length"
    assert reply.json()["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    ids, params, lora = fake.requests[0]
    assert ids == [ord("h"), ord("i")] and (params.max_tokens, params.temperature, params.seed) == (4, 0.5, 7)
    assert lora is None


def test_models_lists_the_base_model_and_the_clients_adapters():
    data = serve(FakeClient(loras=["german"])).get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [MODEL, "german"]
    assert data[0]["max_model_len"] == 64 and data[1]["parent"] == MODEL


def test_an_adapter_named_as_model_reaches_the_client_and_an_unknown_model_is_a_404():
    fake = FakeClient(loras=["german"])
    http = serve(fake)
    assert complete(http, model="german", max_tokens=1).status_code == 200
    assert fake.requests[-1][2] == "german"
    missing = complete(http, model="french")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_client_refusals_are_400s_naming_the_field_and_failures_are_500s():
    refused = complete(serve(FakeClient()), temperature=1.8)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "temperature" and "at most 1.5" in refused.json()["error"]["message"]
    failed = complete(serve(FakeClient(error="replica 1 failed")))
    assert failed.status_code == 500 and "replica 1 failed" in failed.json()["error"]["message"]


def test_a_prompt_past_the_clients_context_is_refused_with_the_numbers():
    reply = complete(serve(FakeClient()), prompt="x" * 60, max_tokens=10)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded"
    assert "maximum context length is 64 tokens" in reply.json()["error"]["message"]


def test_metrics_read_the_clients_stats_off_the_event_loop():
    """A client's stats() may wait for the engine's step in progress: the scrape must not hold the
    event loop (every stream) meanwhile."""
    fake = FakeClient()
    with serve(fake) as http:
        complete(http, max_tokens=2)
        text = http.get("/metrics").text
        loop_thread = http.portal.call(current_thread_name)
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert float(lines["paged_backend_num_requests_running"]) == 3
    assert float(lines["paged_backend_num_requests_waiting"]) == 2
    assert float(lines["paged_backend_kv_cache_usage_ratio"]) == 0.25
    assert float(lines['paged_backend_requests_total{finished_reason="length"}']) == 1
    assert fake.stats_threads and loop_thread not in fake.stats_threads


async def current_thread_name() -> str:
    return threading.current_thread().name


def test_runtime_adapter_routes_go_through_the_client():
    without = serve(FakeClient(), allow_runtime_lora_updating=True)
    refused = without.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
    assert refused.status_code == 400 and "enable-lora" in refused.json()["error"]["message"]
    fake = FakeClient(loras=["german"])
    http = serve(fake, allow_runtime_lora_updating=True)
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"}).status_code == 200
    assert fake.loras == ["german", "a"]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "german"}).status_code == 200
    missing = http.post("/v1/unload_lora_adapter", json={"lora_name": "german"})
    assert missing.status_code == 404 and fake.loras == ["a"]


def test_health_follows_the_client():
    fake = FakeClient()
    http = serve(fake)
    assert http.get("/health").status_code == 200
    fake.shutdown()
    assert http.get("/health").status_code == 503


def test_beam_search_runs_on_the_client_and_stops_at_its_eos_tokens():
    fake = FakeClient(answer="o")
    fake.eos_token_ids = frozenset({ord("o")})  # every beam's best next token is this EOS
    reply = serve(fake).post("/generate", json={"prompt": "hi", "use_beam_search": True, "best_of": 2, "n": 2,
                                                "max_tokens": 2})
    assert reply.status_code == 200
    # The best beam ends at the client's EOS after one token; without it, "hioo" would win.
    assert reply.json()["text"][0] == "hio" and len(reply.json()["text"]) == 2
    assert all(params.logprobs and params.max_tokens == 1 for _, params, _ in fake.requests)


def test_metrics_show_the_blocks_of_each_layer_group_of_a_window_model():
    stats = {"kv_num_groups": 2, "kv_group_0_blocks": 7, "kv_group_0_window": 0,
             "kv_group_1_blocks": 3, "kv_group_1_window": 32}
    family, = group_metrics(stats)
    assert [(s.labels, s.value) for s in family.samples] == [
        ({"group": "0", "window": "0"}, 7.0), ({"group": "1", "window": "32"}, 3.0)]
    assert list(group_metrics({"kv_blocks_free": 4})) == []  # a model without windows: one group, no family


def test_embeddings_come_from_the_client():
    fake = FakeClient()
    http = serve(fake)
    reply = http.post("/v1/embeddings", json={"model": MODEL, "input": ["ab", "xyz"], "encoding_format": "float"})
    assert [d["embedding"] for d in reply.json()["data"]] == [[2.0, 97.0], [3.0, 120.0]]
    assert reply.json()["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    too_long = http.post("/v1/embeddings", json={"model": MODEL, "input": "x" * 65})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "input"


def http_counts(http: TestClient) -> dict[str, float]:
    lines = [line.rsplit(" ", 1) for line in http.get("/metrics").text.splitlines() if not line.startswith("#")]
    return {name: float(value) for name, value in lines if name.startswith("paged_backend_http_requests_total")}


def test_metrics_label_each_route_by_its_path_template():
    http = serve(FakeClient())
    ask = [{"role": "user", "content": "hi"}]
    replies = {"/v1/responses": http.post("/v1/responses", json={"model": MODEL, "input": "hi"}),
               "/v1/messages": http.post("/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": ask}),
               "/v1/messages/count_tokens": http.post("/v1/messages/count_tokens", json={"model": MODEL,
                                                                                        "messages": ask}),
               "/v1/embeddings": http.post("/v1/embeddings", json={"model": MODEL, "input": "hi"}),
               "/v1/responses/{response_id}": http.get("/v1/responses/resp_missing"),
               "other": http.get("/no/such/route")}
    counts = http_counts(http)
    for path, reply in replies.items():
        assert counts[f'paged_backend_http_requests_total{{path="{path}",status="{reply.status_code}"}}'] == 1, path
    assert replies["/v1/embeddings"].status_code == 200 and replies["other"].status_code == 404


def test_a_405_names_the_methods_the_path_takes():
    http = serve(FakeClient())
    reply = http.put("/v1/responses/resp_1")
    assert reply.status_code == 405 and reply.headers["allow"] == "DELETE, GET"
    assert http.get("/v1/chat/completions").headers["allow"] == "POST"


def test_the_openapi_schema_declares_the_messages_bodies():
    paths = serve(FakeClient()).get("/openapi.json").json()["paths"]
    for path, field in [("/v1/messages", "max_tokens"), ("/v1/messages/count_tokens", "messages")]:
        body = paths[path]["post"]["requestBody"]
        assert body["required"] and field in body["content"]["application/json"]["schema"]["required"]


ERROR_CODES = ["400", "404", "405", "499", "500"]


@pytest.mark.parametrize("api_key", [None, "sk-test"])
def test_the_openapi_schema_declares_the_error_answers(api_key: str | None):
    document = serve(FakeClient(), api_key=api_key, allow_runtime_lora_updating=True).get("/openapi.json").json()
    schemas = document["components"]["schemas"]
    codes = sorted(ERROR_CODES + ["401"] * (api_key is not None))
    operations = [(path, op) for path, item in document["paths"].items() if path.startswith("/v1/")
                  for op in item.values()]
    assert len(operations) == 11
    for path, operation in operations:
        declared = operation["responses"]
        assert sorted(code for code in declared if code not in ("200", "422")) == codes, path
        for code in codes:
            schema = declared[code]["content"]["application/json"]["schema"]
            names = {ref["$ref"].rsplit("/", 1)[1] for ref in schema.get("anyOf", [schema])}
            assert names == error_schemas(path, code) and declared[code]["description"], (path, code)
        assert "Allow" in declared["405"]["headers"], path
    assert set(schemas["ErrorBody"]["properties"]["error"].get("$ref", "").split("/")[-1:]) == {"ErrorDetail"}
    assert "401" not in document["paths"]["/health"]["get"]["responses"]


def error_schemas(path: str, code: str) -> set[str]:
    """The error shapes a route answers with `code`: /v1/messages refuses in Anthropic's shape, but a 405
    comes before the route and an unexpected 500 from outside it, in OpenAI's."""
    if not path.startswith("/v1/messages") or code == "405":
        return {"ErrorBody"}
    return {"AnthropicErrorBody", "ErrorBody"} if code == "500" else {"AnthropicErrorBody"}
