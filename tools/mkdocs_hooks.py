"""MkDocs hooks (mkdocs.yml `hooks:`): the site's Architecture page is ARCHITECTURE.md itself, which stays
at the repository root as the contributors' map, so the two cannot differ."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INCLUDE = re.compile(r"<!-- include (?P<path>[\w./-]+) -->")
# A root file links docs pages as `docs/page.md` (so they resolve where it is read, at the root); on the site it
# sits among those pages.
DOCS_LINK = re.compile(r"\]\(docs/")


def on_page_markdown(markdown: str, page, config, files) -> str:  # MkDocs passes all four by name
    """Replace each `<!-- include FILE -->` line with FILE (a path from the repository root)."""
    def include(match: re.Match[str]) -> str:
        return DOCS_LINK.sub("](", (ROOT / match["path"]).read_text(encoding="utf-8"))

    return INCLUDE.sub(include, markdown)
