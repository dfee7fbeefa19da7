"""The second KV tier on the default model: a cached 4,000-token prefix after a restart, and swap against
recompute under preemption.

1. Restart. A first process (this script with --store) serves one request whose chat prompt opens with a
   ~4,000-token system message and stores its blocks in a disk tier, then exits. This process, the restarted one,
   then takes turns (`--rounds` each, order flipped every round, the pool's prefix cache reset before each):
   - warm: a request with that system message and another question: the prefix is read back from the disk tier's
     files, which the page cache holds after the first read;
   - warm from disk: the same, with the files dropped from the page cache first (posix_fadvise DONTNEED), so
     they are read from the device;
   - cold: the same request on an engine of the same model without the tier: the whole prompt is computed.
   Each is timed to its first token (max_tokens=1); the medians and their ratio are printed. The tokens of a longer
   greedy answer are compared between warm and cold.
2. Preemption. Eight requests of ~1,000-token prompts and 512 output tokens each, in fp32, in a pool that holds
   2.5 of them whole: the batch admits more while their prompts fit, then preempts as their answers grow. Recompute
   against swap to disk, alternating; medians of wall time, tokens computed and tokens compared.

    python benchmarks/kv_offload.py [--prefix-tokens 4000] [--rounds 5] [--preempt-rounds 2] [--skip-preemption]

Writes benchmarks/results/kv_offload_<machine class>.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import alternate, load_mt_bench_prompts, machine_info, median, write_results

import torch

from paged_backend import LLM, SamplingParams
from paged_backend.engine import Engine

DISK_BYTES = 8 * 2**30


def chat_prompts(llm: LLM, system_tokens: int, questions: list[str]) -> list[list[int]]:
    """One chat prompt per question, all opening with the same system message of about `system_tokens` tokens."""
    tok = llm.tokenizer
    corpus = " ".join(load_mt_bench_prompts(80, turn=0) + load_mt_bench_prompts(80, turn=1)) * 4
    system = tok.decode(tok(corpus)["input_ids"][:system_tokens])
    return [llm.render_chat([{"role": "system", "content": system}, {"role": "user", "content": q}],
                            add_generation_prompt=True, tools=None, extra={}) for q in questions]


def first_token_s(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    """Seconds from adding the request to its first token, and the tokens it took from a cache."""
    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                return time.perf_counter() - start, output.num_cached_tokens
    raise RuntimeError("the request did not finish")


def answer(engine: Engine, prompt: list[int], max_tokens: int = 32) -> list[int]:
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                return list(output.outputs[0].token_ids)
    raise RuntimeError("the request did not finish")


def drop_from_page_cache(folder: Path) -> None:
    """Ask the kernel to forget the cached pages of every file under `folder` (written back already), so the next
    read comes from the device."""
    for path in folder.rglob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def store(folder: Path, prefix_tokens: int) -> None:
    """The first process: compute the first prompt, store its blocks, exit."""
    llm = LLM(None, kv_offload_disk_bytes=DISK_BYTES, kv_offload_dir=str(folder))
    prompt = chat_prompts(llm, prefix_tokens, load_mt_bench_prompts(1))[0]
    first_token_s(llm.engine, prompt)
    llm.close()


def restart(folder: Path, args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--store", str(folder), "--prefix-tokens", str(args.prefix_tokens)],
                   check=True)
    store_s = time.perf_counter() - start
    llm = LLM(None, kv_offload_disk_bytes=DISK_BYTES, kv_offload_dir=str(folder))
    engine = llm.engine
    plain = Engine(llm.model, llm.tokenizer, type(engine.config)())  # the same model, no tier
    prompt = chat_prompts(llm, args.prefix_tokens, load_mt_bench_prompts(2))[1]  # another question, same system
    cached: dict[str, list[int]] = {"warm": [], "warm_from_disk": [], "cold": []}

    def timed(name: str):
        def run() -> float:
            chosen = plain if name == "cold" else engine
            chosen.reset_prefix_cache()  # the pool forgets; the disk tier keeps what the first process stored
            if name == "warm_from_disk":
                drop_from_page_cache(folder)
            seconds, hit = first_token_s(chosen, prompt)
            cached[name].append(hit)
            return seconds
        return run

    drop_from_page_cache(folder)
    first_warm, first_hit = timed("warm")(), cached["warm"].pop()  # the first read after the restart, alone
    times = alternate({name: timed(name) for name in cached}, args.rounds)
    engine.reset_prefix_cache()
    warm_tokens = answer(engine, prompt)
    plain.reset_prefix_cache()
    cold_tokens = answer(plain, prompt)
    stats = engine.stats()
    llm.close()
    return {"prompt_tokens": len(prompt), "store_process_s": store_s, "first_warm_s": first_warm,
            "first_warm_cached_tokens": first_hit, "warm_s": times["warm"], "warm_from_disk_s": times["warm_from_disk"],
            "cold_s": times["cold"], "warm_cached_tokens": cached["warm"],
            "warm_from_disk_cached_tokens": cached["warm_from_disk"], "cold_cached_tokens": cached["cold"],
            "warm_median_s": median(times["warm"]), "warm_from_disk_median_s": median(times["warm_from_disk"]),
            "cold_median_s": median(times["cold"]), "ratio": median(times["warm"]) / median(times["cold"]),
            "ratio_from_disk": median(times["warm_from_disk"]) / median(times["cold"]),
            "same_tokens": warm_tokens == cold_tokens,
            "disk_hit_blocks": stats["kv_offload_disk_hit_blocks"],
            "restore_s": stats["kv_offload_restore_seconds"]}


def preemption(folder: Path, args: argparse.Namespace) -> dict:
    """Swap against recompute on a workload that preempts: one engine per mode, alternating runs. The model runs in
    fp32: recomputing a context computes it in other steps than the first time, which in int4 or bf16 rounds
    differently, so only in fp32 can both modes be held to the same tokens."""
    probe = LLM(None, dtype=torch.float32)
    prompts = chat_prompts(probe, args.preempt_tokens, load_mt_bench_prompts(8, turn=1))
    params = SamplingParams(temperature=0, max_tokens=args.preempt_output, ignore_eos=True)
    per_request = -(-(max(map(len, prompts)) + args.preempt_output) // 16)
    blocks = int(args.preempt_fit * per_request)
    modes = {"recompute": {"preemption_mode": "recompute"},
             "swap_disk": {"kv_offload_disk_bytes": DISK_BYTES, "preemption_mode": "swap",
                           "kv_offload_dir": str(folder / "preempt")}}
    engines = {name: Engine(probe.model, probe.tokenizer, type(probe.engine.config)(num_kv_blocks=blocks, **extra))
               for name, extra in modes.items()}
    tokens: dict[str, list[list[int]]] = {}
    counts: dict[str, dict[str, list[int]]] = {name: {"preemptions": [], "computed_tokens": []} for name in modes}

    def timed(name: str):
        def run() -> float:
            engine = engines[name]
            engine.reset_prefix_cache()
            before = engine.stats()
            start = time.perf_counter()
            # A salt per run: no run finds the blocks of an earlier one, in the pool or on disk.
            ids = [engine.add_request(p, params, cache_salt=f"{name}-{time.time()}") for p in prompts]
            finals = {}
            while engine.has_unfinished_requests():
                finals.update({o.request_id: o for o in engine.step() if o.finished})
            elapsed = time.perf_counter() - start
            tokens[name] = [list(finals[i].outputs[0].token_ids) for i in ids]
            after = engine.stats()
            counts[name]["preemptions"].append(after["num_preemptions"] - before["num_preemptions"])
            counts[name]["computed_tokens"].append(after["num_computed_tokens"] - before["num_computed_tokens"])
            return elapsed
        return run

    times = alternate({name: timed(name) for name in modes}, args.preempt_rounds)
    medians = {name: median(t) for name, t in times.items()}
    return {"requests": len(prompts), "prompt_tokens": [len(p) for p in prompts], "num_kv_blocks": blocks,
            "dtype": "float32", "wall_s": times, "median_s": medians, "ratio": medians["swap_disk"] / medians["recompute"],
            "preemptions": {name: c["preemptions"] for name, c in counts.items()},
            "computed_tokens": {name: c["computed_tokens"] for name, c in counts.items()},
            "swapped_in_blocks": engines["swap_disk"].stats()["kv_offload_swapped_in_blocks"],
            "requests_with_same_tokens": sum(a == b for a, b in zip(tokens["swap_disk"], tokens["recompute"])),
            "same_tokens": tokens["swap_disk"] == tokens["recompute"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix-tokens", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=5, help="alternating warm/cold first-token runs; medians count")
    parser.add_argument("--preempt-tokens", type=int, default=1000)
    parser.add_argument("--preempt-output", type=int, default=512)
    parser.add_argument("--preempt-fit", type=float, default=2.5, help="the pool holds this many whole requests")
    parser.add_argument("--preempt-rounds", type=int, default=2)
    parser.add_argument("--store", type=Path, default=None, help=argparse.SUPPRESS)  # the first process's folder
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.store is not None:
        store(args.store, args.prefix_tokens)
        return
    with tempfile.TemporaryDirectory() as folder:
        warm = restart(Path(folder) / "restart", args)
        print(f"restart: prompt {warm['prompt_tokens']} tokens; first token after the restart "
              f"{warm['first_warm_s']:.3f} s ({warm['first_warm_cached_tokens']} tokens read back); medians of "
              f"{args.rounds}: warm {warm['warm_median_s']:.3f} s, warm from disk {warm['warm_from_disk_median_s']:.3f}"
              f" s, cold {warm['cold_median_s']:.3f} s; ratios {warm['ratio']:.3f} and {warm['ratio_from_disk']:.3f} "
              f"(target <= 0.2); same tokens: {warm['same_tokens']}")
        swap = preemption(Path(folder), args)
        print(f"preemption (fp32): {swap['requests']} requests in {swap['num_kv_blocks']} blocks; median wall s "
              + ", ".join(f"{name} {s:.2f}" for name, s in swap["median_s"].items())
              + f"; swap / recompute {swap['ratio']:.3f}; preemptions {swap['preemptions']}; tokens computed "
              f"{swap['computed_tokens']}; same tokens: {swap['same_tokens']}")
    report = {"machine": machine_info(), "args": vars(args) | {"json": None, "store": None}, "restart": warm,
              "preemption": swap}
    print(f"results: {write_results(report, 'kv_offload', args.json)}")


if __name__ == "__main__":
    main()
