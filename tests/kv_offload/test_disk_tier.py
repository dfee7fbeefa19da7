"""The disk tier: blocks written whole and read back checked, within a budget, and no fault stops the engine."""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch

from paged_backend.kv_offload import disk_tier
from paged_backend.kv_offload.block_file import StoredKey
from paged_backend.kv_offload.block_rows import BlockRows
from paged_backend.kv_offload.disk_tier import DiskTier, file_name

SHAPE = (2, 2, 2, 4, 8)
FINGERPRINT = "a" * 32


def key(n: int) -> StoredKey:
    return StoredKey(FINGERPRINT, 0, 1000 + n, None, (n, n + 1, n + 2, n + 3), None)


def rows(n: int) -> BlockRows:
    return BlockRows(torch.full(SHAPE, float(n), dtype=torch.bfloat16), None)


def tier(folder: Path, budget: int = 10**6) -> DiskTier:
    return DiskTier(folder, budget, torch.bfloat16, SHAPE, None)


def file_bytes(folder: Path) -> int:
    return next(p.stat().st_size for p in folder.glob("*.kv"))


def test_a_saved_block_is_read_back_by_another_tier_on_the_folder(tmp_path: Path) -> None:
    first = tier(tmp_path)
    first.save(key(1), rows(1))
    first.close()
    second = tier(tmp_path)  # a restarted process
    assert second.holds(key(1))
    got = second.load(key(1))
    assert got is not None and torch.equal(got.rows, rows(1).rows)
    assert second.load(key(2)) is None
    assert second.stats()["blocks"] == 1 and second.hits == 1


def test_the_least_recently_used_files_go_first_over_budget(tmp_path: Path) -> None:
    probe = tier(tmp_path / "probe")
    probe.save(key(0), rows(0))
    probe.flush()
    size = file_bytes(tmp_path / "probe")
    store = tier(tmp_path / "kv", budget=3 * size)
    for n in (1, 2, 3):
        store.save(key(n), rows(n))
        store.flush()
        time.sleep(0.02)  # distinct modification times
    assert store.load(key(1)) is not None  # touched: now the most recently used
    time.sleep(0.02)
    store.save(key(4), rows(4))
    store.flush()
    left = {p.name for p in (tmp_path / "kv").glob("*.kv")}
    assert file_name(key(2)) not in left and file_name(key(1)) in left and file_name(key(4)) in left
    assert store.nbytes <= 3 * size


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_a_damaged_file_is_skipped_removed_and_reported_once(tmp_path: Path, caplog, damage: str) -> None:
    store = tier(tmp_path)
    for n in (1, 2):
        store.save(key(n), rows(n))
    store.flush()
    for n in (1, 2):
        path = tmp_path / file_name(key(n))
        data = bytearray(path.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 1
        elif damage == "truncate":
            data = data[: len(data) // 2]
        else:
            data = bytearray(b"not a block" * 10)
        path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger=disk_tier.__name__):
        assert store.load(key(1)) is None
        assert store.load(key(2)) is None
    assert len(caplog.records) == 1  # once per kind of fault
    assert not list(tmp_path.glob("*.kv")) and store.untrusted == 2


def test_a_file_renamed_to_another_blocks_name_is_not_served(tmp_path: Path) -> None:
    store = tier(tmp_path)
    store.save(key(1), rows(1))
    store.flush()
    os.replace(tmp_path / file_name(key(1)), tmp_path / file_name(key(2)))
    assert store.load(key(2)) is None


def test_a_writer_killed_mid_write_leaves_nothing_readable(tmp_path: Path) -> None:
    """Writes go to a temporary name first: what a killed writer leaves is never read, and a later start clears
    what is old enough to be a dead writer's."""
    store = tier(tmp_path)
    store.save(key(1), rows(1))
    store.flush()
    whole = (tmp_path / file_name(key(1))).read_bytes()
    half = tmp_path / f".{file_name(key(2))}.4242.tmp"
    half.write_bytes(whole[: len(whole) // 2])
    old = time.time() - disk_tier.STALE_TEMP_S - 1
    os.utime(half, (old, old))
    restarted = tier(tmp_path)
    assert restarted.load(key(2)) is None
    assert not half.exists() and restarted.stats()["blocks"] == 1


class FailingFile:
    def __init__(self, code: int) -> None:
        self.code = code

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def write(self, data) -> int:
        raise OSError(self.code, os.strerror(self.code))


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_failed_writes_are_dropped_said_once_and_leave_no_file(tmp_path: Path, monkeypatch, caplog,
                                                               code: int) -> None:
    store = tier(tmp_path)
    monkeypatch.setattr(disk_tier, "open", lambda path, mode="r": FailingFile(code) if "w" in mode else open(
        path, mode), raising=False)
    with caplog.at_level(logging.WARNING, logger=disk_tier.__name__):
        for n in (1, 2, 3):
            store.save(key(n), rows(n))
        store.flush()
    assert list(tmp_path.iterdir()) == []
    assert len(caplog.records) == 1
    assert ("disk full" if code == errno.ENOSPC else "unwritable") in caplog.records[0].getMessage()
    assert store.writable == (code == errno.ENOSPC)  # a read-only folder stops further writes
    monkeypatch.undo()
    store.save(key(4), rows(4))
    store.flush()
    assert (tmp_path / file_name(key(4))).exists() == (code == errno.ENOSPC)


def test_a_folder_that_cannot_be_made_reads_nothing_and_stores_nothing(tmp_path: Path, caplog) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger=disk_tier.__name__):
        store = tier(blocker / "kv")
    assert not store.writable and "unwritable folder" in caplog.text
    store.save(key(1), rows(1))
    store.flush()
    assert store.load(key(1)) is None


def write_blocks(folder: str, first: int) -> None:
    store = tier(Path(folder))
    for n in range(first, first + 40):
        store.save(key(n % 50), rows(n % 50))
    store.close()


def test_two_processes_share_a_folder(tmp_path: Path) -> None:
    """Both write overlapping blocks at once: every file left is whole and reads back as its block."""
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=write_blocks, args=(str(tmp_path), first)) for first in (0, 10)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    reader = tier(tmp_path)
    assert reader.stats()["blocks"] == 50
    for n in range(50):
        got = reader.load(key(n))
        assert got is not None and torch.equal(got.rows, rows(n).rows)
    assert not list(tmp_path.glob(".*.tmp"))
