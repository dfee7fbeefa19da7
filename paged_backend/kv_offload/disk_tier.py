"""DiskTier: KV blocks kept as files in a folder, one file per block and layer group, within a byte budget.

The folder is named by the model's fingerprint (fingerprint.py), under `PAGED_BACKEND_CACHE`/kv unless given,
so blocks outlive the process: after a restart a request sharing a stored prefix reads its blocks back instead of
computing them. Files are written by a background thread (the step only copies the block's rows off the pool) to a
temporary name and renamed into place, so a reader never sees half a file, a process killed mid-write leaves only a
temporary file (removed by a later start), and two processes sharing the folder write whole files or none.

Every file is checked before use (block_file.py): one that fails (truncated, flipped, written for another model or
version, another block under the name) is skipped and removed, and the first fault of each kind is logged once. A
full disk or a read-only folder stops nothing: writes that fail are dropped (said once), reads go on.

Over budget, the least recently used files go first (a hit touches its file), counted over the folder as it is
on disk, so processes sharing it keep to one budget between them.
"""

from __future__ import annotations

import atexit
import errno
import logging
import os
import queue
import threading
import time
import weakref
from pathlib import Path

import torch

from paged_backend.kv_offload.block_file import StoredKey, UntrustedBlock, decode, encode
from paged_backend.kv_offload.block_rows import BlockRows

logger = logging.getLogger(__name__)

MAX_PENDING_BYTES = 256 * 2**20  # rows waiting for the writer; beyond this, new blocks are not stored
STALE_TEMP_S = 600  # a temporary file this old belongs to a process that died mid-write
EVICT_TO = 0.9  # over budget, evict down to this fraction of it, so the folder is not rescanned at every write
_LIVE: weakref.WeakSet[DiskTier] = weakref.WeakSet()


