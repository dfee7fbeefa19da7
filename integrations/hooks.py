"""The transformers hooks the package turns on when imported: `generate(cache_implementation="paged")`
(transformers_generate.py) and `generate_batch` with such a generation config (generate_batch.py) run on the
engine; `disable()` gives both back to transformers."""

from __future__ import annotations

from . import generate_batch, transformers_generate


def enable() -> None:
    transformers_generate.enable()
    generate_batch.enable()


def disable() -> None:
    transformers_generate.disable()
    generate_batch.disable()
