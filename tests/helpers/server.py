"""Shared test helpers."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import torch
import transformers as tf
import uvicorn
from paged_backend.integrations.server import create_app
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from paged_backend import LLM, AsyncEngine

KEY = "test-key"


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def build_chat_tokenizer(corpus: list[str]) -> tf.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (about 550 tokens) with ChatML specials and template."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    return tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                      chat_template=CHATML)


def tiny_llama(tokenizer, seed: int = 0) -> tf.PreTrainedModel:
    torch.manual_seed(seed)
    eos = tokenizer.eos_token_id
    config = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                            eos_token_id=eos, bos_token_id=None, pad_token_id=eos)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = eos
    return model.eval()


@dataclass
class Served:
    url: str
    aengine: AsyncEngine
    tokenizer: object
    app_client: object = None  # what the app holds: the engine client, or `wrap` of it

    def client(self, key: str = KEY, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, **kwargs)


@contextlib.contextmanager
def serve(llm: LLM, name: str, api_key: str | None = None, wrap=None, **app_options) -> Iterator[Served]:
    """Run the app for `llm` under uvicorn in a thread, on a free port of 127.0.0.1; `wrap` (a function of
    the client) gives the client the app holds (a scripted one, say)."""
    aengine = AsyncEngine(llm.engine)
    client = wrap(aengine) if wrap is not None else aengine
    server = uvicorn.Server(uvicorn.Config(create_app(client, name, api_key, **app_options), log_level="warning"))
    try:
        with running(server) as url:
            yield Served(url, aengine, llm.tokenizer, client)
    finally:
        aengine.shutdown()


@contextlib.contextmanager
def running(server: uvicorn.Server) -> Iterator[str]:
    """`server` run in a thread on a free port of 127.0.0.1, until the block ends; yields its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        sock.close()


def wait_all_blocks_free(aengine: AsyncEngine, timeout: float = 15.0) -> None:
    engine = aengine.engine
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not engine.has_unfinished_requests() and engine.kv.pool.num_free == engine.kv.pool.num_blocks:
            return
        time.sleep(0.05)
    raise AssertionError(f"{engine.kv.pool.num_blocks - engine.kv.pool.num_free} KV blocks still in use")


def parse_metrics(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


# ChatML that also takes a message without content (an assistant turn of tool calls).
TOLERANT_CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + (m['content'] or '') + "
                   "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                   "{% endif %}")


@contextlib.contextmanager
def serve_script(script: str) -> Iterator[Served]:
    """A server of a tiny random model made to write `script` (helpers/scripted.py), whatever it is asked."""
    from helpers.scripted import ScriptedClient, marker_tokenizer, tiny_llm

    tokenizer = marker_tokenizer([script] * 5, TOLERANT_CHATML)
    with serve(tiny_llm(tokenizer), "tiny", wrap=ScriptedClient) as served:
        served.app_client.script = script
        yield served
