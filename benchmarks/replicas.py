"""Engine replicas on Ray against one engine, on the same requests: throughput and the ratio.

    python benchmarks/replicas.py                      # a small random Llama, 48 requests
    python benchmarks/replicas.py --model default      # SmolLM2-135M-Instruct (slower)

One engine runs in this process, with 1 thread and with every core (the better one is the baseline:
on shared cores more threads can be slower); K replicas run as Ray actors (started with
`start_local_ray`, 127.0.0.1 only) with cores/K threads each. Both get the same seeded requests
(random prompt ids, greedy, ignore_eos, so every run generates the same number of tokens), after a
short warm-up; the tokens must be equal. On a machine with C cores, K replicas can beat one engine
only where one engine leaves cores idle; with 2 shared cores expect no gain (a ratio near or below 1).
Results go to benchmarks/results/replicas_<machine class>.json.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # read when ray is first imported
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, machine_info, write_results

SEED = 0


def build_small_llama(folder: Path) -> str:
    """A random Llama big enough that a step costs real compute (about 20M parameters)."""
    import torch
    import transformers as tf

    torch.manual_seed(SEED)
    config = tf.LlamaConfig(vocab_size=4096, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024)
    model = tf.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    return str(folder)


def make_requests(num: int, vocab: int, prompt_len: tuple[int, int], max_tokens: tuple[int, int]):
    from paged_backend import SamplingParams

    rng = random.Random(SEED)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(num)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(*max_tokens), ignore_eos=True)
              for _ in range(num)]
    return prompts, params


def timed_generate(generate, prompts: Sequence, params: Sequence) -> tuple[list, float]:
    generate(prompts[:2], params[:2])  # warm-up: first-call allocations, thread pools, Ray channels
    start = time.perf_counter()
    outputs = generate(prompts, params)
    return outputs, time.perf_counter() - start


def run_one_engine(model: str, prompts, params, threads: int) -> tuple[list, dict[str, Any]]:
    from paged_backend import LLM

    start = time.perf_counter()
    llm = LLM(model, num_threads=threads)
    setup_s = time.perf_counter() - start
    outputs, wall = timed_generate(lambda p, s: llm.generate(p, s, use_tqdm=False), prompts, params)
    return outputs, result(outputs, wall, setup_s, f"one engine, {threads} threads")


def run_replicas(model: str, prompts, params, num_replicas: int, cores: int) -> tuple[list, dict[str, Any]]:
    import ray
    from paged_backend.integrations.ray import ReplicatedLLM, start_local_ray

    start = time.perf_counter()
    start_local_ray(num_cpus=cores)
    ray_init_s = time.perf_counter() - start
    per_replica = max(1, cores // num_replicas)
    llm = ReplicatedLLM(model, num_replicas, num_cpus=per_replica)
    setup_s = time.perf_counter() - start
    try:
        outputs, wall = timed_generate(lambda p, s: llm.generate(p, s, use_tqdm=False), prompts, params)
        routed = list(llm.aengine.router.routed)
    finally:
        llm.shutdown()
        ray.shutdown()
    summary = result(outputs, wall, setup_s, f"{num_replicas} Ray replicas, {per_replica} thread(s) each")
    summary.update(ray_init_s=ray_init_s, requests_per_replica=routed)
    return outputs, summary


def result(outputs: list, wall: float, setup_s: float, label: str) -> dict[str, Any]:
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"label": label, "wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
            "requests_per_s": len(outputs) / wall, "setup_s": setup_s, "load_1m_after": load_average()}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small", help="'small' (random Llama), 'default' (SmolLM2) or a folder")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="CPUs given to Ray and to one engine")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 160), metavar=("LOW", "HIGH"))
    p.add_argument("--max-tokens", type=int, nargs=2, default=(16, 48), metavar=("LOW", "HIGH"))
    p.add_argument("--json", type=Path, default=None, help="default benchmarks/results/replicas_<machine class>.json")
    return p.parse_args(argv)


def resolve_model(name: str, scratch: Path) -> tuple[str, int]:
    import transformers as tf

    if name == "small":
        path = build_small_llama(scratch)
    elif name == "default":
        from paged_backend.model.loading.default_model import default_model_path

        path = str(default_model_path())
    else:
        path = name
    return path, tf.AutoConfig.from_pretrained(path).get_text_config().vocab_size


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        model, vocab = resolve_model(args.model, Path(scratch))
        prompts, params = make_requests(args.num_prompts, vocab, tuple(args.prompt_len), tuple(args.max_tokens))
        singles = [run_one_engine(model, prompts, params, threads) for threads in sorted({1, args.cores})]
        rep_out, rep = run_replicas(model, prompts, params, args.replicas, args.cores)
    one_out, one = max(singles, key=lambda pair: pair[1]["tokens_per_s"])  # the baseline is the best single
    equal = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(one_out, rep_out))
    ratio = rep["tokens_per_s"] / one["tokens_per_s"]
    report = {"one_engine": [summary for _, summary in singles], "replicas": rep,
              "replicas_over_best_one_engine": ratio,
              "tokens_equal": {"equal": equal, "of": len(prompts)},
              "workload": {"model": args.model, "num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
                           "max_tokens": args.max_tokens},
              "machine": machine_info(), "command": " ".join(["python", "benchmarks/replicas.py", *sys.argv[1:]])}
    path = write_results(report, "replicas", args.json)
    for system in [summary for _, summary in singles] + [rep]:
        print(f"{system['label']:<34} {system['tokens_per_s']:8.1f} tok/s  {system['wall_s']:6.2f} s  "
              f"(setup {system['setup_s']:.1f} s)")
    print(f"replicas / best one engine ({one['label']}): {ratio:.2f}x throughput; tokens equal {equal}/{len(prompts)}; "
          f"requests per replica {rep['requests_per_replica']}; results in {path}")


if __name__ == "__main__":
    main()
