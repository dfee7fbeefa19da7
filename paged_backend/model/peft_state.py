"""Which of a PEFT model's adapters are on: what its K/V depend on besides the tokens.

A PEFT model handed to the engine (LLM, Engine, `generate(cache_implementation="paged")`) keeps its tuner
layers, and the user switches them between calls: `set_adapter`, `disable_adapter()`. The same prompt then
has other K/V, so the prefix cache must not hand the K/V of one setting to a request made under another.
`AdapterStates` numbers each setting it sees; a request carries the number of the setting it was made
under, which goes into its first block's hash like a cache salt.
"""

from __future__ import annotations

from torch import nn


def tuner_layers(model: nn.Module) -> list[nn.Module]:
    """PEFT's tuner layers inside `model` (those that switch adapters by `active_adapters` and a disabled
    flag); empty for a plain model."""
    return [m for m in model.modules() if hasattr(m, "_disable_adapters") and hasattr(m, "active_adapters")]


class AdapterStates:
    """Numbers for the adapter settings of one model's tuner layers, in the order first seen."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = layers
        self.numbers: dict[tuple, int] = {}

    def current(self) -> int | None:
        """The number of the layers' setting now (None for a model without tuner layers)."""
        if not self.layers:
            return None
        setting = tuple((tuple(m.active_adapters), bool(m._disable_adapters)) for m in self.layers)
        return self.numbers.setdefault(setting, len(self.numbers))