class DiskTier:
    name = "disk"

    def __init__(self, folder: Path, budget_bytes: int, dtype: torch.dtype, shape: tuple[int, ...],
                 scale_shape: tuple[int, ...] | None) -> None:
        self.folder, self.budget = Path(folder), budget_bytes
        self.dtype, self.shape, self.scale_shape = dtype, shape, scale_shape
        self.warned: set[str] = set()
        self.writable = True
        self.saved = self.hits = self.failed = self.dropped = self.untrusted = 0
        self.pending_bytes = 0  # changed by the step's thread and the writer: under `pending_lock`
        self.pending_lock = threading.Lock()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self.writable = False
            self.warn("unwritable folder", f"{self.folder}: {exc}")
        self.known, self.nbytes = self.scan()
        self.queue: queue.Queue[tuple[StoredKey, BlockRows] | None] = queue.Queue()
        self.writer = threading.Thread(target=self.write_loop, name="kv-disk-writer", daemon=True)
        self.writer.start()
        _LIVE.add(self)

    # ------------------------------------------------------------------ reading

    def holds(self, key: StoredKey) -> bool:
        """Whether this process knows a file for `key`'s block (scanned at start, written or read since)."""
        return file_name(key) in self.known

    def load(self, key: StoredKey) -> BlockRows | None:
        """The block's rows if its file exists and passes every check; None otherwise (a faulty file removed)."""
        path = self.folder / file_name(key)
        try:
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(data)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self.warn("unreadable file", f"{path}: {exc}")
            return None
        try:
            rows, scales = decode(data, key, self.dtype, self.shape, self.scale_shape)
        except UntrustedBlock as exc:
            self.untrusted += 1
            self.warn(exc.kind, f"{path}: {exc.detail}")
            if exc.kind != "other block":  # a faulty file would fail every later read too
                self.remove(path)
            return None
        try:
            os.utime(path)  # the least recently used go first when the folder is over budget
        except OSError:
            pass
        self.known.add(path.name)
        self.hits += 1
        return BlockRows(rows, scales)

    # ------------------------------------------------------------------ writing

    def save(self, key: StoredKey, rows: BlockRows) -> None:
        """Queue the block for the writer thread (dropped when writes fail or the queue is too far behind)."""
        if not self.writable or rows.nbytes > self.budget:
            return
        with self.pending_lock:
            if self.pending_bytes + rows.nbytes > MAX_PENDING_BYTES:
                self.dropped += 1
                return
            self.pending_bytes += rows.nbytes
        self.known.add(file_name(key))  # so the block is not queued twice
        self.queue.put((key, rows))

    def write_loop(self) -> None:
        while (item := self.queue.get()) is not None:
            key, rows = item
            try:
                self.write(key, rows)
            except Exception as exc:  # the writer must outlive any one block
                self.failed += 1
                self.warn("write failed", f"{file_name(key)}: {exc}")
            finally:
                with self.pending_lock:
                    self.pending_bytes -= rows.nbytes
                self.queue.task_done()
        self.queue.task_done()

    def write(self, key: StoredKey, rows: BlockRows) -> None:
        """Write the block's file whole, replacing whatever has its name (the same block another process stored,
        or a file that fails the checks and would keep the block from being stored for ever)."""
        path = self.folder / file_name(key)
        rows.wait()
        temp = self.folder / f".{path.name}.{os.getpid()}.tmp"
        try:
            with open(temp, "wb") as f:
                for piece in encode(key, rows.rows, rows.scales):
                    f.write(piece)
            os.replace(temp, path)
        except OSError as exc:
            self.remove(temp)
            self.failed += 1
            self.known.discard(path.name)
            if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                self.writable = False
                self.warn("unwritable folder", f"{self.folder}: {exc}; blocks are no longer stored")
            else:
                self.warn("disk full" if exc.errno == errno.ENOSPC else "write failed",
                          f"{path}: {exc}; the block is not stored")
            return
        self.saved += 1
        self.nbytes += path.stat().st_size
        if self.nbytes > self.budget:
            self.evict()

    def evict(self) -> None:
        """Remove the least recently used files until the folder holds EVICT_TO of the budget."""
        files = sorted((stat.st_mtime, stat.st_size, name) for name, stat in self.entries() if name.endswith(".kv"))
        total = sum(size for _, size, _ in files)
        for _, size, name in files:
            if total <= self.budget * EVICT_TO:
                break
            self.remove(self.folder / name)
            self.known.discard(name)
            total -= size
        self.nbytes = total

    def flush(self) -> None:
        """Wait until every queued block is written (or has failed)."""
        self.queue.join()

    def close(self) -> None:
        self.flush()
        self.queue.put(None)
        self.writer.join()

    # ------------------------------------------------------------------ the folder

    def scan(self) -> tuple[set[str], int]:
        """The block files in the folder and their bytes; temporary files of dead writers removed."""
        known, total = set(), 0
        now = time.time()
        for name, stat in self.entries():
            if name.endswith(".kv"):
                known.add(name)
                total += stat.st_size
            elif name.endswith(".tmp") and now - stat.st_mtime > STALE_TEMP_S:
                self.remove(self.folder / name)
        return known, total

    def entries(self) -> list[tuple[str, os.stat_result]]:
        """The folder's files as they are on disk now, with their stats (a file gone meanwhile left out)."""
        found = []
        try:
            entries = list(os.scandir(self.folder))
        except OSError:
            return found
        for entry in entries:
            try:
                found.append((entry.name, entry.stat()))
            except OSError:
                continue
        return found

    def remove(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass

    def warn(self, kind: str, detail: str) -> None:
        """Log the first fault of each kind; later ones of that kind are only counted."""
        if kind not in self.warned:
            self.warned.add(kind)
            logger.warning("KV disk tier: %s (%s). Such blocks are skipped and computed instead; "
                           "this is said once.", kind, detail)

    def stats(self) -> dict[str, float]:
        return {"blocks": len(self.known), "bytes": self.nbytes, "budget_bytes": self.budget,
                "saved_blocks": self.saved, "dropped_blocks": self.dropped, "failed_writes": self.failed,
                "untrusted_files": self.untrusted}


def file_name(key: StoredKey) -> str:
    return f"{key.block_hash:032x}-{key.group}.kv"


@atexit.register
def flush_all() -> None:
    """Blocks still queued when the interpreter exits are written first (a kill loses them: they were never
    visible)."""
    for tier in list(_LIVE):
        tier.flush()
