"""Many LoRA adapters in one continuous batch, on the default model.

32 MT-bench first turns (chat template, greedy, a fixed number of output tokens each, EOS ignored)
spread over 4 adapters (rank 8 on q/v/o and the MLP's gate/up/down, random non-zero B), measured
three ways, alternating in each round, medians over the rounds:

- `engine_lora`: one engine, every request with its adapter, all submitted at once;
- `engine_base`: the same engine and requests without adapters (what serving the base alone costs);
- `peft_sequential`: PEFT's way, one adapter at a time: `set_adapter`, then one static left-padded
  `generate` batch of that adapter's requests, adapter after adapter.

It prints output tokens/s of each and the ratios engine_lora / engine_base (target >= 0.8) and
engine_lora / peft_sequential (target >= 3), with the machine's load, and how many requests the
engine answered exactly as the PEFT batch did (left padding may flip a near-tie, so this is a report,
not an assertion: tests/model/test_lora.py checks equality on unpadded references).

`--dtype default` runs the engine as `LLM(None, enable_lora=True)` picks on this machine (int4 weights
on CPU) and PEFT in the dtype of the engine's activations over the model's own weights, which is what a
PEFT user runs; the answers then differ where int4 rounding parts them.

`--single K` also times the first K requests one at a time (each with its adapter) on the engine
and on PEFT (`set_adapter`, a batch of one), and on the engine without adapters: what one conversation
with an adapter runs at, and what its adapter costs.

    python benchmarks/lora.py [--max-tokens 64] [--repeats 2] [--threads 2] [--dtype float32|bfloat16|default]
                              [--single K] [--compile]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    load_mt_bench_prompts,
    machine_info,
    median,
    precision_name,
    uptime,
    write_results,
)

NUM_REQUESTS = 32
NUM_ADAPTERS = 4
RANK = 8
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "default": None}
TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_path: Path, dtype: torch.dtype = torch.float32):
    """The default model in `dtype` wrapped by PEFT with NUM_ADAPTERS LoRA adapters whose B matrices are
    random (PEFT keeps the adapters' own weights in fp32 under a bf16 base, its default)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa")
    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS)
    peft = get_peft_model(base, config, adapter_name="adapter0")
    for i in range(1, NUM_ADAPTERS):
        peft.add_adapter(f"adapter{i}", config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return peft.eval()


def run_engine(llm, prompts: list[list[int]], loras: list[str | None], max_tokens: int
               ) -> tuple[float, list[list[int]]]:
    from paged_backend import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.reset_prefix_cache()  # every round computes its prompts, as PEFT's batches do
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora=loras)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def run_peft_sequential(peft, prompts: list[list[int]], loras: list[str], max_tokens: int, pad_id: int
                        ) -> tuple[float, list[list[int]]]:
    """Adapter after adapter: set_adapter, then one static batch of its requests, left-padded."""
    tokens: list[list[int]] = [[] for _ in prompts]
    start = time.perf_counter()
    for adapter in dict.fromkeys(loras):
        peft.set_adapter(adapter)
        rows = [i for i, name in enumerate(loras) if name == adapter]
        width = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), width), pad_id)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        with torch.no_grad():
            # eos_token_id=[]: run to max_new_tokens without banning EOS, as the engine's ignore_eos does.
            out = peft.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                                eos_token_id=[], pad_token_id=pad_id)
        for r, i in enumerate(rows):
            tokens[i] = out[r, width:].tolist()
    return time.perf_counter() - start, tokens


