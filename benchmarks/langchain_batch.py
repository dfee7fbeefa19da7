"""LangChain `batch` of MT-bench questions: ChatPaged against ChatHuggingFace on HuggingFacePipeline.

    pip install --no-deps langchain-huggingface   # the baseline only; not a dependency
    python benchmarks/langchain_batch.py [--questions 32] [--max-tokens 32] [--out results.json]

Same weights (the default model), same chat template, greedy decoding, same max_tokens on both
sides; each side runs the same `chain.batch(...)` call a LangChain user would write. Prints
output tokens/s for each and their ratio (target: ChatPaged at least 3x).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from langchain_core.messages import HumanMessage
from paged_backend.integrations.langchain import ChatPaged
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

from paged_backend.default_model import default_model_path

QUESTIONS = Path(__file__).resolve().parent / "data" / "mt_bench_questions.jsonl"


def load_conversations(limit: int) -> list[list[HumanMessage]]:
    with QUESTIONS.open() as f:
        return [[HumanMessage(json.loads(line)["turns"][0])] for line in f][:limit]


def run_batch(model, conversations) -> dict[str, float]:
    start = time.perf_counter()
    messages = model.batch(conversations)
    seconds = time.perf_counter() - start
    tokens = sum(count_output_tokens(model, m) for m in messages)
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
            "requests_per_s": len(conversations) / seconds}


def count_output_tokens(model, message) -> int:
    if message.usage_metadata:
        return message.usage_metadata["output_tokens"]
    return len(model.tokenizer(message.text, add_special_tokens=False)["input_ids"])


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
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    conversations = load_conversations(args.questions)

    paged = ChatPaged(temperature=0, max_tokens=args.max_tokens)
    paged.invoke("warm up", max_tokens=1)  # load the model outside the timing, as for the baseline
    results = {"chat_paged": run_batch(paged, conversations)}
    hf = build_hf_chat(args.max_tokens)
    results["chat_huggingface"] = run_batch(hf, conversations)
    ratio = results["chat_paged"]["tokens_per_s"] / results["chat_huggingface"]["tokens_per_s"]
    results["throughput_ratio"] = ratio
    results["config"] = {"questions": args.questions, "max_tokens": args.max_tokens, "torch_threads": torch.get_num_threads()}

    for name in ("chat_paged", "chat_huggingface"):
        r = results[name]
        print(f"{name:>17}: {r['output_tokens']:5d} output tokens in {r['seconds']:6.1f} s = "
              f"{r['tokens_per_s']:6.1f} tok/s, {r['requests_per_s']:.2f} req/s")
    print(f"throughput ratio ChatPaged / ChatHuggingFace: {ratio:.2f}x")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
