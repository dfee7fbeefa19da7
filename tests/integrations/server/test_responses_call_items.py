"""A streamed /v1/responses answer with several function calls sends its items one at a time, as OpenAI
streams them: each call item opens, streams its arguments and closes before the next one opens, whether
the calls were forced (streamed as written) or free (sent whole at the end); and the whole answer holds
the same items. A tiny random model is made to write two calls (helpers/scripted.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from helpers.server import Served, serve_script

pytestmark = pytest.mark.timeout(300)

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city", "days"]}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]
ARGS = [{"city": "Paris", "days": 2}, {"city": "Rome", "days": 3}]
SCRIPT = "\n".join(f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(a)}}}\n</tool_call>'
                   for a in ARGS)
ITEM_EVENTS = ("response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done")


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve_script(SCRIPT) as served:
        yield served


def item_runs(events: list) -> list[tuple[int, list[str]]]:
    """The call items' events grouped by item as they came: (output index, the event kinds of one run)."""
    runs: list[tuple[int, list[str]]] = []
    for event in events:
        if event.type not in ITEM_EVENTS:
            continue
        if not runs or runs[-1][0] != event.output_index:
            runs.append((event.output_index, []))
        runs[-1][1].append(event.type)
    return runs


def comparable(item) -> tuple:
    """An item less its ids (made anew per answer); arguments as JSON (a whole answer re-serialises them)."""
    return item.type, item.name, json.loads(item.arguments), item.status


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_call_items_stream_one_after_another(served: Served, tool_choice: str) -> None:
    request = dict(model="tiny", input="Weather in Paris and Rome?", tools=TOOLS, tool_choice=tool_choice)
    events = list(served.client().responses.create(**request, stream=True))
    runs = item_runs(events)
    assert [index for index, _ in runs] == [0, 1]  # each item's events in one run: none interleaved
    for _, kinds in runs:
        assert kinds[0] == "response.output_item.added" and kinds[-1] == "response.output_item.done"
        assert kinds[-2] == "response.function_call_arguments.done" and kinds.count(kinds[0]) == 1
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [json.loads(item.arguments) for item in done] == ARGS
    streamed = events[-1].response.output
    assert [item.model_dump() for item in streamed] == [item.model_dump() for item in done]
    whole = served.client().responses.create(**request).output
    assert [comparable(item) for item in whole] == [comparable(item) for item in streamed]
    assert [comparable(item)[3] for item in whole] == ["completed", "completed"]
