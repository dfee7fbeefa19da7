"""Requests with images on a small random LLaVA: the engine against HF `generate` in static batches, and repeated
images (encoder cache and prefix cache hits) against fresh ones, in one run.

Workload: N requests (default 32), each one image (224x224 pixels through a 4-layer CLIP tower of width 256:
196 image tokens) and a short question, greedy, EOS ignored, a fixed number of output tokens, on a LLaVA whose
language model is a 4-layer Llama of width 512 (fp32). Runs, after an untimed warm-up of each:

- HF `generate` on the same inputs in static batches of `--batch-size` (left-padded), the processor's pixels;
- the engine (`LLM.generate` with the images), every image different;
- the engine, the requests cycling over `--distinct` images: each repeated image is encoded once and its
  prompt blocks come from the prefix cache.

Each setting runs `--repeats` times in alternating order; medians count. Prints wall time, output tokens per
second and the ratios, checks the engine's tokens equal HF's, and writes benchmarks/results/vision_<machine
class>.json.

    python benchmarks/vision.py [--num-requests 32] [--max-tokens 32] [--batch-size 8] [--distinct 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tiny VLM builders of the tests
from common import machine_info, write_results
from helpers.vision import random_image, tiny_llava

from paged_backend import LLM, SamplingParams

QUESTION = "user : <image> \n what is in this picture assistant :"


def hf_run(model, processor, images: list, max_tokens: int, batch_size: int) -> tuple[float, list[list[int]]]:
    """HF generate in static batches: (seconds, each request's new tokens)."""
    processor.tokenizer.padding_side = "left"
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for first in range(0, len(images), batch_size):
        batch = images[first:first + batch_size]
        inputs = processor(text=[QUESTION] * len(batch), images=batch, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        tokens += out[:, inputs["input_ids"].shape[1]:].tolist()
    return time.perf_counter() - start, tokens


def engine_run(llm: LLM, images: list, max_tokens: int) -> tuple[float, list[list[int]], dict]:
    """The engine on a fresh cache state: (seconds, tokens, what its stats counted for this run)."""
    engine = llm.engine
    engine.reset_prefix_cache()
    engine.runner.images.cache.clear()
    before = engine.stats()
    prompts = [{"prompt": QUESTION, "multi_modal_data": {"image": image}} for image in images]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = engine.stats()
    counted = {key: after[key] - before[key] for key in ("images_encoded", "encoder_cache_hits", "encoder_seconds",
                                                           "prefix_cache_hit_tokens")}
    return wall, [output.outputs[0].token_ids for output in outputs], counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8, help="HF generate's static batch")
    parser.add_argument("--distinct", type=int, default=4, help="distinct images of the repeated-image run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    model, processor = tiny_llava(vision=(256, 4), text=(512, 4), image_size=224, patch=16)
    fresh = [random_image(seed, 240, 320) for seed in range(args.num_requests)]
    repeated = [fresh[i % args.distinct] for i in range(args.num_requests)]
    llm = LLM(model, processor, enable_prefix_caching=True)
    settings = {
        "hf_generate": lambda: hf_run(model, processor, fresh, args.max_tokens, args.batch_size)[0],
        "engine_fresh_images": lambda: engine_run(llm, fresh, args.max_tokens)[0],
        "engine_repeated_images": lambda: engine_run(llm, repeated, args.max_tokens)[0],
    }
    hf_run(model, processor, fresh[:2], 2, 2)  # warm-up, untimed
    engine_run(llm, fresh[:2], 2)
    _, hf_tokens = hf_run(model, processor, fresh, args.max_tokens, args.batch_size)
    _, engine_tokens, _ = engine_run(llm, fresh, args.max_tokens)
    assert engine_tokens == hf_tokens, "the engine's greedy tokens differ from HF generate's"
    walls: dict[str, list[float]] = {name: [] for name in settings}
    for repeat in range(args.repeats):
        order = list(settings) if repeat % 2 == 0 else list(reversed(settings))
        for name in order:
            walls[name].append(settings[name]())
    _, _, fresh_counts = engine_run(llm, fresh, args.max_tokens)
    _, _, repeated_counts = engine_run(llm, repeated, args.max_tokens)
    tokens = args.num_requests * args.max_tokens
    results = {name: {"wall_s_median": statistics.median(runs), "wall_s": runs,
                      "output_tokens_per_s": tokens / statistics.median(runs)} for name, runs in walls.items()}
    results["engine_fresh_images"]["counted"] = fresh_counts
    results["engine_repeated_images"]["counted"] = repeated_counts
    hf = results["hf_generate"]["wall_s_median"]
    ratios = {"engine_fresh_over_hf": hf / results["engine_fresh_images"]["wall_s_median"],
              "engine_repeated_over_hf": hf / results["engine_repeated_images"]["wall_s_median"],
              "repeated_over_fresh": (results["engine_fresh_images"]["wall_s_median"]
                                      / results["engine_repeated_images"]["wall_s_median"])}
    for name, result in results.items():
        print(f"{name:24s} {result['wall_s_median']:7.2f} s  {result['output_tokens_per_s']:8.1f} tok/s")
    for name, ratio in ratios.items():
        print(f"{name:24s} {ratio:5.2f}x")
    print("encoder, fresh:", fresh_counts)
    print("encoder, repeated:", repeated_counts)
    payload = {"workload": {**vars(args), "json": None, "image_tokens": 196, "model": "random LLaVA: CLIP 4x256 "
                            "(224 px, patch 16), Llama 4x512, fp32"},
               "results": results, "ratios": ratios, "tokens_equal_hf": True, "machine": machine_info()}
    print("wrote", write_results(payload, "vision", args.json))


if __name__ == "__main__":
    main()
