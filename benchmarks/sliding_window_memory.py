"""Sliding-window memory: what a fixed KV budget holds when window layers free their old blocks.

A tiny random Gemma 3 text model with Gemma 3's layer ratio (five sliding-window layers to one full
layer) runs the same workload twice on the same KV budget: with `free_window_blocks=False` (every
layer keeps every block: the engine before window groups) and with it on (window layers keep only
their window). Workload: `--requests` requests whose prompts end `--max-tokens` before a context of
8x the window, greedy, EOS ignored. Reports, for each setting, the most requests running at once,
preemptions and wall time, and checks both produced the same tokens. Then one request alone grows
to 8x the window and its KV memory is measured against what the window needs (full layers at full
length, window layers at their window). Writes benchmarks/results/sliding_window_memory.json.

    python benchmarks/sliding_window_memory.py [--window 64] [--block-size 16] [--requests 24] [--budget-blocks 96]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
import transformers as tf
from common import machine_info, write_results

from paged_backend import Engine, EngineConfig, SamplingParams

LAYERS = ["sliding_attention"] * 5 + ["full_attention"]  # Gemma 3's pattern: every sixth layer is global
VOCAB = 256


def tiny_gemma3(window: int, context: int) -> tf.PreTrainedModel:
    torch.manual_seed(0)
    config = tf.Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=window,
                                 layer_types=LAYERS, query_pre_attn_scalar=16, max_position_embeddings=2 * context)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.generation_config.eos_token_id = None
    return model.eval()


def prompts(count: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, VOCAB, (length,), generator=g).tolist() for _ in range(count)]


def block_bytes(engine: Engine) -> int:
    """Bytes of one page of the engine's pool (K and V of its layers per page, one block of tokens)."""
    kv = engine.cache.kv
    return kv.element_size() * kv.shape[0] * 2 * kv.shape[2] * engine.cache.block_size * kv.shape[-1]


def run_workload(model, config: EngineConfig, workload: list[list[int]], max_tokens: int) -> dict:
    """Every request at once; the most running together, preemptions, pages at their peak, wall time, tokens."""
    engine = Engine(model, None, config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, params, stream=False) for p in workload]
    finals, most_running, peak_pages = {}, 0, 0
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        most_running = max(most_running, len(engine.scheduler.running))
        peak_pages = max(peak_pages, engine.kv.pool.num_blocks - engine.kv.pool.num_free)
    return {
        "most_requests_running": most_running,
        "num_preemptions": engine.scheduler.num_preemptions,
        "kv_pages": engine.kv.pool.num_blocks,
        "kv_page_bytes": block_bytes(engine),
        "kv_budget_bytes": engine.kv.pool.num_blocks * block_bytes(engine),
        "peak_kv_bytes_in_use": peak_pages * block_bytes(engine),
        "num_groups": engine.kv.groups.num_groups,
        "wall_s": round(time.perf_counter() - start, 2),
        "tokens": [finals[i].outputs[0].token_ids for i in ids],
    }


def memory_alone(model, config: EngineConfig, prompt: list[int], max_tokens: int) -> dict:
    """One request grown to its full context: the KV bytes it holds at its last step, and per group."""
    engine = Engine(model, None, config)
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    held = 0
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        if running and running[0].num_tokens == len(prompt) + max_tokens - 1:
            held = engine.kv.pool.num_blocks - engine.kv.pool.num_free  # at the last step: context - 1 computed
            per_group = engine.kv.blocks_per_group()
        engine.step()
    return {"kv_bytes": held * block_bytes(engine), "pages": held, "pages_per_group": per_group}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=64, help="the sliding window of the local layers")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens each request generates")
    parser.add_argument("--budget-blocks", type=int, default=96,
                        help="the KV budget, in blocks of every layer (what the old layout calls a block)")
    parser.add_argument("--step-tokens", type=int, default=128, help="max_num_batched_tokens (chunked prefill)")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    context = 8 * args.window
    model = tiny_gemma3(args.window, context)
    workload = prompts(args.requests, context - args.max_tokens)
    settings = {}
    for name, free in (("keep_every_block", False), ("free_window_blocks", True)):
        config = EngineConfig(num_kv_blocks=args.budget_blocks, block_size=args.block_size,
                              max_num_batched_tokens=args.step_tokens, free_window_blocks=free)
        settings[name] = run_workload(model, config, workload, args.max_tokens)
        settings[name]["alone_at_8x_window"] = memory_alone(model, config, workload[0], args.max_tokens)
        print(f"{name}: {settings[name]['most_requests_running']} requests at once, "
              f"{settings[name]['num_preemptions']} preemptions, {settings[name]['wall_s']} s; one request at "
              f"{context} tokens holds {settings[name]['alone_at_8x_window']['kv_bytes'] / 1024:.0f} KiB")
    before, after = settings["keep_every_block"], settings["free_window_blocks"]
    identical = before.pop("tokens") == after.pop("tokens")
    # What the window needs: the full layer at the whole context, each window layer at its window.
    token_layer_bytes = after["kv_page_bytes"] // args.block_size  # one token of one layer (group_size is 1 here)
    needed = token_layer_bytes * (LAYERS.count("full_attention") * context + LAYERS.count("sliding_attention")
                                  * args.window)
    result = {
        "command": " ".join(["python benchmarks/sliding_window_memory.py", *sys.argv[1:]]),
        "model": "tiny random Gemma 3 text: 6 layers (5 sliding-window, 1 full), 2 KV heads of 16, fp32",
        "window": args.window,
        "context": context,
        "block_size": args.block_size,
        "requests": args.requests,
        "budget_blocks_of_every_layer": args.budget_blocks,
        "settings": settings,
        "sequences_held_ratio": round(after["most_requests_running"] / before["most_requests_running"], 2),
        "kv_bytes_window_needs_at_8x_window": needed,
        "kv_bytes_per_sequence_ratio_to_need": {
            name: round(s["alone_at_8x_window"]["kv_bytes"] / needed, 3) for name, s in settings.items()},
        "outputs_identical": identical,
        "machine": machine_info(),
    }
    print(f"requests held at once: {before['most_requests_running']} -> {after['most_requests_running']} "
          f"({result['sequences_held_ratio']}x); KV per sequence at {context} tokens / what the window needs: "
          f"{result['kv_bytes_per_sequence_ratio_to_need']}; same tokens: {identical}")
    print("wrote", write_results(result, "sliding_window_memory", args.output))


if __name__ == "__main__":
    main()
