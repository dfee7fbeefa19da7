"""Pieces shared by the response builders: SSE framing and usage (logprobs: integrations/logprobs.py)."""

from __future__ import annotations

import json
from typing import Any

from .errors import APIError

DONE = "data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def sse_error(error: APIError) -> str:
    return sse(error.body())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