def one_by_one(run, indices: list[int]) -> tuple[float, list[list[int]]]:
    """`run(i)` for each request index alone: (total seconds, outputs)."""
    total, outputs = 0.0, []
    for i in indices:
        seconds, out = run(i)
        total += seconds
        outputs += out
    return total, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="rounds; each runs every system in turn")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="both systems' precision (default: what LLM picks, int4 weights on CPU)")
    parser.add_argument("--compile", action="store_true",
                        help="compile the engine's forward (EngineConfig(compile=True); start-up not timed)")
    parser.add_argument("--single", type=int, default=0,
                        help="also time this many requests one at a time: on the engine with and without adapters, on PEFT")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]

    from paged_backend import LLM
    from paged_backend.model.loading.default_model import default_model_path

    torch.set_num_threads(args.threads)
    print(f"load before: {uptime()}")
    # The same precision for both systems, or the engine's default and PEFT over the model's own weights.
    load = {} if dtype is None else {"dtype": dtype}
    llm = LLM(None, enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=RANK, num_threads=args.threads,
              compile=args.compile, **load)
    if args.compile:
        print(f"engine compiled and warmed up in {llm.engine.runner_start.compile_s:.1f} s")
    precision = precision_name(llm.model)
    print(f"engine: {precision}; PEFT: {llm.model.dtype}")
    peft = make_adapters(default_model_path(), llm.model.dtype)
    names = [f"adapter{i}" for i in range(NUM_ADAPTERS)]
    for name in names:
        llm.add_lora(name, peft, adapter_name=name)
    tokenizer = llm.tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
               for q in load_mt_bench_prompts(NUM_REQUESTS)]
    loras = [names[i % NUM_ADAPTERS] for i in range(NUM_REQUESTS)]
    run_engine(llm, prompts[:4], loras[:4], 2)  # warm-up: first-call costs and every adapter's slot load
    run_peft_sequential(peft, prompts[:1], loras[:1], 2, tokenizer.pad_token_id)

    pad = tokenizer.pad_token_id
    single = list(range(args.single))
    # Each system: (how many requests it answers, a run timing them).
    systems = {
        "engine_lora": (NUM_REQUESTS, lambda: run_engine(llm, prompts, loras, args.max_tokens)),
        "engine_base": (NUM_REQUESTS, lambda: run_engine(llm, prompts, [None] * NUM_REQUESTS, args.max_tokens)),
        "peft_sequential": (NUM_REQUESTS, lambda: run_peft_sequential(peft, prompts, loras, args.max_tokens, pad)),
    }
    if single:
        systems["engine_single"] = (len(single), lambda: one_by_one(
            lambda i: run_engine(llm, [prompts[i]], [loras[i]], args.max_tokens), single))
        systems["engine_single_base"] = (len(single), lambda: one_by_one(
            lambda i: run_engine(llm, [prompts[i]], [None], args.max_tokens), single))
        systems["peft_single"] = (len(single), lambda: one_by_one(
            lambda i: run_peft_sequential(peft, [prompts[i]], [loras[i]], args.max_tokens, pad), single))
    requests = {system: n for system, (n, _) in systems.items()}
    seconds: dict[str, list[float]] = {system: [] for system in systems}
    outputs: dict[str, list[list[int]]] = {}
    for round_ in range(args.repeats):
        for system, (_, run) in systems.items():
            s, out = run()
            seconds[system].append(s)
            outputs[system] = out
            print(f"round {round_ + 1} {system:16s} {s:7.2f} s  {requests[system] * args.max_tokens / s:7.1f} tok/s",
                  flush=True)

    tok_s = {system: requests[system] * args.max_tokens / median(values) for system, values in seconds.items()}
    ratios = {"lora_vs_base": tok_s["engine_lora"] / tok_s["engine_base"],
              "lora_vs_peft_sequential": tok_s["engine_lora"] / tok_s["peft_sequential"]}
    if single:
        ratios["single_vs_peft_single"] = tok_s["engine_single"] / tok_s["peft_single"]
        ratios["single_lora_vs_base"] = tok_s["engine_single"] / tok_s["engine_single_base"]
    same = sum(a == b for a, b in zip(outputs["engine_lora"], outputs["peft_sequential"]))
    print(f"\noutput tokens/s (medians of {args.repeats}): " + ", ".join(f"{k} {v:.1f}" for k, v in tok_s.items()))
    print(f"engine with 4 adapters vs without: {ratios['lora_vs_base']:.2f}x (target >= 0.8)")
    print(f"engine with 4 adapters vs PEFT set_adapter + static batches: {ratios['lora_vs_peft_sequential']:.2f}x "
          "(target >= 3)")
    print(f"requests identical to the PEFT batch: {same}/{NUM_REQUESTS}")
    if single:
        print(f"one request at a time ({len(single)}, each with its adapter): engine {tok_s['engine_single']:.1f}, "
              f"PEFT {tok_s['peft_single']:.1f} tok/s, {ratios['single_vs_peft_single']:.2f}x; the engine without "
              f"adapters {tok_s['engine_single_base']:.1f} ({ratios['single_lora_vs_base']:.2f}x)")
    print(f"load after: {uptime()}")
    report = {"workload": {"requests": NUM_REQUESTS, "adapters": NUM_ADAPTERS, "rank": RANK, "targets": TARGETS,
                           "max_tokens": args.max_tokens, "threads": args.threads, "dtype": args.dtype,
                           "engine_precision": precision, "single": args.single,
                           "compile": args.compile, "compile_s": llm.engine.runner_start.compile_s},
              "seconds": seconds, "output_tokens_per_s": tok_s, "ratios": ratios,
              "identical_to_peft": same, "machine": machine_info()}
    print(f"results: {write_results(report, 'lora', args.json)}")


if __name__ == "__main__":
    main()
