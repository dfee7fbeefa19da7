"""Tensor parallel size 2 on CPU (gloo): the same greedy tokens as one process, through preemption."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers.engine import greedy, mixed_prompts
from helpers.models import build

from paged_backend import LLM
from paged_backend.parallel.launch import free_port

# Slow tier: compiles models or runs a whole client suite; `-m "not slow"` leaves it out (CI runs it).
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
ENGINE = dict(num_kv_blocks=20, block_size=4, max_num_batched_tokens=16)  # small: forces preemption


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp") / "llama"
    build("llama").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def single_tokens(tiny_path):
    llm = LLM(str(tiny_path), **ENGINE)
    return [o.outputs[0].token_ids for o in llm.generate(mixed_prompts(), greedy(12), use_tqdm=False)]


def test_spawned_workers_match_one_process(tiny_path, single_tokens, caplog):
    # compile=True: tensor parallelism runs eagerly (its collectives are inside the forward) and says so once.
    with caplog.at_level(logging.INFO, logger="paged_backend.engine"):
        llm = LLM(str(tiny_path), tensor_parallel_size=2, compile=True, **ENGINE)
    try:
        assert not llm.engine.runner.compiled
        assert sum("tensor parallelism runs eagerly" in r.message for r in caplog.records) == 1
        assert llm.engine.cache.kv.shape[2] == 1  # this rank holds 1 of the 2 KV heads
        outputs = llm.generate(mixed_prompts(), greedy(12), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == single_tokens
        assert llm.engine.scheduler.num_preemptions > 0
    finally:
        llm.close()
    assert all(not w.is_alive() for w in llm.tp_group.workers)


def test_draft_model_on_rank_zero_matches_one_process(tiny_path, single_tokens):
    """A draft model with tensor parallelism: whole on rank 0 (the target's own weights, unsharded, as its
    draft), its proposals verified by the sharded target; the tokens are those of one process."""
    spec = {"method": "draft_model", "model": str(tiny_path), "num_speculative_tokens": 3, "max_step_tokens": 512}
    llm = LLM(str(tiny_path), tensor_parallel_size=2, speculative_config=spec, **ENGINE)
    try:
        draft = llm.engine.speculator.draft
        assert draft.runner.cache.kv.shape[2] == 2 and draft.runner.publish is None  # whole, and rank 0's own
        outputs = llm.generate(mixed_prompts(), greedy(12), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == single_tokens
        stats = llm.engine.stats()
        assert stats["spec_num_draft_tokens"] > 0 and stats["spec_acceptance_rate"] > 0.9
        assert stats["num_preemptions"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    finally:
        llm.close()
    assert all(not w.is_alive() for w in llm.tp_group.workers)


def test_a_start_that_fails_after_the_group_formed_leaves_no_group_behind(tiny_path, single_tokens, tmp_path):
    """Rank 0 fails building its engine (its draft model is missing; the workers, which get no draft,
    have built theirs and wait for steps): the workers are stopped and the group left, so the next LLM
    in this process is an ordinary one-process engine, not a rank of the dead group."""
    before = set(multiprocessing.active_children())
    spec = {"method": "draft_model", "model": str(tmp_path / "missing"), "num_speculative_tokens": 2}
    with pytest.raises(Exception, match="missing"):
        LLM(str(tiny_path), tensor_parallel_size=2, speculative_config=spec, **ENGINE)
    assert not dist.is_initialized()
    assert set(multiprocessing.active_children()) <= before
    assert "WORLD_SIZE" not in os.environ
    llm = LLM(str(tiny_path), **ENGINE)
    assert llm.tp_group is None and llm.engine.cache.kv.shape[2] == 2
    outputs = llm.generate(mixed_prompts(), greedy(12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == single_tokens


def test_torchrun_launch_matches_one_process(tiny_path, single_tokens, tmp_path):
    script = tmp_path / "run.py"
    tests_dir = str(Path(__file__).resolve().parents[1])
    script.write_text("\n".join([
        "import json, sys",
        f"sys.path.insert(0, {tests_dir!r})",
        "from helpers.engine import greedy, mixed_prompts",
        "from paged_backend import LLM",
        # Padded decode steps: rank 0 pads before it broadcasts, so both ranks run the same shapes.
        f"llm = LLM({str(tiny_path)!r}, tensor_parallel_size=2, pad_decode=True, **{ENGINE!r})",
        "assert llm.engine.runner.padding is not None",
        "outputs = llm.generate(mixed_prompts(), greedy(12), use_tqdm=False)  # only rank 0 gets here",
        "print('TOKENS', json.dumps([o.outputs[0].token_ids for o in outputs]))",
        "print('PADDED_STEPS', llm.engine.runner.padding.num_padded_steps)",
        "llm.close()",
    ]))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script)],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("TOKENS")]
    assert len(lines) == 1, "exactly one process faces the user"
    assert json.loads(lines[0][len("TOKENS "):]) == single_tokens
    padded = [int(line.split()[1]) for line in run.stdout.splitlines() if line.startswith("PADDED_STEPS")]
    assert len(padded) == 1 and padded[0] > 0
