"""The server serves LoRA adapters: listed in /v1/models with the base as parent, chosen by `model` on every
route (answers equal the PEFT model's with that adapter active), loaded and unloaded at runtime behind a flag."""

from __future__ import annotations

import argparse
import json

import httpx
import pytest
import torch
from helpers.lora import MAX_NEW, PROMPT, peft_text, saved_peft_model
from helpers.server import serve, tiny_llama
from paged_backend.integrations.server.cli import add_serve_arguments, lora_config

from paged_backend import LLM

pytestmark = pytest.mark.timeout(120)

BASE = "tiny-base"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tokenizer, model, folder = saved_peft_model(tmp_path_factory)
    ids = tokenizer(PROMPT)["input_ids"]
    refs = {name: peft_text(model, tokenizer, ids, name) for name in (None, "french", "legal")}
    assert len(set(refs.values())) == 3, "each adapter should change the answer"
    llm = LLM(tiny_llama(tokenizer), tokenizer=tokenizer, enable_lora=True, num_kv_blocks=64)
    llm.add_lora("french", model, adapter_name="french")
    with serve(llm, BASE, allow_runtime_lora_updating=True) as server:
        yield server, refs, folder, model


def complete(url: str, model: str, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": MAX_NEW,
                                                     "temperature": 0} | extra, timeout=60)


def test_models_lists_adapters_with_their_parent(served):
    server, *_ = served
    cards = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert [(c["id"], c.get("parent")) for c in cards] == [(BASE, None), ("french", BASE)]


def test_model_picks_the_adapter_on_completions_and_generate(served):
    server, refs, _, _ = served
    assert complete(server.url, BASE).json()["choices"][0]["text"] == refs[None]
    assert complete(server.url, "french").json()["choices"][0]["text"] == refs["french"]
    streamed = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": "french", "prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": 0, "stream": True}).text
    assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in streamed.splitlines()
                   if line.startswith("data: {")) == refs["french"]
    legacy = httpx.post(f"{server.url}/generate", json={"model": "french", "prompt": PROMPT, "max_tokens": MAX_NEW,
                                                        "temperature": 0}, timeout=60).json()
    assert legacy["text"] == [PROMPT + refs["french"]]


def test_generate_beam_search_runs_the_adapter(served):
    server, _, _, model = served
    body = {"model": "french", "prompt": PROMPT, "use_beam_search": True, "n": 2, "best_of": 2,
            "max_tokens": 4, "temperature": 0}
    texts = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()["text"]
    ids = torch.tensor([server.tokenizer(PROMPT)["input_ids"]])
    model.set_adapter("french")
    with torch.no_grad():
        out = model.generate(ids, num_beams=2, num_return_sequences=2, do_sample=False, max_new_tokens=4)
    assert texts == [PROMPT + server.tokenizer.decode(row[ids.shape[1]:], skip_special_tokens=True) for row in out]


def test_chat_routes_by_model(served):
    server, _, _, model = served
    messages = [{"role": "user", "content": "say hello"}]
    ids = server.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)

    def chat(name):
        body = {"model": name, "messages": messages, "max_tokens": MAX_NEW, "temperature": 0}
        return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()

    answer = chat("french")
    assert answer["model"] == "french"
    assert answer["choices"][0]["message"]["content"] == peft_text(model, server.tokenizer, list(ids), "french")
    assert chat(BASE)["choices"][0]["message"]["content"] == peft_text(model, server.tokenizer, list(ids), None)


def test_unknown_model_is_a_404_naming_the_served_ones(served):
    server, *_ = served
    response = complete(server.url, "german")
    assert response.status_code == 404
    assert f"`{BASE}`, `french`" in response.json()["error"]["message"]


def test_load_and_unload_adapters_at_runtime(served):
    server, refs, folder, _ = served
    url = server.url
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "legal", "lora_path": str(folder)})
    assert loaded.status_code == 200, loaded.text
    assert "legal" in [c["id"] for c in httpx.get(f"{url}/v1/models").json()["data"]]
    assert complete(url, "legal").json()["choices"][0]["text"] == refs["legal"]
    again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "legal", "lora_path": str(folder)})
    assert again.status_code == 400 and "already registered" in again.json()["error"]["message"]
    missing = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(folder / "nope")})
    assert missing.status_code == 400 and "adapter_config.json" in missing.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "legal"}).status_code == 200
    assert complete(url, "legal").status_code == 404
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "legal"}).status_code == 404


def test_runtime_routes_are_off_by_default():
    from fastapi.testclient import TestClient
    from paged_backend.integrations.server import create_app

    class Front:  # create_app reads only these members here
        engine = None

    client = TestClient(create_app(Front(), BASE))
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"}).status_code == 404


def test_cli_lora_flags():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--lora-modules", "a=/tmp/a", "b=/tmp/b", "--max-loras", "2"])
    assert args.lora_modules == [("a", "/tmp/a"), ("b", "/tmp/b")]
    assert lora_config(args) == {"enable_lora": True, "max_loras": 2}
    assert lora_config(parser.parse_args([])) == {}
    with pytest.raises(SystemExit):
        parser.parse_args(["--lora-modules", "no-path"])
