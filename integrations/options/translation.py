"""`Translation`: one option vocabulary's names mapped onto `SamplingParams` fields."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from paged_backend.sampling.sampling_params import SamplingParams

Convert = Callable[[Any], Any]


def same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Rule:
    """Where one option goes: the SamplingParams field, and how its value changes form on the way."""

    field: str
    convert: Convert = same


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


def table(vocabulary: str, rules: Mapping[str, str | tuple[str, Convert]]) -> Translation:
    """A Translation written compactly: `name: field` when the value passes unchanged, else
    `name: (field, convert)`."""
    return Translation(vocabulary, {name: Rule(rule) if isinstance(rule, str) else Rule(*rule)
                                    for name, rule in rules.items()})
