"""The sampler's draw for a batch of sampled rows: the engine's race noise against the draws it replaces and HF's.

Rows of the default model's vocabulary (49,152) at temperature 0.8, `--rows` of them, unseeded and seeded (each
row its own generator), timed as medians of `--repeats` rounds, the ways alternating:

- `engine`: `sampler.sample()` as the engine calls it (race noise from uniforms and a log, race_noise.py);
- `exponential_`: the same race with torch's `exponential_` noise, the sampler's draw before race_noise.py;
- `multinomial`: `softmax` then `torch.multinomial`, the draw HF `generate` makes (no per-row generators there,
  so its seeded figure draws every row from one generator).

    python benchmarks/sampler.py
    python benchmarks/sampler.py --rows 1 --repeats 21

Writes benchmarks/results/sampler_<machine class>.json (common.write_results).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` sits beside this script

from common import alternate, load_average, write_results

from paged_backend.core.outputs import RequestMetrics
from paged_backend.core.request import Request
from paged_backend.sampling.sampler import sample
from paged_backend.sampling.sampling_params import SamplingParams

VOCAB, TEMPERATURE = 49_152, 0.8


def requests_of(rows: int, seeded: bool) -> list[Request]:
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=16)
    return [Request(str(i), None, [], params, 16, frozenset(), RequestMetrics(0.0),
                    generator=torch.Generator().manual_seed(i) if seeded else None) for i in range(rows)]


def exponential_race(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    probs = torch.softmax(logits / TEMPERATURE, dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for i, request in enumerate(requests):
        if request.generator is not None:
            noise[i].exponential_(generator=request.generator)
    return (probs / noise).argmax(dim=-1)


def multinomial(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    generator = requests[0].generator
    return torch.multinomial(torch.softmax(logits / TEMPERATURE, dim=-1), 1, generator=generator)[:, 0]


def milliseconds(draw: Callable[[torch.Tensor, list[Request]], object], logits: torch.Tensor,
                 requests: list[Request]) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        draw(logits, requests)
        return (time.perf_counter() - start) * 1e3
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    logits = torch.randn(args.rows, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    figures = {}
    for seeded in (False, True):
        requests = requests_of(args.rows, seeded)
        draws = {"engine": lambda x, r: sample(x, r), "exponential_": exponential_race, "multinomial": multinomial}
        times = alternate({name: milliseconds(draw, logits, requests) for name, draw in draws.items()},
                          args.repeats)
        medians = {name: round(statistics.median(values), 3) for name, values in times.items()}
        kind = "seeded" if seeded else "unseeded"
        figures[kind] = {"ms": medians, "exponential_ / engine": round(medians["exponential_"] / medians["engine"], 2),
                         "multinomial / engine": round(medians["multinomial"] / medians["engine"], 2)}
        print(f"{args.rows} {kind} rows of {VOCAB}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in medians.items())
              + f"; exponential_ / engine {figures[kind]['exponential_ / engine']:.2f}x, multinomial / engine "
              f"{figures[kind]['multinomial / engine']:.2f}x")
    payload = {"rows": args.rows, "vocab": VOCAB, "temperature": TEMPERATURE, "repeats": args.repeats,
               "threads": torch.get_num_threads(), "load_average": load_average(), "results": figures}
    print(write_results(payload, "sampler"))


if __name__ == "__main__":
    main()
