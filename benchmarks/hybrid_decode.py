"""Hybrid models (attention beside recurrent layers): the engine against HF `generate` on one batch.

A tiny random model of each hybrid family the engine runs (`lfm2`: short convolutions; `granitemoehybrid` and
`falcon_h1`: Mamba-2 mixers), 4 layers of width 256, answers `--requests` prompts of `--prompt` tokens
with `--tokens` greedy tokens each (EOS ignored). HF `generate` takes them as one batch (the prompts are
of one length, so no padding); the engine takes them all at once and schedules them itself. Alternating
the two `--repeats` times, it prints each side's median tokens/s, the ratio, and how many answers agree
token for token (random weights make near ties, where the two paths' rounding may part). Writes
benchmarks/results/hybrid_decode_<machine class>.json.

    python benchmarks/hybrid_decode.py [--requests 32] [--prompt 16] [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
import transformers as tf
from common import write_results

from paged_backend import Engine, EngineConfig, SamplingParams

VOCAB = 512
WIDTH = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "lfm2": dict(layer_types=["conv", "full_attention", "conv", "conv"]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention", "mamba", "mamba"], position_embedding_type="rope",
                             mamba_n_heads=8, mamba_d_head=64, mamba_d_state=32, mamba_n_groups=1, mamba_chunk_size=16,
                             num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=256),
    "falcon_h1": dict(mamba_n_heads=8, mamba_d_head=32, mamba_d_ssm=256, mamba_d_state=32, mamba_n_groups=1,
                      mamba_chunk_size=16),
}


def tiny_model(model_type: str) -> tf.PreTrainedModel:
    torch.manual_seed(0)
    config = tf.AutoConfig.for_model(model_type, **WIDTH, **CONFIGS[model_type])
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model.eval()


def prompts(count: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, VOCAB, (length,), generator=g).tolist() for _ in range(count)]


def run_engine(model, workload: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    engine = Engine(model, None, EngineConfig(max_num_seqs=len(workload), compile=False))
    start = time.perf_counter()
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)) for p in workload]
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({out.request_id: out for out in engine.step() if out.finished})
    seconds = time.perf_counter() - start
    return len(workload) * tokens / seconds, [finals[i].outputs[0].token_ids for i in ids]


def run_hf(model, workload: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    batch = torch.tensor(workload)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=tokens,
                             min_new_tokens=tokens, do_sample=False)
    seconds = time.perf_counter() - start
    return len(workload) * tokens / seconds, out[:, batch.shape[1]:].tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--families", default=",".join(CONFIGS))
    args = p.parse_args()
    workload = prompts(args.requests, args.prompt)
    results = {}
    for family in args.families.split(","):
        model = tiny_model(family)
        engine_runs, hf_runs = [], []
        for _ in range(args.repeats):
            speed, engine_tokens = run_engine(model, workload, args.tokens)
            engine_runs.append(speed)
            speed, hf_tokens = run_hf(model, workload, args.tokens)
            hf_runs.append(speed)
        engine, hf = statistics.median(engine_runs), statistics.median(hf_runs)
        agree = sum(a == b for a, b in zip(engine_tokens, hf_tokens))
        results[family] = {"engine_tok_s": engine_runs, "hf_generate_tok_s": hf_runs, "engine_median": engine,
                           "hf_generate_median": hf, "ratio": engine / hf, "identical_answers": agree}
        print(f"{family:<17} engine {engine:8.1f} tok/s   HF generate {hf:8.1f} tok/s   {engine / hf:5.2f}x   "
              f"identical answers {agree}/{len(workload)}")
    path = write_results({"requests": args.requests, "prompt_tokens": args.prompt, "tokens": args.tokens,
                          "repeats": args.repeats, "threads": torch.get_num_threads(), "families": results},
                         "hybrid_decode")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
