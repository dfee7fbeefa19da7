"""The engine with a second KV tier: blocks read back instead of computed after a restart, after the pool evicted them
and after a preemption, with the tokens of a run without the tier; nothing it cannot trust is ever used."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from paged_backend import Engine, EngineConfig
from paged_backend.kv_offload import disk_tier
from helpers.engine import assert_all_blocks_free, greedy, hf_greedy, one_thread, run_to_completion  # noqa: F401
from helpers.models import build

MAX_NEW = 6
DISK = 10**8


def prompts(n: int = 3, length: int = 70, shared: int = 48, seed: int = 0) -> list[list[int]]:
    """`n` prompts sharing their first `shared` tokens (a system prompt), each `length` tokens long."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(1, 256, (shared,), generator=g).tolist()
    return [head + torch.randint(1, 256, (length - shared,), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def llama_refs():
    model = build("llama")
    return {tuple(p): hf_greedy(model, p, MAX_NEW) for p in prompts() + prompts(seed=1)}


def config(folder: Path | None = None, **kwargs) -> EngineConfig:
    tier = {"kv_offload_disk_bytes": DISK, "kv_offload_dir": str(folder)} if folder is not None else {}
    return EngineConfig(dtype=torch.float32, compile=False, **{**tier, **kwargs})


def run(engine: Engine, batch: list[list[int]], **params) -> list:
    ids = [engine.add_request(p, greedy(MAX_NEW), **params) for p in batch]
    finals = run_to_completion(engine)
    assert_all_blocks_free(engine)
    return [finals[i] for i in ids]


def tokens(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def first_engine(folder: Path, arch: str = "llama", seed: int = 0, **kwargs) -> Engine:
    """An engine that computed prompts() and stored their blocks, then was stopped."""
    engine = Engine(build(arch, seed), None, config(folder, **kwargs))
    run(engine, prompts())
    engine.flush_offload()
    return engine


def test_after_a_restart_the_stored_prefix_is_read_back(tmp_path: Path, llama_refs) -> None:
    first_engine(tmp_path)
    restarted = Engine(build("llama"), None, config(tmp_path))  # the same weights, loaded anew
    outputs = run(restarted, prompts())
    assert tokens(outputs) == [llama_refs[tuple(p)] for p in prompts()]
    assert [o.num_cached_tokens for o in outputs] == [64, 64, 64]  # every full block before the last token
    stats = restarted.stats()
    assert stats["kv_offload_disk_hit_blocks"] == 4 + 1 + 1  # the shared head once, then each tail
    assert stats["num_computed_tokens"] == 3 * (70 - 64) + 3 * (MAX_NEW - 1)


def test_another_model_or_salt_reads_nothing_back(tmp_path: Path, llama_refs) -> None:
    first_engine(tmp_path)
    other = Engine(build("llama", seed=1), None, config(tmp_path))  # other weights: another fingerprint
    run(other, prompts())
    assert other.stats()["kv_offload_disk_hit_blocks"] == 0
    salted = Engine(build("llama"), None, config(tmp_path))
    outputs = run(salted, prompts()[:1], cache_salt="tenant")
    assert outputs[0].num_cached_tokens == 0 and tokens(outputs) == [llama_refs[tuple(prompts()[0])]]


def test_blocks_the_pool_evicted_come_back_from_host_memory(llama_refs) -> None:
    engine = Engine(build("llama"), None, config(num_kv_blocks=12, kv_offload_host_bytes=DISK))
    first, others = prompts()[0], prompts(seed=1)
    run(engine, [first])
    for prompt in others:  # each fills most of the pool: the first prompt's blocks are evicted
        run(engine, [prompt])
    outputs = run(engine, [first])
    assert tokens(outputs) == [llama_refs[tuple(first)]]
    assert outputs[0].num_cached_tokens == 64 and engine.stats()["kv_offload_host_hit_blocks"] == 4


def preempting(mode: str) -> tuple[list[list[int]], dict]:
    """Eight requests in a pool that holds about two of them: preemptions, and the pool evicts the preempted
    requests' blocks before they resume."""
    model = build("llama")
    engine = Engine(model, None, config(num_kv_blocks=16, kv_offload_host_bytes=DISK, preemption_mode=mode,
                                        max_num_batched_tokens=64))
    batch = prompts(8, length=70, shared=0, seed=2)
    ids = [engine.add_request(p, greedy(40)) for p in batch]
    finals = run_to_completion(engine)
    assert_all_blocks_free(engine)
    return [finals[i].outputs[0].token_ids for i in ids], engine.stats()


def test_swap_reads_a_preempted_requests_blocks_back_instead_of_recomputing() -> None:
    swapped, swap_stats = preempting("swap")
    recomputed, recompute_stats = preempting("recompute")
    auto, auto_stats = preempting("auto")  # a pool on a CPU: swap
    assert swapped == recomputed == auto
    assert auto_stats["kv_offload_swapped_in_blocks"] == swap_stats["kv_offload_swapped_in_blocks"]
    model = build("llama")
    assert swapped == [hf_greedy(model, p, 40) for p in prompts(8, length=70, shared=0, seed=2)]
    assert swap_stats["num_preemptions"] > 0 and recompute_stats["num_preemptions"] > 0
    assert swap_stats["kv_offload_swapped_in_blocks"] > 0 and recompute_stats["kv_offload_swapped_in_blocks"] == 0
    assert swap_stats["num_computed_tokens"] < recompute_stats["num_computed_tokens"]


def test_a_changed_model_neither_stores_nor_reads(tmp_path: Path, llama_refs) -> None:
    """After an in-place weight change (a training step) the fingerprint no longer describes the model: its blocks
    stay in the pool only."""
    model = build("llama")
    engine = Engine(model, None, config(tmp_path))
    with torch.no_grad():
        model.lm_head.weight.mul_(1.0)  # same values, a new version: the engine cannot tell it is harmless
    run(engine, prompts())
    engine.flush_offload()
    assert engine.stats()["kv_offload_disk_saved_blocks"] == 0
    assert not list(tmp_path.rglob("*.kv"))


def test_a_damaged_file_ends_the_hit_before_it(tmp_path: Path, llama_refs, caplog) -> None:
    first_engine(tmp_path)
    restarted = Engine(build("llama"), None, config(tmp_path))
    folder = next(tmp_path.iterdir())
    stored = sorted(folder.glob("*.kv"), key=lambda p: p.stat().st_mtime_ns)
    damaged = stored[2]  # the third block of the shared head, written third
    data = bytearray(damaged.read_bytes())
    data[-10] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger=disk_tier.__name__):
        outputs = run(restarted, prompts()[:1])
    assert tokens(outputs) == [llama_refs[tuple(prompts()[0])]]
    assert outputs[0].num_cached_tokens == 32 and "corrupt file" in caplog.text
    assert not damaged.exists()


def test_int8_kv_blocks_come_back_with_their_scales(tmp_path: Path) -> None:
    plain = run(Engine(build("llama"), None, config(kv_cache_dtype="int8")), prompts())
    first_engine(tmp_path, kv_cache_dtype="int8")
    restarted = Engine(build("llama"), None, config(tmp_path, kv_cache_dtype="int8"))
    outputs = run(restarted, prompts())
    assert tokens(outputs) == tokens(plain) and outputs[0].num_cached_tokens == 64
    assert Engine(build("llama"), None, config(tmp_path)).stats()["kv_offload_disk_blocks"] == 0  # not fp32's


def test_window_layers_read_back_what_their_window_needs(tmp_path: Path) -> None:
    """Gemma 3: a sliding group (window 8) and a full group, each block of each stored; after a restart the hit takes
    the full group's every block and the window group's last ones."""
    model = build("gemma3_text")
    refs = [hf_greedy(model, p, MAX_NEW) for p in prompts()]
    first_engine(tmp_path, "gemma3_text")
    restarted = Engine(build("gemma3_text"), None, config(tmp_path))
    assert restarted.kv.groups.frees_blocks
    outputs = run(restarted, prompts())
    assert tokens(outputs) == refs and [o.num_cached_tokens for o in outputs] == [64, 64, 64]


def test_latent_attention_rows_come_back(tmp_path: Path) -> None:
    """DeepSeek V3's one latent row per token and layer (the pages' one plane) is stored and read back whole."""
    plain = run(Engine(build("deepseek_v3"), None, config()), prompts())
    first_engine(tmp_path, "deepseek_v3")
    restarted = Engine(build("deepseek_v3"), None, config(tmp_path))
    assert restarted.cache.kv.shape[1] == 1
    outputs = run(restarted, prompts())
    assert tokens(outputs) == tokens(plain) and outputs[0].num_cached_tokens == 64


def test_another_models_files_in_the_folder_are_skipped(tmp_path: Path, llama_refs, caplog) -> None:
    """Files copied in from another model's folder have our blocks' names (a name is the block's hash, the same for
    the same tokens) but its fingerprint: each is skipped and removed, the fault said once, nothing served."""
    first_engine(tmp_path / "other", seed=1)
    restarted = Engine(build("llama"), None, config(tmp_path / "ours"))
    ours = tmp_path / "ours" / restarted.kv.offload.fingerprint
    copied = list((tmp_path / "other").rglob("*.kv"))
    for path in copied:
        (ours / path.name).write_bytes(path.read_bytes())
    with caplog.at_level(logging.WARNING, logger=disk_tier.__name__):
        outputs = run(restarted, prompts())
    assert tokens(outputs) == [llama_refs[tuple(p)] for p in prompts()]
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 0]
    assert caplog.text.count("foreign file") == 1 and restarted.stats()["kv_offload_disk_untrusted_files"] >= 1
    restarted.flush_offload()
    assert all(restarted.kv.offload.fingerprint in (ours / path.name).read_bytes().decode("latin-1")
               for path in copied if (ours / path.name).exists())  # what is there now is our own blocks


@pytest.mark.parametrize("case", ["no prefix caching", "recurrent", "draft"])
def test_what_the_tier_cannot_carry_is_refused_by_name(tmp_path: Path, case: str) -> None:
    extra, arch, match = {}, "llama", "enable_prefix_caching"
    if case == "no prefix caching":
        extra = {"enable_prefix_caching": False}
    elif case == "recurrent":
        arch, match = "lfm2", "recurrent layers"
    else:
        extra = {"speculative_config": {"method": "draft_model", "model": build("llama", seed=3),
                                        "num_speculative_tokens": 2}}
        match = "draft model"
    with pytest.raises(ValueError, match=match):
        Engine(build(arch), None, config(tmp_path, **extra))


def test_swap_without_a_tier_is_refused() -> None:
    with pytest.raises(ValueError, match="needs a second tier"):
        EngineConfig(preemption_mode="swap")
