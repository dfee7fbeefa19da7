"""A server with a disk KV tier: a restarted server reads a long prompt's blocks back, and /metrics shows the tier."""

from __future__ import annotations

from pathlib import Path

import httpx
from helpers.server import build_chat_tokenizer, parse_metrics, serve, tiny_llama

from paged_backend import LLM

TEXT = "the quick brown fox jumps over the lazy dog and keeps running through the field " * 4


def completion(url: str) -> dict:
    reply = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": TEXT, "max_tokens": 4,
                                                     "temperature": 0}, timeout=60)
    assert reply.status_code == 200
    return reply.json()


def test_a_restarted_server_reads_the_prompt_back_from_disk(tmp_path: Path) -> None:
    tokenizer = build_chat_tokenizer([TEXT])
    options = dict(num_kv_blocks=64, kv_offload_disk_bytes=10**8, kv_offload_dir=str(tmp_path), compile=False)
    with serve(LLM(tiny_llama(tokenizer), tokenizer, **options), "tiny") as first:
        before = completion(first.url)
        first.aengine.engine.flush_offload()
        stored = parse_metrics(httpx.get(f"{first.url}/metrics").text)
    full_blocks = (before["usage"]["prompt_tokens"] - 1) // 16  # all but the last token's block, 16 tokens each
    assert full_blocks >= 3 and stored['paged_backend_kv_offload_blocks{tier="disk"}'] >= full_blocks
    with serve(LLM(tiny_llama(tokenizer), tokenizer, **options), "tiny") as restarted:
        after = completion(restarted.url)
        metrics = parse_metrics(httpx.get(f"{restarted.url}/metrics").text)
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    assert metrics['paged_backend_kv_offload_hit_blocks_total{tier="disk"}'] == full_blocks
    assert metrics["paged_backend_prefix_cache_hit_tokens_total"] == full_blocks * 16
