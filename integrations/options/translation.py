"""`Translation`: one option vocabulary's names mapped onto `SamplingParams` fields, and, for a vocabulary
that is a schema (a pydantic model), how each option is declared there (`Wire`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from paged_backend.sampling.sampling_params import SamplingParams

Convert = Callable[[Any], Any]


def same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Wire:
    """How a front end's schema declares one option: its type there, its default, the pydantic
    constraints on its value (`ge`, `le`, ...) and on each item of a list value (`items`), a short
    description. Plain data, so that the tables load without pydantic (`schema.py` builds the fields)."""

    type: Any
    default: Any = None
    description: str | None = None
    constraints: Mapping[str, Any] = field(default_factory=dict)
    items: Mapping[str, Any] = field(default_factory=dict)


def wire(type_: Any, default: Any = None, description: str | None = None, items: Mapping[str, Any] | None = None,
         **constraints: Any) -> Wire:
    """A Wire written compactly: `wire(float, 1.0, ge=0.0, le=2.0)`."""
    return Wire(type_, default, description, constraints, items or {})


@dataclass(frozen=True)
class Rule:
    """Where one option goes: the SamplingParams field, how its value changes form on the way, and how
    the vocabulary's schema declares it (None where the vocabulary has no schema of ours)."""

    field: str
    convert: Convert = same
    wire: Wire | None = None


@dataclass(frozen=True)
class Translation:
    """A vocabulary's table: option name -> Rule. Options outside it are the caller's to refuse by name
    (`unknown`); each front end words that refusal in its own protocol's terms."""

    vocabulary: str
    rules: Mapping[str, Rule]

    def __post_init__(self) -> None:
        for name, rule in self.rules.items():
            if rule.field not in SamplingParams.__dataclass_fields__:
                raise TypeError(f"{self.vocabulary} option {name!r} maps to no SamplingParams field {rule.field!r}")

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.rules)

    def unknown(self, options: Mapping[str, Any]) -> list[str]:
        """The option names this vocabulary does not have, sorted."""
        return sorted(set(options) - set(self.rules))

    def fields(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """SamplingParams keyword arguments for `options` (each a name of this vocabulary)."""
        unknown = self.unknown(options)
        if unknown:
            raise ValueError(f"unknown {self.vocabulary} options: {', '.join(unknown)}")
        return {self.rules[name].field: self.rules[name].convert(value) for name, value in options.items()}

    def params(self, options: Mapping[str, Any], **fields: Any) -> SamplingParams:
        """SamplingParams from `options`, plus `fields` already in SamplingParams' own names (they win);
        a ValueError names the invalid field."""
        return SamplingParams(**(self.fields(options) | fields))


def table(vocabulary: str, rules: Mapping[str, str | tuple[Any, ...]]) -> Translation:
    """A Translation written compactly: `name: field` when the value passes unchanged, else
    `name: (field, convert)`, `name: (field, wire)` or `name: (field, convert, wire)`."""
    return Translation(vocabulary, {name: rule_of(rule) for name, rule in rules.items()})


def rule_of(rule: str | tuple[Any, ...]) -> Rule:
    if isinstance(rule, str):
        return Rule(rule)
    field_name, *rest = rule
    declared = rest.pop() if rest and isinstance(rest[-1], Wire) else None
    return Rule(field_name, *rest, wire=declared)
