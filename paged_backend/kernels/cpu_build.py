"""Building the engine's CPU kernels: C sources compiled on the user's machine, once, and kept.

A kernel's source (`cpu_*.c` beside this file) is compiled with the machine's C compiler (`$CC`, else `cc`)
for the machine's own instructions (`-march=native`, OpenMP from torch's runtime). A torch op's C++ kernel
(`cpu_*_op.cpp`: an op the dispatcher calls without entering Python) is compiled with the C++ compiler
(`$CXX`, else `c++`) against torch's own headers and libraries (`load_op`). The library is kept under the
cache folder (`kernels/<source name>-<key>.so`), keyed by the source, the compiler, the CPU's instruction sets
and, for an op, torch's version, so a later process loads it; a cache folder that cannot be written gets a
library built in a temporary folder, used and not kept. Without a compiler, or with
`PAGED_BACKEND_CPU_KERNEL=0`, no kernel loads and their callers run PyTorch ops (an op, its Python kernel), as
each says once.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from paged_backend.cache_folder import cache_dir, cpu_flags

logger = logging.getLogger(__name__)

ENV_SWITCH = "PAGED_BACKEND_CPU_KERNEL"  # "0": every CPU kernel off


class Switch:
    """A kernel's off switch for a block of code (tests, benchmarks): inside `switched_off()` its callers run
    as on a machine without a compiler."""

    def __init__(self) -> None:
        self.off = False

    @contextlib.contextmanager
    def switched_off(self) -> Iterator[None]:
        before, self.off = self.off, True
        try:
            yield
        finally:
            self.off = before


def load(source: Path, declare: Callable[[ctypes.CDLL], None], what: str) -> ctypes.CDLL | None:
    """The library built from `source`, its functions' signatures set by `declare`; None when the kernels
    are switched off or it cannot be built (said once, naming `what` runs instead)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(built_library(source)))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("the CPU kernel %s could not be built (%s); %s", source.name, describe(exc), what)
        return None
    declare(lib)
    return lib


class OpKernel:
    """An op of the `paged_backend` library defined here, and its CPU kernel: `python_kernel` until load_cpp()
    loads the C++ one (the dispatcher takes one CPU kernel per op). `language` says which runs."""

    def __init__(self, schema: str, python_kernel: Callable) -> None:
        self.name = schema.split("(", 1)[0]
        self.python_kernel = python_kernel
        self.definition = torch.library.Library("paged_backend", "FRAGMENT")
        self.definition.define(schema)
        self.op = getattr(torch.ops.paged_backend, self.name).default
        self.language = "Python"
        self.registration = self.register_python()

    def register_python(self) -> torch.library.Library:
        registration = torch.library.Library("paged_backend", "IMPL")
        registration.impl(self.name, self.python_kernel, "CPU")
        return registration

    def load_cpp(self, source: Path, kernel_address: int, what: str) -> None:
        """The C++ kernel built from `source` in the Python one's place (load_op), or the Python one kept."""
        self.registration._destroy()
        if load_op(source, kernel_address, what):
            self.language = "C++"
        else:
            self.registration = self.register_python()


def load_op(source: Path, kernel_address: int, what: str) -> bool:
    """Load the C++ op kernels built from `source` into torch's dispatcher, handing them the C kernel at
    `kernel_address` (their `set_kernel`). False when they cannot be built or loaded (said once, naming `what`
    runs instead)."""
    try:
        path = built_library(source)
        torch.ops.load_library(str(path))
    except (OSError, ImportError, RuntimeError, subprocess.SubprocessError) as exc:  # ImportError: no setuptools
        logger.warning("the CPU op %s could not be built (%s); %s", source.name, describe(exc), what)
        return False
    ctypes.CDLL(str(path)).set_kernel(ctypes.c_void_p(kernel_address))
    return True


def compile_command(source: Path) -> list[str]:
    """The command that compiles `source` (C, or an op's C++ against torch) to a shared library, less its
    output path."""
    if source.suffix == ".c":
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise OSError("no C compiler (cc, gcc or $CC) on PATH")
        return [compiler, "-O3", "-march=native", "-fopenmp", "-std=gnu11", "-shared", "-fPIC", str(source)]
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise OSError("no C++ compiler (c++, g++ or $CXX) on PATH")
    from torch.utils import cpp_extension  # imported here: it loads setuptools, which most processes never need

    return [compiler, "-O2", "-std=c++20", "-shared", "-fPIC", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *(f"-I{folder}" for folder in cpp_extension.include_paths()), str(source),
            *(f"-L{folder}" for folder in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu"]


def built_library(source: Path) -> Path:
    """The library for `source`, this compiler and this CPU, compiled now unless the cache folder has it."""
    command = compile_command(source)
    key = hashlib.sha256(repr((source.read_bytes(), command, platform.machine(), cpu_flags(),
                               torch.__version__)).encode()).hexdigest()
    target = cache_dir() / "kernels" / f"{source.stem}-{key[:16]}.so"
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    except OSError:
        target = Path(tempfile.mkdtemp(prefix="paged-backend-kernel-")) / target.name
        handle, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(handle)
    try:
        subprocess.run([*command, "-o", partial], check=True, capture_output=True, text=True, timeout=300)
        os.replace(partial, target)  # whole or not at all: a second process may be loading it
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
    logger.info("built the CPU kernel %s: %s", source.name, target)
    return target


def describe(exc: BaseException) -> str:
    if isinstance(exc, subprocess.CalledProcessError):
        return f"{exc.cmd[0]} exited with {exc.returncode}: {(exc.stderr or '').strip()[-500:]}"
    return str(exc)
