"""Helpers shared by the benchmark scripts: prompts, seeded workloads, peak memory, timing, results.

Benchmarks run as scripts (`python benchmarks/<name>.py`), so this module is imported as `common`
with the benchmarks folder on `sys.path`.
"""

from __future__ import annotations

import json
import os
import random
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Self

DATA_ENV = "PAGED_BACKEND_DATA"
MT_BENCH_FILE = "mt_bench_questions.jsonl"
BENCHMARKS_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCHMARKS_DIR / "results"
# The repository carries the prompts its benchmarks, tests and examples read.
DATA_DIR = BENCHMARKS_DIR / "data"

MiB = 2**20


# ------------------------------------------------------------------ prompts and workloads


def precision_name(model) -> str:
    """The engine's weights and activations, as the results name them."""
    from paged_backend.model.quantized.int4_linear import has_int4_layers

    dtype = str(model.dtype).removeprefix("torch.")
    return f"int4 weights, {dtype} activations" if has_int4_layers(model) else dtype


def mt_bench_path() -> Path:
    """Where the MT-bench questions are: `$PAGED_BACKEND_DATA` (the file or its folder), else `benchmarks/data`."""
    override = os.environ.get(DATA_ENV)
    path = Path(override).expanduser() if override else DATA_DIR
    if path.is_dir():
        path = path / MT_BENCH_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"MT-bench questions not found at {path}; set ${DATA_ENV} to the {MT_BENCH_FILE} file or its folder"
        )
    return path


def load_mt_bench_prompts(num_prompts: int, turn: int = 0, path: Path | None = None) -> list[str]:
    """The `turn`-th user message of the first `num_prompts` MT-bench questions, in file order."""
    path = path or mt_bench_path()
    with path.open(encoding="utf-8") as f:
        questions = [json.loads(line) for line in f if line.strip()]
    if not 1 <= num_prompts <= len(questions):
        raise ValueError(f"num_prompts={num_prompts}: {path} holds {len(questions)} questions")
    return [q["turns"][turn] for q in questions[:num_prompts]]


def draw_max_tokens(num_requests: int, low: int, high: int, seed: int) -> list[int]:
    """Per-request output lengths, uniform in [low, high], the same for every run with this seed."""
    if not 1 <= low <= high:
        raise ValueError(f"max_tokens range {low}..{high} must satisfy 1 <= low <= high")
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(num_requests)]


@dataclass(slots=True)
class Workload:
    """Prompt token ids and each request's output length; every system runs exactly this."""

    prompt_token_ids: list[list[int]]
    max_tokens: list[int]
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if len(self.prompt_token_ids) != len(self.max_tokens):
            raise ValueError(f"{len(self.prompt_token_ids)} prompts but {len(self.max_tokens)} max_tokens")

    @property
    def num_requests(self) -> int:
        return len(self.max_tokens)

    @property
    def useful_tokens(self) -> int:
        return sum(self.max_tokens)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> Workload:
        return cls(**json.loads(path.read_text()))


def chat_workload(tokenizer: Any, prompts: Sequence[str], max_tokens: Sequence[int]) -> Workload:
    """Render each prompt as a one-turn chat (with the generation prompt) into token ids."""
    ids = [
        list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False))
        for p in prompts
    ]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return Workload(ids, list(max_tokens), pad if pad is not None else 0)


# ------------------------------------------------------------------ memory


def read_status_kib(field: str) -> int | None:
    """A `/proc/self/status` value in KiB (Linux only), or None where there is no such file."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def current_rss_bytes() -> int:
    kib = read_status_kib("VmRSS")
    return kib * 1024 if kib is not None else peak_rss_bytes()


def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark since it started (the kernel's own exact peak)."""
    kib = read_status_kib("VmHWM")
    if kib is None:  # macOS reports ru_maxrss in bytes, Linux in KiB
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // (1024 if sys.platform == "darwin" else 1)
    return kib * 1024


class RSSSampler:
    """Samples this process's RSS on a background thread; `peak_bytes` is the largest value seen.

    Unlike the process high-water mark it covers only the `with` block, so one process can tell
    apart the peaks of its phases (loading, running)."""

    def __init__(self, interval_s: float = 0.01) -> None:
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self.peak_bytes = current_rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, current_rss_bytes())

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_bytes = max(self.peak_bytes, current_rss_bytes())


class RunMeter(RSSSampler):
    """Measures one timed run: wall and CPU seconds, peak RSS, and the machine's load before and after.

    On a shared machine, CPU seconds and load averages tell a slow neighbour from a slow system."""

    def __enter__(self) -> Self:
        self.load_start = load_average()
        self.start_epoch = time.time()
        self.cpu_start = time.process_time()  # all threads of this process
        self.start = time.perf_counter()
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self.start
        self.cpu_s = time.process_time() - self.cpu_start
        self.load_end = load_average()
        super().__exit__(*exc)

    def summary(self) -> dict[str, float | None]:
        return {"wall_s": self.wall_s, "cpu_s": self.cpu_s, "run_peak_rss_mb": self.peak_bytes / 1e6,
                "load_1m_start": self.load_start, "load_1m_end": self.load_end}


def load_average() -> float | None:
    """The 1-minute load average, or None where the platform has none."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


# ------------------------------------------------------------------ timing


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of no values")
    return statistics.median(values)


def alternate(runs: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Each run's figure, `repeats` times, the order flipped every round (A/B comparisons in one process)."""
    figures: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(repeats):
        for name in (list(runs) if round_ % 2 == 0 else list(runs)[::-1]):
            figures[name].append(runs[name]())
    return figures


