"""The paged-backend command on the default model: generate (arguments, a file) and chat."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "paged_backend.integrations.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=240)


def test_generate_streams_one_answer():
    run = run_cli("generate", "What is the capital of France?", "--max-tokens", "12")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Paris" in run.stdout
    assert "Loading weights" not in run.stderr  # transformers' progress bar stays off the terminal


def test_generate_a_file_of_prompts(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is the capital of France?\n\nName a colour.\n")
    run = run_cli("generate", "--file", str(prompts), "--max-tokens", "8", "--temperature", "0")
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count("### ") == 2 and "### Name a colour." in run.stdout


def test_chat_answers_then_quits_on_an_empty_line():
    run = run_cli("chat", "--max-tokens", "12", stdin="What is the capital of France?\n\n")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Paris" in run.stdout


def test_invalid_sampling_flag_is_refused_before_loading():
    run = run_cli("generate", "hi", "--temperature", "-1")
    assert run.returncode != 0 and "temperature" in run.stderr
