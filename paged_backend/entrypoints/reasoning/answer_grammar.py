"""A grammar held to the answer, not the thinking: what structured outputs mean for a reasoning model.

A JSON schema, a choice or a forced tool call describes the answer; a reasoning model writes its thinking
first, between its markers, in words no grammar of the answer admits. `after_thinking` wraps a request's
grammar so that the thinking runs free up to its end marker (it must close when the prompt opened it, and
may be skipped otherwise) and the grammar holds what follows, as vLLM holds structured outputs only once
the reasoning ended. Every front end with a reasoning parser (the server's routes, ChatPaged, `LLM.chat`)
wraps its grammar this way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from paged_backend.sampling.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    from .base import ReasoningParser

# Bounded, so a model cannot spend its tokens on blank lines before the answer.
_WHITESPACE = 'root ::= [ \\t\\r\\n]{0,4}'


def after_thinking(spec: StructuredOutputsParams | None, parser: ReasoningParser, opened: bool,
                   forced_call: bool = False) -> StructuredOutputsParams | None:
    """`spec` with the model's thinking (between `parser`'s markers) allowed before it: an opened thinking must
    close, otherwise a thinking block is optional. The answer opens with `parser.answer_opening` (harmony's
    final-channel header) unless `spec` is a `forced_call`, whose grammar writes its own header."""
    if spec is None:
        return None
    opening = "" if forced_call else parser.answer_opening
    import xgrammar
    from xgrammar.structural_tag import (
        AnyTextFormat,
        ConstStringFormat,
        GrammarFormat,
        OptionalFormat,
        SequenceFormat,
        StructuralTag,
        TagFormat,
    )

    from paged_backend.sampling.structured_outputs import build_grammar

    # Models write a line break or two between the end marker and the answer (Qwen3: "</think>\n\n").
    thinking = SequenceFormat(elements=[
        TagFormat(begin="" if opened else parser.start, content=AnyTextFormat(), end=parser.end),
        GrammarFormat(grammar=_WHITESPACE)])
    answer = GrammarFormat(grammar=str(build_grammar(spec.key)))
    if opening:
        answer = SequenceFormat(elements=[ConstStringFormat(value=opening), answer])
    elements = [thinking if opened else OptionalFormat(content=thinking), answer]
    return StructuredOutputsParams(grammar=str(xgrammar.Grammar.from_structural_tag(
        StructuralTag(format=SequenceFormat(elements=elements)))))
