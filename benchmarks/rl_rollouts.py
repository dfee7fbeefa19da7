"""The rollouts of one GRPO step on the default model, made the ways TRL's transformers paths make them.

TRL's GRPO trainer repeats each prompt `num_generations` times as separate rows and samples every row with its
defaults (temperature 1.0, top_p 1.0, top_k 0, repetition_penalty 1.0, EOS ends a row). The same rows, the same
generation config and the same seed go through, on one HF model object in one dtype:

- `trl_generate`: HF's own `model.generate` (the engine's hooks off, `paged_backend.disable()`) on the rows
  left-padded into one static batch. TRL pads the whole generation batch at once, per_device_train_batch_size rows
  (steps_per_generation times that when it generates ahead); here that batch is all the rows;
- `hf_generate_batch`: transformers' own continuous batching, `model.generate_batch(rows, generation_config,
  continuous_batching_config)` with the hooks off, as `GRPOConfig(use_transformers_continuous_batching=True)`
  calls it (TRL's `max_memory_percent=0.5`). It builds its manager in every call, as it does in every TRL step;
- `engine_generate_batch`: the same call with the hooks on and `cache_implementation="paged"` in the config:
  the engine's route for `use_transformers_continuous_batching=True`;
- `engine_generate`: the static-batch `generate` call with `cache_implementation="paged"`: the engine's route for
  TRL's plain path.

Each round runs every system once, the order flipped every other round; figures are medians over the rounds.
Lengths are sampled, so each system is credited with the tokens it generated (each row up to and including
its EOS, as TRL's completion mask counts them): tokens/s = generated tokens / wall seconds. Every system gets an
untimed warm-up call first; the engine's start-up (built on the model object on its first paged call, its
forward compiled, as a trainer's first rollout builds it) is timed separately and excluded, since the engine
and its KV pool persist across a trainer's steps.

Memory: the engine runs the model object it is given (`engine.model is model`), so the weights exist once; the
record holds the model's weight bytes before and after the engine started (its fused projections are views of
one stacked tensor that replaces the separate ones), the engine's KV pool bytes, the RSS the engine's start-up
added, and each run's peak RSS above the RSS it started from.

    python benchmarks/rl_rollouts.py [--rounds 3] [--prompts 8] [--generations 4] [--max-new-tokens 64]
                                     [--systems trl_generate,hf_generate_batch,...] [--dtype auto|float32|bfloat16]

Up to 64 new tokens by default keeps `--rounds 3` near ten minutes on two cores. On a machine whose other jobs
hold a core, `--threads 1` gives steadier figures: two OpenMP threads sharing a core with a neighbour wait on
each other at every parallel region, which slowed the compiled forward's steps by up to thirty times here.

Writes benchmarks/results/rl_rollouts_<machine class>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    RunMeter,
    current_rss_bytes,
    load_mt_bench_prompts,
    machine_info,
    median,
    uptime,
    write_results,
)
from throughput import left_pad  # noqa: E402  (TRL's static batch: left-padded, as throughput.py's)

SYSTEMS = {
    "trl_generate": "TRL plain generate (HF generate, static left-padded batch)",
    "hf_generate_batch": "transformers generate_batch (its own continuous batching)",
    "engine_generate_batch": "engine through generate_batch",
    "engine_generate": "engine through generate",
}
PAGED_SYSTEMS = ("engine_generate_batch", "engine_generate")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# What TRL's GRPOConfig leaves transformers' engine with unless told otherwise (grpo_trainer.py).
TRL_MAX_MEMORY_PERCENT = 0.5


def pick_dtype(name: str) -> torch.dtype:
    """`auto`: bf16 where the CPU computes it natively (as the engine's own pick), else fp32."""
    if name != "auto":
        return DTYPES[name]
    from paged_backend.model.loading.precision import preferred_dtype

    return preferred_dtype(torch.device("cpu"))[0]


def grpo_generation_config(max_new_tokens: int, tokenizer, eos_ids: list[int], paged: bool):
    """The GenerationConfig GRPOTrainer builds for its transformers paths at TRL's defaults."""
    from transformers import GenerationConfig

    options = {"cache_implementation": "paged"} if paged else {}
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=True, pad_token_id=tokenizer.pad_token_id,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_ids, temperature=1.0, top_p=1.0,
                            top_k=0, min_p=None, repetition_penalty=1.0, disable_compile=True, **options)


