"""What a model runner gets at start-up beyond its eager forward, as the engine's start-up plan says: padded decode
steps, the compiled forward (checked against the eager one when the engine self-checks) and CUDA graphs of the
padded decode steps, in that order (a graph captures the compiled forward). Each that fails is logged and left
out: the engine still runs, eagerly or uncaptured."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from paged_backend.model import batch_invariant
from paged_backend.model.compiled import cuda_graphs
from paged_backend.model.compiled.decode_padding import DecodePadding
from paged_backend.model.compiled.fast_path_check import FastPathCheck, check_compiled
from paged_backend.model.model_runner import ModelRunner

if TYPE_CHECKING:  # the plan's module sits above model/ (it reads the model to plan)
    from paged_backend.config import EngineConfig
    from paged_backend.startup_plan import StartupPlan

logger = logging.getLogger(__name__)


@dataclass
class RunnerStart:
    """How the runner's fast paths came to be."""

    compile_s: float | None = None  # seconds the compile (or the load from the compile cache) and warm-up took
    graphs_loaded: bool | None = None  # whether the graphs came from the compile cache; None: not compiled
    fast_path_check: FastPathCheck | None = None  # the compiled forward against the eager one, when self-checked
    capture_s: float | None = None  # seconds the CUDA graph capture took; None: not captured

    def stats(self) -> dict[str, float]:
        """`Engine.stats()` entries: the compiled forward's start-up seconds, whether its graphs were loaded (1) or
        compiled (0), and the check's figures; nothing when eager."""
        stats = self.fast_path_check.stats() if self.fast_path_check else {}
        if self.graphs_loaded is not None:
            stats |= {"startup_compile_seconds": self.compile_s, "startup_graphs_loaded": float(self.graphs_loaded)}
        return stats


def start_runner(runner: ModelRunner, plan: StartupPlan, config: EngineConfig) -> RunnerStart:
    """Give `runner` the padding, compiled forward and graphs `plan` asks for; say how it went."""
    start = RunnerStart()
    if plan.batch_invariant:
        make_batch_invariant(runner)
    if plan.pad:
        runner.padding = make_padding(plan, config, runner.cache.shape.num_kv_heads)
    if plan.compile and compile_forward(runner, start) and config.self_check:
        start.fast_path_check = check_fast_path(runner)
    if plan.capture:
        capture_graphs(runner, start, config.cuda_graph_sizes)
    return start


def make_batch_invariant(runner: ModelRunner) -> None:
    """Batch-invariant steps, padded to the fewest rows this CPU's matmuls need (ValueError when none serves)."""
    min_rows = batch_invariant.choose_min_rows(runner.model)
    if min_rows is None:
        raise ValueError("EngineConfig.batch_invariant=True: this CPU's matmul kernel sums a row differently with the "
                         f"number of rows at every padding tried {batch_invariant.MIN_ROWS_TRIED}")
    runner.make_batch_invariant(min_rows)
    logger.info("batch-invariant steps: linears padded to %d rows, every query row through the CPU attention kernel",
                min_rows)


def make_padding(plan: StartupPlan, config: EngineConfig, num_kv_heads: int) -> DecodePadding:
    """Padding to the configured sizes; its padding rows write to the page past the pool's (plan.cache_pages)."""
    sizes = config.cuda_graph_sizes
    segments = (cuda_graphs.segments_per_size(sizes, num_kv_heads, plan.max_model_len, plan.device)
                if plan.capture else None)
    return DecodePadding(sizes, -(-plan.max_model_len // config.block_size), plan.num_blocks, config.block_size,
                         plan.device, segments)


def compile_forward(runner: ModelRunner, start: RunnerStart) -> bool:
    """Compile the runner's forward (or load its graphs); whether it now runs compiled."""
    if runner.lora_slots is not None:  # the graph holds every hook an adapter may need (model/lora/slots.py)
        hooked = runner.lora_slots.hook_adaptable_linears()
        logger.info("compile: LoRA hooks on all %d adaptable linears", hooked)
    try:
        report = runner.compile()
    except Exception as exc:  # noqa: BLE001  (the engine still runs, eagerly)
        logger.warning("compile: the model forward failed to compile (%s: %s); it runs eagerly",
                       type(exc).__name__, next(iter(str(exc).strip().splitlines()), ""))
        return False
    start.compile_s, start.graphs_loaded = report.seconds, report.loaded
    source = "loaded from the compile cache" if report.loaded else "compiled"
    logger.info("compile: the model forward %s (%d graphs, %s) and warmed up in %.1f s", source,
                len(report.forward.graphs), report.folder, report.seconds)
    return True


def check_fast_path(runner: ModelRunner) -> FastPathCheck:
    """Run the start-up probe through the compiled forward and the eager one (fast_path_check.py); a compiled
    forward whose distributions leave the bound is dropped, and the runner says so."""
    check = check_compiled(runner)
    if check.passed:
        logger.info("compile: the compiled forward matches the eager one on the start-up probe (largest KL "
                    "divergence %.3g, bound %.3g, %.2f s)", check.worst, check.allowed, check.seconds)
        return check
    logger.warning("compile: the compiled forward's next-token distributions differ from the eager forward's by "
                   "a KL divergence of %.4g (bound %.4g) on the start-up probe, so the engine runs eagerly",
                   check.worst, check.allowed)
    runner.drop_compiled()
    return check


def capture_graphs(runner: ModelRunner, start: RunnerStart, sizes: list[int]) -> None:
    """Capture the padded decode step of every size in a CUDA graph; a failed capture is logged and the runner
    replays none."""
    graphs = cuda_graphs.DecodeGraphs(runner.padding, runner.run_in_context)
    try:
        start.capture_s = graphs.capture()
    except Exception as exc:  # noqa: BLE001  (the engine still runs, uncaptured)
        logger.warning("CUDA graph capture failed (%s: %s); decode steps run uncaptured", type(exc).__name__, exc)
        return
    runner.graphs = graphs
    logger.info("captured CUDA graphs of decode steps for batch sizes %s in %.1f s", sizes, start.capture_s)
