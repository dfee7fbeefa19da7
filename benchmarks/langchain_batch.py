"""LangChain `batch` of MT-bench questions: ChatPaged against ChatHuggingFace on HuggingFacePipeline.

    pip install --no-deps langchain-huggingface   # the baseline only; not a dependency
    python benchmarks/langchain_batch.py [--questions 32] [--max-tokens 32] [--repeats 2]

Same weights (the default model), same chat template, greedy decoding, same max_tokens on both
sides; each side runs the same `chain.batch(...)` call a LangChain user would write. After an
untimed warm-up of both, the sides take turns (`--repeats` runs each; medians count). Output tokens
are counted the same way on both sides (the answer text re-tokenised), and the answers are compared.
Prints output tokens/s for each and their ratio (target: ChatPaged at least 3x) and writes
benchmarks/results/langchain_batch_<machine class>.json and a chart beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from langchain_core.messages import HumanMessage
from paged_backend.integrations.langchain import ChatPaged
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

from paged_backend.model.loading.default_model import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` and `charts` sit beside this script
import charts
from common import machine_info, write_results

QUESTIONS = Path(__file__).resolve().parent / "data" / "mt_bench_questions.jsonl"


def load_conversations(limit: int) -> list[list[HumanMessage]]:
    with QUESTIONS.open() as f:
        return [[HumanMessage(json.loads(line)["turns"][0])] for line in f][:limit]


def run_batch(model, conversations, tokenizer) -> dict[str, Any]:
    start = time.perf_counter()
    messages = model.batch(conversations)
    seconds = time.perf_counter() - start
    texts = [m.text for m in messages]
    # Both sides counted alike: each answer's text re-tokenised with the model's own tokenizer.
    tokens = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
            "requests_per_s": len(conversations) / seconds, "texts": texts}


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ordered = sorted(runs, key=lambda r: r["seconds"])
    middle = dict(ordered[(len(ordered) - 1) // 2])
    middle["all_seconds"] = [r["seconds"] for r in runs]
    return middle


def build_hf_chat(max_tokens: int):
    from langchain_huggingface import ChatHuggingFace, HuggingFacePipeline

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer, max_new_tokens=max_tokens,
                    do_sample=False, return_full_text=False)
    llm = HuggingFacePipeline(pipeline=pipe, model_id=str(path))
    return ChatHuggingFace(llm=llm, tokenizer=tokenizer, model_id=str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs of each side; medians count")
    parser.add_argument("--json", type=Path, default=None,
                        help="results file (default benchmarks/results/langchain_batch_<machine class>.json)")
    args = parser.parse_args()
    conversations = load_conversations(args.questions)

    sides = {"chat_paged": ChatPaged(temperature=0, max_tokens=args.max_tokens),
             "chat_huggingface": build_hf_chat(args.max_tokens)}
    tokenizer = sides["chat_huggingface"].tokenizer
    for model in sides.values():  # warm-up, untimed: loading and first calls land on neither side
        model.batch(conversations[:2])
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    for repeat in range(args.repeats):  # taking turns, so a burst of load on shared cores hits both
        for name in (list(sides) if repeat % 2 == 0 else list(sides)[::-1]):
            runs[name].append(run_batch(sides[name], conversations, tokenizer))
    results: dict[str, Any] = {name: median_run(r) for name, r in runs.items()}
    paged_texts, hf_texts = results["chat_paged"]["texts"], results["chat_huggingface"]["texts"]
    same = sum(a == b for a, b in zip(paged_texts, hf_texts))
    every_run_alike = all(r["texts"] == paged_texts for rs in runs.values() for r in rs)
    for r in results.values():
        r.pop("texts")
    ratio = results["chat_paged"]["tokens_per_s"] / results["chat_huggingface"]["tokens_per_s"]
    results.update(throughput_ratio=ratio, identical_answers=f"{same}/{args.questions}",
                   identical_in_every_run=every_run_alike,
                   config={"questions": args.questions, "max_tokens": args.max_tokens, "repeats": args.repeats},
                   machine=machine_info(),
                   command=" ".join(["python", "benchmarks/langchain_batch.py", *sys.argv[1:]]))

    for name in ("chat_paged", "chat_huggingface"):
        r = results[name]
        print(f"{name:>17}: {r['output_tokens']:5d} output tokens in {r['seconds']:6.1f} s = "
              f"{r['tokens_per_s']:6.1f} tok/s, {r['requests_per_s']:.2f} req/s")
    print(f"identical answers: {same}/{args.questions}")
    print(f"throughput ratio ChatPaged / ChatHuggingFace: {ratio:.2f}x")
    path = write_results(results, "langchain_batch", args.json)
    print(f"results: {path}; chart: {charts.draw('langchain_batch', results, path)}")


if __name__ == "__main__":
    main()