def up_to_eos(tokens: list[int], eos_ids: list[int]) -> list[int]:
    """A completion up to and including its first EOS (TRL's completion mask), the rest being padding."""
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[:i + 1]
    return tokens


def run_generate(model, rows: list[list[int]], config, eos_ids: list[int]) -> list[list[int]]:
    """TRL's plain path: one static left-padded batch through `model.generate`."""
    ids, mask = left_pad(rows, config.pad_token_id)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return [up_to_eos(row, eos_ids) for row in out[:, ids.shape[1]:].tolist()]


def run_generate_batch(model, rows: list[list[int]], config, eos_ids: list[int]) -> list[list[int]]:
    """TRL's continuous-batching path: `model.generate_batch` with its ContinuousBatchingConfig."""
    from transformers import ContinuousBatchingConfig

    cb_config = ContinuousBatchingConfig(max_memory_percent=TRL_MAX_MEMORY_PERCENT)
    with torch.no_grad():
        outputs = model.generate_batch(rows, generation_config=config, continuous_batching_config=cb_config,
                                       progress_bar=False)
    return [up_to_eos(list(o.generated_tokens), eos_ids) for o in outputs.values()]


def weight_bytes(model) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (fused projections are views)."""
    storages = {}
    for t in [*model.parameters(), *model.buffers()]:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs every system once")
    parser.add_argument("--prompts", type=int, default=8, help="MT-bench first turns, chat template applied")
    parser.add_argument("--generations", type=int, default=4, help="rows per prompt (GRPO's num_generations)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="GRPO's max_completion_length")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                        help="the model's dtype for every system (auto: bf16 where the CPU has it, else fp32)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, for every system")
    parser.add_argument("--seed", type=int, default=0, help="round r seeds every system with seed + r")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown systems: {', '.join(unknown)}")

    import paged_backend
    from paged_backend.integrations.transformers_generate import engine_for
    from paged_backend.model.loading.default_model import default_model_path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    print(f"load before: {uptime()}")
    dtype = pick_dtype(args.dtype)
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
    eos_ids = [tokenizer.eos_token_id]  # TRL: the tokenizer's EOS, then the model's generation config's
    configured = model.generation_config.eos_token_id
    eos_ids += [e for e in ([configured] if isinstance(configured, int) else configured or []) if e not in eos_ids]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
               for q in load_mt_bench_prompts(args.prompts)]
    rows = [prompt for prompt in prompts for _ in range(args.generations)]  # TRL's RepeatSampler order
    weights_before = weight_bytes(model)
    print(f"model {path.name} in {str(dtype).removeprefix('torch.')}: {weights_before / 2**20:.1f} MiB of weights; "
          f"{len(rows)} rows ({args.prompts} prompts x {args.generations}), prompts of "
          f"{min(map(len, prompts))}..{max(map(len, prompts))} tokens, up to {args.max_new_tokens} new tokens")

    def system_run(system: str, rows_: list[list[int]], max_new_tokens: int) -> Callable[[], list[list[int]]]:
        config = grpo_generation_config(max_new_tokens, tokenizer, eos_ids, paged=system in PAGED_SYSTEMS)
        call = run_generate_batch if system in ("hf_generate_batch", "engine_generate_batch") else run_generate

        def run() -> list[list[int]]:
            if system in PAGED_SYSTEMS:
                paged_backend.enable()  # the engine sets its attention implementation on the model itself
            else:
                paged_backend.disable()  # also gives the model its own attention (sdpa) back
            return call(model, rows_, config, eos_ids)
        return run

    # Warm-up: every system once on a small call. The engine is built on the first paged call (its KV pool
    # allocated, its forward compiled or its compiled graphs loaded), as on a trainer's first rollout.
    startup: dict[str, Any] = {}
    for system in systems:
        rss, start = current_rss_bytes(), time.perf_counter()
        system_run(system, rows[:2], 4)()
        if system in PAGED_SYSTEMS and not startup:
            startup = {"engine_startup_s": time.perf_counter() - start,
                       "engine_startup_rss_increase_bytes": current_rss_bytes() - rss}
    memory: dict[str, Any] = {"weight_bytes_before_engine": weights_before, **startup}
    if startup:
        engine = engine_for(model)
        memory.update(engine_runs_the_model_object=engine.model is model, weight_bytes_after_engine=weight_bytes(model),
                      kv_pool_bytes=engine.cache.kv.nbytes, engine_compiled=bool(engine.runner_start.stats().get(
                          "compiled_check_passed", 0)), engine_runner_start=engine.runner_start.stats())
        print(f"engine: started in {startup['engine_startup_s']:.1f} s (+{startup['engine_startup_rss_increase_bytes'] / 2**20:.0f} "
              f"MiB RSS); KV pool {memory['kv_pool_bytes'] / 2**20:.0f} MiB; engine.model is model: "
              f"{memory['engine_runs_the_model_object']}; weights {memory['weight_bytes_after_engine'] / 2**20:.1f} MiB")

    runs: dict[str, list[dict[str, Any]]] = {system: [] for system in systems}
    for round_ in range(args.rounds):
        for system in (systems if round_ % 2 == 0 else systems[::-1]):
            run = system_run(system, rows, args.max_new_tokens)
            torch.manual_seed(args.seed + round_)
            rss = current_rss_bytes()
            with RunMeter() as meter:
                completions = run()
            tokens = sum(len(c) for c in completions)
            record = {**meter.summary(), "generated_tokens": tokens, "tokens_per_s": tokens / meter.wall_s,
                      "rows": len(completions), "rows_ended_by_eos": sum(bool(c) and c[-1] in eos_ids for c in completions),
                      "run_peak_rss_increase_bytes": meter.peak_bytes - rss}
            runs[system].append(record)
            print(f"round {round_ + 1} {system:22s} {meter.wall_s:7.2f} s {tokens:5d} tokens {record['tokens_per_s']:7.1f} tok/s "
                  f"({record['rows_ended_by_eos']}/{len(completions)} rows ended by EOS; load "
                  f"{meter.load_start:.2f} -> {meter.load_end:.2f})", flush=True)
    paged_backend.enable()

    summary = {system: {"label": SYSTEMS[system],
                        "tokens_per_s": median([r["tokens_per_s"] for r in records]),
                        "wall_s": median([r["wall_s"] for r in records]),
                        "generated_tokens": median([r["generated_tokens"] for r in records]),
                        "run_peak_rss_increase_bytes": median([r["run_peak_rss_increase_bytes"] for r in records]),
                        "rounds": len(records)}
               for system, records in runs.items()}
    tps = {system: s["tokens_per_s"] for system, s in summary.items()}
    ratio_pairs = {"engine_generate_batch / hf_generate_batch": ("engine_generate_batch", "hf_generate_batch"),
                   "engine_generate_batch / trl_generate": ("engine_generate_batch", "trl_generate"),
                   "engine_generate / trl_generate": ("engine_generate", "trl_generate"),
                   "hf_generate_batch / trl_generate": ("hf_generate_batch", "trl_generate")}
    ratios = {name: tps[a] / tps[b] for name, (a, b) in ratio_pairs.items() if a in tps and b in tps}

    print(f"\nrollout tokens/s, medians of {args.rounds} rounds ({len(rows)} rows, up to {args.max_new_tokens} "
          f"new tokens, {str(dtype).removeprefix('torch.')}, {args.threads} threads):")
    print(f"{'system':24s} {'tok/s':>8s} {'wall s':>8s} {'tokens':>7s} {'peak RSS +MiB':>14s}")
    for system, s in summary.items():
        print(f"{system:24s} {s['tokens_per_s']:8.1f} {s['wall_s']:8.2f} {s['generated_tokens']:7.0f} "
              f"{s['run_peak_rss_increase_bytes'] / 2**20:14.0f}")
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")
    print(f"load after: {uptime()}")
    report = {"workload": {"model": path.name, "dtype": str(dtype).removeprefix("torch."), "prompts": args.prompts,
                           "generations": args.generations, "rows": len(rows), "max_new_tokens": args.max_new_tokens,
                           "prompt_tokens": [len(p) for p in prompts], "threads": args.threads, "seed": args.seed,
                           "rounds": args.rounds, "sampling": {"do_sample": True, "temperature": 1.0, "top_p": 1.0,
                                                               "top_k": 0, "repetition_penalty": 1.0},
                           "eos_token_ids": eos_ids, "trl_generate_batch_rows": len(rows),
                           "hf_max_memory_percent": TRL_MAX_MEMORY_PERCENT},
              "systems": summary, "runs": runs, "ratios": ratios, "memory": memory, "machine": machine_info()}
    print(f"results: {write_results(report, 'rl_rollouts', args.json)}")


if __name__ == "__main__":
    main()
