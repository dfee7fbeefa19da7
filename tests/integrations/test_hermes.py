"""What the server's and LangChain's tool-call streamers share from hermes.py: the content that is
certainly not a call, and call ids."""

from __future__ import annotations

from paged_backend.integrations.hermes import OPEN, content_so_far, new_call_id

ANSWER = 'Let me check. <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call> and < more'


def test_content_so_far_never_shows_a_tag_or_its_start_and_only_grows() -> None:
    released = ""
    for end in range(len(ANSWER) + 1):
        content = content_so_far(ANSWER[:end])
        assert content.startswith(released) and "<" not in content
        released = content
    assert released == "Let me check. "


def test_a_lone_angle_bracket_is_held_only_while_it_may_start_a_tag() -> None:
    assert content_so_far("a <") == "a " and content_so_far("a <b") == "a <b"
    assert content_so_far("x" + OPEN[:-1]) == "x" and content_so_far("x" + OPEN) == "x"


def test_call_ids_are_fresh_and_openai_shaped() -> None:
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(i.startswith("call_") and len(i) == 29 for i in ids)