def workload_runs(contexts: dict[str, Callable[[], AbstractContextManager]]
                  ) -> tuple[dict[str, Callable[[], float]], dict[str, list[list[int]]], int]:
    """For an A/B in one process: the default engine (`LLM()`) on the throughput workload (throughput.py's 32
    chats), one run per named context it runs inside. Each run computes every prompt again and returns
    tokens/s; each context's last answers land in the returned dict. Also returns the number of prompts."""
    from throughput import FULL_WORKLOAD, default_workload

    from paged_backend import LLM, SamplingParams
    from paged_backend.model.loading.default_model import default_model_path

    llm = LLM(None)
    workload = default_workload(**FULL_WORKLOAD, model_source=str(default_model_path()))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.max_tokens]
    answers: dict[str, list[list[int]]] = {}

    def timed(name: str) -> Callable[[], float]:
        def run() -> float:
            with contexts[name]():
                llm.reset_prefix_cache()
                start = time.perf_counter()
                outs = llm.generate(workload.prompt_token_ids, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
            answers[name] = [list(o.outputs[0].token_ids) for o in outs]
            return sum(len(tokens) for tokens in answers[name]) / elapsed
        return run

    return {name: timed(name) for name in contexts}, answers, len(params)


def time_median(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> float:
    """Median wall time of `fn()` over `repeats` calls after `warmup` untimed calls; medians resist noisy neighbours."""
    return time_medians(fn, repeats, warmup)[0]


def time_medians(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> tuple[float, float]:
    """Median wall and median process-CPU seconds of `fn()`, from the same `repeats` calls."""
    for _ in range(warmup):
        fn()
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return median(walls), median(cpus)


# ------------------------------------------------------------------ processes and results


def run_json_subprocess(args: Sequence[str], out_path: Path, timeout_s: float | None = None) -> dict[str, Any]:
    """Run `python <args>` in a fresh process that writes a JSON object to `out_path`; return that object.

    A fresh process per measured system keeps peak-memory readings and allocator state separate."""
    out_path.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, *args], check=False, timeout=timeout_s)
    if proc.returncode != 0 or not out_path.is_file():
        raise RuntimeError(f"benchmark worker {' '.join(args)} failed with exit code {proc.returncode}")
    return json.loads(out_path.read_text())


def write_results(payload: dict[str, Any], name: str, path: Path | None = None) -> Path:
    """Write `payload` with its provenance as JSON to `path`, or to the benchmark's current file for this
    machine class, benchmarks/results/<name>_<machine class>.json; return where it went.

    Every benchmark writes its results through here, so every results file says what made it."""
    path = Path(path) if path is not None else current_results_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = dict(payload)
    record["provenance"] = provenance()
    path.write_text(json.dumps(record, indent=2, sort_keys=False, default=str) + "\n")
    return path


def current_results_path(name: str) -> Path:
    """The one current results file of benchmark `name` on this machine's class."""
    return RESULTS_DIR / f"{name}_{machine_class()}.json"


# ------------------------------------------------------------------ provenance

# The load when this module was imported, i.e. when the benchmark started: with the load at write time,
# it tells a run on a quiet machine from one that shared the CPUs with other jobs.
LOAD_AT_START = os.getloadavg() if hasattr(os, "getloadavg") else None
STARTED_UTC = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
# The CPU features that decide which kernels and dtypes the engine uses (precision.py, int4_linear.py).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def provenance(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """What a results file needs beside its figures to be read and rerun: the command, the code, the
    machine and its load, the library versions and the date."""
    import torch
    import transformers

    flags = cpu_flags()
    return {
        "provenance": "recorded at the run by benchmarks/common.py",
        "command": command_line(argv),
        "git_commit": git_output("rev-parse", "HEAD"),
        "git_dirty": git_dirty(),
        "machine_class": machine_class(flags),
        "cpu_model": cpu_model(),
        "cpu_flags": {flag: flag in flags for flag in CPU_FLAGS} if flags is not None else None,
        "cpu_count": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "load_average_before": list(LOAD_AT_START) if LOAD_AT_START is not None else None,
        "load_average_after": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "started_utc": STARTED_UTC,
        "written_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as typed from the repository root: `python benchmarks/<script>.py <arguments>`."""
    import shlex

    args = list(sys.argv if argv is None else argv)
    script = Path(args[0]) if args else Path("?")
    try:
        script = script.resolve().relative_to(BENCHMARKS_DIR.parent)
    except ValueError:
        pass
    return shlex.join(["python", str(script), *args[1:]])


def git_output(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(BENCHMARKS_DIR), *args], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def git_dirty() -> bool | None:
    """Whether tracked files differ from the commit (results files aside: a run writes those itself)."""
    status = git_output("status", "--porcelain", "--untracked-files=no", "--", ":/", ":(exclude,top)benchmarks/results")
    return None if status is None else bool(status)


def cpu_info_lines() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def cpu_model() -> str | None:
    for line in cpu_info_lines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    import platform

    return platform.processor() or None


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags (Linux's /proc/cpuinfo), or None where they cannot be read."""
    for line in cpu_info_lines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return None


def machine_class(flags: set[str] | None = None) -> str:
    """The class of machine results are filed under: the GPU's model (`h200`) where CUDA runs, else the
    widest x86 vector extension the CPU has (`avx512`, `avx2`), else `cpu`. Results of one class compare."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0).split()[-1].lower()
    flags = cpu_flags() if flags is None else flags
    if flags and "avx512f" in flags:
        return "avx512"
    if flags and "avx2" in flags:
        return "avx2"
    return "cpu"


def uptime() -> str | None:
    """`uptime`'s line (load averages over 1, 5 and 15 minutes), or None where there is no such command."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def machine_info() -> dict[str, Any]:
    """What else was happening on the machine: results from a shared machine need this beside them."""
    import torch

    return {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1m": load_average(),
        "uptime": uptime(),
        "torch": torch.__version__,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
