"""A cache folder the default model cannot be converted into is an error that names the folder and the variable
to set (PAGED_BACKEND_CACHE); the command line ends with that message, not a traceback."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from paged_backend.integrations import cli

from paged_backend.model.loading import default_model
from paged_backend.model.loading.default_model import CacheNotWritableError, default_model_path


def under_a_file(tmp_path: Path) -> Path:
    """A cache folder that cannot be made, whoever runs the test (root writes a read-only folder anyway)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return blocker / "cache"


def test_a_cache_that_cannot_be_made_names_the_folder_and_the_variable(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(under_a_file(tmp_path)))
    with pytest.raises(CacheNotWritableError, match="PAGED_BACKEND_CACHE") as raised:
        default_model_path()
    assert str(under_a_file(tmp_path)) in str(raised.value)


def test_a_read_only_empty_cache_names_the_folder_and_the_variable(tmp_path, monkeypatch) -> None:
    def read_only(**kwargs):  # what mkdtemp raises in a read-only folder (for a user other than root)
        raise PermissionError(errno.EACCES, "Permission denied", kwargs["dir"])

    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model.tempfile, "mkdtemp", read_only)
    with pytest.raises(CacheNotWritableError, match=f"{tmp_path}, which cannot be written .Permission denied.") as raised:
        default_model_path()
    assert "PAGED_BACKEND_CACHE" in str(raised.value) and isinstance(raised.value, OSError)


def test_the_command_line_ends_with_the_message(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(under_a_file(tmp_path)))
    with pytest.raises(SystemExit) as exited:
        cli.main(["generate", "Hello"])
    assert str(exited.value.code).startswith("paged-backend: The default model") and \
        "Set PAGED_BACKEND_CACHE" in str(exited.value.code)
