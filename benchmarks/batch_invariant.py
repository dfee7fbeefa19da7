"""What batch-invariant steps cost and what they give, on the default model in fp32 (a trainer's precision).

Two engines on one model object, `EngineConfig(batch_invariant=False)` (the default: compiled forward, fused
projections) and `batch_invariant=True` (eager, unfused, small steps padded, every row through the CPU kernel),
plus the default engine made eager and unfused (`compile=False, fuse_projections=False`), which tells the cost of
the mode's own padding and kernel from that of giving up the compiled forward:

1. Cost, alternating each round, medians: output tokens/s of 32 MT-bench chats at once (greedy, 128 tokens each, EOS
   ignored) and of one stream (the first chat alone).
2. Drift: the first chat's 128 logprobs alone against in the 32-chat batch (max |difference|; 0 is invariant).
3. Against the trainer: those logprobs against the model's own dense forward on the same tokens (what TRL
   recomputes as its old logprobs): max |difference|.

    python benchmarks/batch_invariant.py [--rounds 3] [--chats 32] [--max-tokens 128] [--threads 2]

Writes benchmarks/results/batch_invariant_<machine class>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import alternate, load_mt_bench_prompts, machine_info, median, uptime, write_results  # noqa: E402

SYSTEMS = {
    "default": {},
    "eager_unfused": {"compile": False, "fuse_projections": False},
    "batch_invariant": {"batch_invariant": True},
}


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
            for text in load_mt_bench_prompts(count)]


def run(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]], list[list[float]]]:
    """Seconds, tokens and their logprobs of `prompts` run at once on `engine`, the prefix cache emptied first."""
    from paged_backend import SamplingParams

    engine.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    finals = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output.outputs[0]
    seconds = time.perf_counter() - start
    samples = [finals[i] for i in ids]
    return (seconds, [s.token_ids for s in samples],
            [[lp[t].logprob for lp, t in zip(s.logprobs, s.token_ids)] for s in samples])


def dense_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The logprobs of `tokens` after `prompt` under the model's own forward (a trainer's recomputation)."""
    sequence = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(sequence).logits[0, len(prompt) - 1:-1].float()
    return F.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chats", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from paged_backend import Engine, EngineConfig
    from paged_backend.model.loading.default_model import default_model_path

    torch.set_num_threads(args.threads)
    print(f"load before: {uptime()}")
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = chat_prompts(tokenizer, args.chats)
    engines = {name: Engine(model, tokenizer, EngineConfig(**options)) for name, options in SYSTEMS.items()}
    answers: dict[str, dict[str, tuple]] = {name: {} for name in SYSTEMS}

    def timed(name: str, batch: list[list[int]], key: str):
        def once() -> float:
            seconds, tokens, logprobs = run(engines[name], batch, args.max_tokens)
            answers[name][key] = (tokens, logprobs)
            return sum(map(len, tokens)) / seconds
        return once

    batch_runs = alternate({name: timed(name, prompts, "batch") for name in SYSTEMS}, args.rounds)
    stream_runs = alternate({name: timed(name, prompts[:1], "alone") for name in SYSTEMS}, args.rounds)
    results = {}
    for name in SYSTEMS:
        alone_tokens, alone_lp = answers[name]["alone"]
        batch_tokens, batch_lp = answers[name]["batch"]
        same = alone_tokens[0] == batch_tokens[0]
        drift = max(abs(a - b) for a, b in zip(alone_lp[0], batch_lp[0])) if same else None
        dense = dense_logprobs(model, prompts[0], alone_tokens[0])
        results[name] = {
            "batch_tok_s": median(batch_runs[name]), "batch_runs": batch_runs[name],
            "stream_tok_s": median(stream_runs[name]), "stream_runs": stream_runs[name],
            "alone_equals_batched_tokens": same, "alone_vs_batched_max_abs_logprob": drift,
            "vs_dense_forward_max_abs_logprob": (torch.tensor(alone_lp[0]) - dense).abs().max().item(),
            "compiled": engines[name].runner.compiled,
        }
    print(f"{'system':16} {'32 chats tok/s':>15} {'1 stream tok/s':>15} {'alone vs batch':>15} {'vs dense':>10}")
    for name, r in results.items():
        drift = "tokens differ" if r["alone_vs_batched_max_abs_logprob"] is None else \
            f"{r['alone_vs_batched_max_abs_logprob']:.2e}"
        print(f"{name:16} {r['batch_tok_s']:15.1f} {r['stream_tok_s']:15.1f} {drift:>15} "
              f"{r['vs_dense_forward_max_abs_logprob']:10.2e}")
    ratios = {f"batch_invariant/{base}_{kind}": results["batch_invariant"][f"{kind}_tok_s"] / results[base][f"{kind}_tok_s"]
              for base in ("default", "eager_unfused") for kind in ("batch", "stream")}
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}x")
    print(f"load after: {uptime()}")
    out = write_results({"machine": machine_info(), "args": vars(args), "dtype": "float32", "systems": results,
                         "ratios": ratios}, "batch_invariant")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
