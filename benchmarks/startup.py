"""Start-up of the default model: eager, compiled with an empty compile cache (cold), and compiled again in a
second process over the cache the first filled (warm). Each start is its own process, as a user's would be.

    python benchmarks/startup.py                 # eager x2, cold x1, warm x2 (about 3-5 minutes on 2 cores)
    python benchmarks/startup.py --repeats 1     # one of each

A start is timed from the parent (the whole process, imports included) and from inside the child (`LLM()`
construction, and the first short answer). The cold and warm starts share one temporary project cache
folder holding a link to the converted default model, so "cold" compiles from nothing (graphs and inductor's
kernels) but converts no GGUF file. Prints the medians and the warm start's cost over eager.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median, write_results  # the benchmarks folder, as when run as a script

CHILD = """
import json, sys, time
start = time.perf_counter()
from paged_backend import LLM, SamplingParams
imported = time.perf_counter()
llm = LLM(compile={compile})
built = time.perf_counter()
# A chat turn, as users send: the raw question's first greedy token ends the turn (an empty answer).
out = llm.chat([{{"role": "user", "content": "What is the capital of France?"}}],
               SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
answered = time.perf_counter()
engine = llm.engine
forward = engine.runner.forward_model
print(json.dumps({{"import_s": imported - start, "llm_s": built - imported, "first_answer_s": answered - built,
                  "compile_s": engine.runner_start.compile_s, "compiled": engine.runner.compiled,
                  "new_graphs": getattr(forward, "new_graphs", None), "text": out[0].outputs[0].text}}))
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="eager and warm starts each (cold: once)")
    return parser.parse_args(argv)


def start_once(compile_: bool, env: dict[str, str]) -> dict[str, Any]:
    """One start in a fresh process: the child's own timings and the parent's wall seconds."""
    begin = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD.format(compile=compile_)], env=env, capture_output=True,
                          text=True, check=False)
    wall = time.perf_counter() - begin
    if proc.returncode != 0:
        raise RuntimeError(f"a start failed:\n{proc.stderr[-3000:]}")
    return {"process_s": wall, **json.loads(proc.stdout.strip().splitlines()[-1])}


def cache_with_model(folder: Path) -> dict[str, str]:
    """An environment whose project cache is `folder`, holding a link to the converted default model (made
    now, in this process, if it was not converted yet), and no inductor folder of the user's."""
    from paged_backend.model.loading import default_model

    source = default_model.default_model_path()
    (folder / source.name).symlink_to(source, target_is_directory=True)
    env = {**os.environ, "PAGED_BACKEND_CACHE": str(folder)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    env.pop("PAGED_BACKEND_COMPILE", None)
    env.pop("PAGED_BACKEND_COMPILE_CACHE", None)
    return env


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("process_s", "import_s", "llm_s", "first_answer_s")
    return {"runs": runs, **{f"median_{key}": round(median([r[key] for r in runs]), 2) for key in keys}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        env = cache_with_model(Path(tmp))
        start_once(False, env)  # converts nothing more, but warms the page cache for the model's files
        eager = [start_once(False, env) for _ in range(args.repeats)]
        cold = [start_once(True, env)]
        warm = [start_once(True, env) for _ in range(args.repeats)]
    modes = {"eager": summarise(eager), "cold_compiled": summarise(cold), "warm_compiled": summarise(warm)}
    answers = {mode: {run["text"] for run in result["runs"]} for mode, result in modes.items()}
    results = {
        "model": "the default model (SmolLM2-135M-Instruct, LLM() defaults)",
        "threads": os.cpu_count(),
        **modes,
        "warm_minus_eager_s": round(modes["warm_compiled"]["median_process_s"] - modes["eager"]["median_process_s"], 2),
        "cold_compile_s": round(cold[0]["compile_s"], 1),
        "warm_loaded_every_graph": all(run["new_graphs"] == 0 for run in warm),
        "answers": {mode: sorted(texts) for mode, texts in answers.items()},
    }
    for mode, result in modes.items():
        print(f"{mode:>14}: process {result['median_process_s']:6.1f} s   LLM() {result['median_llm_s']:6.1f} s   "
              f"first answer {result['median_first_answer_s']:5.2f} s")
    print(f"warm compiled start - eager start: {results['warm_minus_eager_s']:+.1f} s; cold compile "
          f"{results['cold_compile_s']} s; warm starts loaded every graph: {results['warm_loaded_every_graph']}")
    print(f"wrote {write_results(results, 'startup')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
