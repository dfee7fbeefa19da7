"""The OpenMP runtime that torch's CPU ops, the compiled graphs and the engine's C kernels share.

libgomp (torch's OpenMP on Linux) gives each thread that starts a parallel region a team of worker threads of
its own, kept for that thread's life. Idle workers spin a while before they sleep, so that the next region
starts at once, but only while the runtime manages no more threads than the process may use CPUs; past that,
they sleep at once and every region pays a wake-up. A decode step starts hundreds of regions (each int4
projection, each compiled kernel), so the team left behind by the thread that loaded and warmed up the model
slowed every step of an engine stepped by another thread: on 2 cores, a decode step of the default model took
17.2 ms on AsyncEngine's thread against 11.9 ms on the loading thread (1.45x), until that team was released.
"""

from __future__ import annotations

import ctypes
import os

OMP_PAUSE_HARD = 2  # omp_pause_resource_t: free what the runtime holds for the calling thread, its team


def release_thread_team() -> bool:
    """Free the calling thread's OpenMP team (its workers exit), so that the thread that steps the engine has
    the CPUs to itself. Whether the runtime released it: False where torch uses another OpenMP runtime or none
    is loaded. A later parallel region on this thread builds a new team."""
    runtime = loaded_libgomp()
    return runtime is not None and runtime.omp_pause_resource_all(OMP_PAUSE_HARD) == 0


def loaded_libgomp() -> ctypes.CDLL | None:
    """The libgomp already in the process (torch's), never a second copy loaded here."""
    try:
        runtime = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except (OSError, AttributeError):  # not loaded; or no RTLD_NOLOAD (not a POSIX dlopen)
        return None
    return runtime if hasattr(runtime, "omp_pause_resource_all") else None
