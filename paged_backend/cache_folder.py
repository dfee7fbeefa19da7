"""Where the package keeps what it builds once per machine (the converted default model, compiled graphs and
kernels), and what of the machine decides whether a built kernel runs on it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Return the root cache folder (``$PAGED_BACKEND_CACHE``, else the XDG cache)."""
    override = os.environ.get("PAGED_BACKEND_CACHE")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "paged-backend"


def cpu_flags() -> list[str]:
    """The CPU's vector instruction sets (Linux's /proc/cpuinfo; empty elsewhere): code generated for this
    machine's instructions runs only where they are the same."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return sorted(flag for flag in line.split() if flag.startswith(("avx", "amx", "fma", "f16c", "sse4")))
