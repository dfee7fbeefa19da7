"""Pydantic fields generated from a translation table's rows (`translation.Wire`): the server's request
model and LangChain's options declare their sampling options through their table, not by hand."""

from __future__ import annotations

import types
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, create_model

from .translation import Translation, Wire


def options_model(name: str, translation: Translation, config: ConfigDict) -> type[BaseModel]:
    """A model with one field per option of `translation`, declared as its row's Wire says; a front end's
    model subclasses it and declares its other fields by hand."""
    fields: dict[str, Any] = {}
    for option, rule in translation.rules.items():
        if rule.wire is None:
            raise TypeError(f"{translation.vocabulary} option {option!r} has no Wire for its schema")
        fields[option] = (annotation(rule.wire), Field(rule.wire.default, description=rule.wire.description,
                                                       **rule.wire.constraints))
    return create_model(name, __config__=config, **fields)


def annotation(declared: Wire) -> Any:
    """The Wire's type, with its `items` constraints on the items of its list member (`list[int] | None`
    becomes `list[Annotated[int, Field(ge=0)]] | None`)."""
    if not declared.items:
        return declared.type
    members = get_args(declared.type) if get_origin(declared.type) in (Union, types.UnionType) else (declared.type,)
    constrained = tuple(list[Annotated[get_args(m)[0], Field(**declared.items)]] if get_origin(m) is list else m
                        for m in members)
    return Union[constrained] if len(constrained) > 1 else constrained[0]  # noqa: UP007 (a tuple of members)
