"""prompt | ChatPaged | output parser over MT-bench questions: one batched run, then one streamed.

    python examples/langchain_chain.py [--questions 8] [--max-tokens 64]

The batch puts every question into the engine's running batch at once; the stream prints
tokens as the engine produces them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from paged_backend.integrations.langchain import ChatPaged

QUESTIONS = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "mt_bench_questions.jsonl"


def load_questions(limit: int) -> list[str]:
    with QUESTIONS.open() as f:
        return [json.loads(line)["turns"][0] for line in f][:limit]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    prompt = ChatPromptTemplate.from_messages([
        ("system", "You are a concise assistant. Answer in at most three sentences."),
        ("human", "{question}"),
    ])
    chain = prompt | ChatPaged(temperature=0, max_tokens=args.max_tokens) | StrOutputParser()
    questions = load_questions(args.questions)

    start = time.perf_counter()
    answers = chain.batch([{"question": q} for q in questions])
    print(f"batched {len(questions)} questions in {time.perf_counter() - start:.1f} s\n")
    for question, answer in zip(questions, answers):
        print(f"Q: {question}\nA: {answer.strip()}\n")

    print(f"streamed: {questions[0]}\n> ", end="", flush=True)
    for token in chain.stream({"question": questions[0]}):
        print(token, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
