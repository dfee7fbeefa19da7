"""Errors of the replicated engine (the failed output a request ends with is `core.outputs.failed_output`)."""

from __future__ import annotations


class NoLiveReplicaError(RuntimeError):
    """Every replica that could take the request is dead (or was already tried for it)."""

