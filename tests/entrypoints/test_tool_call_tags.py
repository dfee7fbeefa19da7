"""What the server's and LangChain's tool-call streamers share for `<tool_call>` answers: the content that is
certainly not a call (a suffix that may still become a tag held back), and call ids."""

from __future__ import annotations

from paged_backend.entrypoints.tool_calls import HERMES, content_so_far
from paged_backend.entrypoints.tool_calls.base import new_call_id
from paged_backend.entrypoints.tool_calls.tool_call_tags import OPEN, partial_close, partial_open

ANSWER = 'Let me check. <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call> and < more'
PARSER = HERMES


def test_content_so_far_never_shows_a_tag_or_its_start_and_only_grows() -> None:
    released = ""
    for end in range(len(ANSWER) + 1):
        content = content_so_far(PARSER, ANSWER[:end])
        assert content.startswith(released) and "<" not in content
        released = content
    assert released == "Let me check. "


def test_a_lone_angle_bracket_is_held_only_while_it_may_start_a_tag() -> None:
    assert content_so_far(PARSER, "a <") == "a " and content_so_far(PARSER, "a <b") == "a <b"
    assert content_so_far(PARSER, "x" + OPEN[:-1]) == "x" and content_so_far(PARSER, "x" + OPEN) == "x"
    assert (partial_open("a <tool"), partial_open("a <b"), partial_close("x </tool_c"), partial_close("x")) == (5, 0, 8, 0)


def test_call_ids_are_fresh_and_openai_shaped() -> None:
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(i.startswith("call_") and len(i) == 29 for i in ids)
