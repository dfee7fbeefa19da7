"""The documentation's reference sections, generated from the code so they cannot drift from it:
`EngineConfig` and `SamplingParams` fields (type, default, the comment on the field), the command line's
flags (its argparse parser), and the supported model types (`model_loader.SUPPORTED`, the attention
adapters, `UNSUPPORTED_REASONS`, and the tiny test models that check each type).

    python tools/docs_reference.py            # rewrite the generated sections of docs/
    python tools/docs_reference.py --check    # change nothing; fail when a section is stale

tests/docs/test_site.py runs the check, and the documentation build (tools/mkdocs_hooks.py) refuses stale pages.
"""

from __future__ import annotations

import argparse
import dataclasses
import html
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import generated_sections

HELP_WIDTH = 100  # fixed, so the generated help does not depend on the terminal it was made in


def cell(text: object) -> str:
    """`text` safe inside a Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def code_cell(text: object) -> str:
    """`text` as inline code inside a Markdown table cell: HTML, since a `|` in a code span would split the
    cell (and an escaped one shows its backslash on the site)."""
    return "<code>" + html.escape(str(text)).replace("|", "&#124;") + "</code>"


def dataclass_table(cls: type) -> str:
    """One row per field: name, annotation, default and the comment the code gives it."""
    from paged_backend.integrations.options.flags import field_comments

    comments = field_comments(cls)
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        if field.default is not dataclasses.MISSING:
            default = repr(field.default)
        elif field.default_factory is not dataclasses.MISSING:
            default = repr(field.default_factory())
        else:
            default = "(required)"
        annotation = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
        rows.append(f"| `{field.name}` | {code_cell(annotation)} | {code_cell(default)} | {cell(comments.get(field.name, ''))} |")
    return "\n".join(rows)


def engine_config_table() -> str:
    from paged_backend import EngineConfig

    return dataclass_table(EngineConfig)


def sampling_params_table() -> str:
    from paged_backend import SamplingParams

    return dataclass_table(SamplingParams)


def speculative_config_table() -> str:
    from paged_backend.speculative.speculative_config import SpeculativeConfig

    return dataclass_table(SpeculativeConfig)


def command_help() -> str:
    """`paged-backend <command> --help` of every command, as the parser prints it."""
    from paged_backend.integrations.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    blocks = []
    for name, sub in commands.choices.items():
        sub.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=HELP_WIDTH)
        blocks.append(f"### `paged-backend {name}`\n\n```text\n{sub.format_help().rstrip()}\n```\n")
    return "\n".join(blocks)


def tested_configurations() -> dict[str, list[str]]:
    """model_type -> the names of the tiny test models built for it (tests/helpers)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.adapters import ADAPTED_CONFIGS
    from helpers.models import CONFIGS

    tested: dict[str, list[str]] = {}
    for table in (CONFIGS, ADAPTED_CONFIGS):
        for name, make in table.items():
            tested.setdefault(make().model_type, []).append(name)
    return tested


def supported_models_table() -> str:
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    from paged_backend.model.adapters import ADAPTERS
    from paged_backend.model.loading.model_loader import SUPPORTED
    from paged_backend.model.paged.recurrent_state import STATE_LAYOUTS
    from paged_backend.model.vision.families import FAMILIES

    tested = tested_configurations()
    rows = ["| `model_type` | transformers class | attention reaches the paged cache through | tiny test models |",
            "|---|---|---|---|"]
    for model_type in sorted(SUPPORTED):
        route = "transformers' attention interface"
        if model_type in ADAPTERS:
            adapter = ADAPTERS[model_type]
            source = f"`{adapter.paged_forward.__module__.replace('.', '/')}.py`"
            route = (f"the interface, with an adapter that hands the step on ({source})" if adapter.uses_interface
                     else f"an adapter ({source}) that calls the paged kernels")
            if model_type in STATE_LAYOUTS:
                attention = "the interface" if adapter.uses_interface else f"an adapter ({source}) that calls the paged kernels"
                route = (f"{attention}; its recurrent layers run from state slots through an adapter ({source}); "
                         "no prefix caching")
        models = ", ".join(f"`{name}`" for name in tested.get(model_type, [])) or "synthetic checkpoints (`tests/helpers/adapters.py`)"
        if model_type in FAMILIES:
            route += f"; its images too ([Vision models](vision-models.md))"
        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) or MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(
            model_type, "(remote code)")
        rows.append(f"| `{model_type}` | `{name}` | {route} | {models} |")
    return "\n".join(rows)


def unsupported_table() -> str:
    from paged_backend.model.loading.model_loader import UNSUPPORTED_REASONS

    rows = ["| `model_type` | why it is refused |", "|---|---|"]
    rows += [f"| `{name}` | {cell(reason)} |" for name, reason in sorted(UNSUPPORTED_REASONS.items())]
    return "\n".join(rows)


SECTIONS: dict[Path, dict[str, Callable[[], str]]] = {
    DOCS / "configuration.md": {"engine-config": engine_config_table, "sampling-params": sampling_params_table,
                                "speculative-config": speculative_config_table,
                                "command-line": command_help},
    DOCS / "models.md": {"supported-models": supported_models_table, "unsupported-models": unsupported_table},
}


def stale_sections() -> list[str]:
    return [f"{path.relative_to(ROOT)}: {name}" for path, generators in SECTIONS.items()
            for name in generated_sections.stale(path, generators)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; fail when a generated section is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_sections()
        for name in stale:
            print(f"stale: {name} (run python tools/docs_reference.py)")
        return 1 if stale else 0
    for path, generators in SECTIONS.items():
        if generated_sections.rewrite(path, generators):
            print(f"rewrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
