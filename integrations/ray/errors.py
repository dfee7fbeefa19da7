"""Errors of the replicated engine (the failed output a request ends with is `core.outputs.failed_output`)."""

from __future__ import annotations


class NoLiveReplicaError(RuntimeError):
    """Every replica that could take the request is dead (or was already tried for it)."""



def first_line(exc: BaseException) -> str:
    """Ray's first line says what happened, its last line why (e.g. "killed by `ray.kill`")."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()] or [type(exc).__name__]
    return lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"
