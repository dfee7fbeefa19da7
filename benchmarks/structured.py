"""Structured outputs: the same 32 extraction prompts constrained by a JSON Schema and unconstrained.

Each prompt asks the default model to extract a person (name, age, an address object, an occupation
from an enum, a list of languages) from a short generated description. The constrained run holds
every answer to the schema; each answer must then validate against it (`jsonschema`). So that
both runs do the same work, the unconstrained run generates exactly as many tokens per request as
the constrained one did (EOS ignored). The two runs alternate `--repeats` times; throughputs are
medians. Greedy, all requests submitted at once (batch 32).

    python benchmarks/structured.py [--num-prompts 32] [--max-tokens 160] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, machine_info, median, write_results  # noqa: E402

from paged_backend import LLM, SamplingParams  # noqa: E402

OCCUPATIONS = ["nurse", "teacher", "engineer", "chef", "farmer", "pilot", "lawyer", "artist"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                     "country": {"type": "string", "maxLength": 30}},
                    "required": ["city", "country"]},
        "occupation": {"enum": OCCUPATIONS},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 4},
    },
    "required": ["name", "age", "address", "occupation", "languages"],
}
FIRST = ["Maria", "John", "Aiko", "Pierre", "Fatima", "Lars", "Chen", "Olga"]
LAST = ["Lopez", "Smith", "Tanaka", "Dubois", "Haddad", "Nilsson", "Wei", "Petrova"]
PLACES = [("Lisbon", "Portugal", "Portuguese"), ("Leeds", "England", "English"), ("Osaka", "Japan", "Japanese"),
          ("Lyon", "France", "French"), ("Cairo", "Egypt", "Arabic"), ("Malmo", "Sweden", "Swedish"),
          ("Chengdu", "China", "Chinese"), ("Kazan", "Russia", "Russian")]


def extraction_prompts(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    chats = []
    for _ in range(n):
        city, country, language = rng.choice(PLACES)
        name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        text = (f"{name} is {rng.randint(19, 80)} years old and works as a {rng.choice(OCCUPATIONS)} in {city}, "
                f"{country}. They speak {language} and {rng.choice(['English', 'Spanish', 'German'])}.")
        chats.append([{"role": "system", "content": "Extract the person described by the user as JSON with the "
                                                    "fields name, age, address (city, country), occupation and "
                                                    "languages."},
                      {"role": "user", "content": text}])
    return chats


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0] for o in outputs]


def is_valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-kv-blocks", type=int, default=2048)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    llm = LLM(None, num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.num_prompts)
    prompts = [llm.render_chat(chat, add_generation_prompt=True, tools=None, extra={})
               for chat in extraction_prompts(args.num_prompts)]
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs={"json": SCHEMA})
    walls: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    loads = []
    answers, lengths = None, None
    for _ in range(args.repeats):
        loads.append(load_average())
        wall, answers = run(llm, prompts, [constrained] * len(prompts))
        walls["constrained"].append(wall)
        lengths = [len(a.token_ids) for a in answers]
        free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        wall, _ = run(llm, prompts, free)
        walls["unconstrained"].append(wall)
    tokens = sum(lengths)
    throughput = {kind: tokens / median(w) for kind, w in walls.items()}
    valid = sum(is_valid(a.text) for a in answers)
    ratio = throughput["constrained"] / throughput["unconstrained"]
    print(f"{args.num_prompts} extraction prompts, batch {args.num_prompts}, greedy; {tokens} output tokens per run "
          f"(mean {tokens / len(answers):.0f}); load average {loads}")
    for kind in ("unconstrained", "constrained"):
        print(f"{kind:>14}: {throughput[kind]:7.1f} out tok/s (walls {', '.join(f'{w:.1f}' for w in walls[kind])} s)")
    print(f"constrained / unconstrained throughput: {ratio:.2f}x (target >= 0.85x); "
          f"valid against the schema: {valid}/{len(answers)}")
    print("example:", answers[0].text)
    write_results({"machine": machine_info(), "args": vars(args) | {"json": None}, "load_average": loads,
                   "output_tokens_per_run": tokens, "walls_s": walls, "output_tokens_per_s": throughput,
                   "ratio": ratio, "valid": valid, "num_answers": len(answers),
                   "finish_reasons": [a.finish_reason for a in answers], "example": answers[0].text,
                   "schema": SCHEMA}, "structured", args.json)


if __name__ == "__main__":
    main()
