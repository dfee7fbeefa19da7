"""transformers' private generation names are reached through one module, `hf_generation_prep`, so
a transformers upgrade that renames or reshapes them is a change there alone."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from transformers import GenerationConfig
from transformers.generation.utils import GenerationMixin

import paged_backend

OWNER = "hf_generation_prep.py"


def private_generation_names() -> set[str]:
    """GenerationMixin's and GenerationConfig's private methods and attributes, and the private fields
    `generate`'s preparation sets on a generation config (`_eos_token_tensor`, ...)."""
    names = {n for cls in (GenerationMixin, GenerationConfig) for n in vars(cls)
             if n.startswith("_") and not n.startswith("__")}
    names |= set(re.findall(r"generation_config\.(_[a-z]\w*)", inspect.getsource(GenerationMixin)))
    return names


def package_sources() -> list[Path]:
    roots = [Path(paged_backend.__file__).parent, Path(paged_backend.integrations.__file__).parent,
             Path(paged_backend.kernels.__file__).parent]
    return sorted({path for root in roots for path in root.rglob("*.py")})


def test_the_names_are_found() -> None:
    names = private_generation_names()
    assert {"_prepare_generation_config", "_get_logits_processor", "_eos_token_tensor", "_pad_token_tensor"} <= names


def test_only_the_preparation_module_names_transformers_private_generation_helpers() -> None:
    pattern = re.compile(r"\.(" + "|".join(sorted(map(re.escape, private_generation_names()))) + r")\b")
    offenders = {}
    for path in package_sources():
        found = sorted(set(pattern.findall(path.read_text())))
        if found and path.name != OWNER:
            offenders[str(path)] = found
    assert offenders == {}


def test_the_preparation_module_does_name_them() -> None:
    owner = next(p for p in package_sources() if p.name == OWNER)
    assert "._prepare_generation_config(" in owner.read_text()
