"""What a model's K/V depend on besides the tokens: its weights and, for a PEFT model, which adapters are on.

The engine's model is often the user's own object (LLM(model), `generate(cache_implementation="paged")`), and
between calls they change it: switch a PEFT model's adapters (`set_adapter`, `disable_adapter()`), or its
weights in place (a training step between two evaluations, `load_state_dict`). The same prompt then has
other K/V, so the prefix cache must not hand a request the K/V computed under another state.
`ModelStates.current()` numbers the states as they come; a request carries the number of the state it was
made under into its first block's hash, like a cache salt.

Weights are watched through their tensors' version counters, which every in-place change bumps (an
optimizer step, `copy_`, `load_state_dict`): summing them over the model's parameters and buffers costs
little per request (docs/design.md has the measurement). A change through `.data` (which bypasses the counter) or
a tensor replaced by a new object is not seen.
"""

from __future__ import annotations

from torch import nn


def tuner_layers(model: nn.Module) -> list[nn.Module]:
    """PEFT's tuner layers inside `model` (those that switch adapters by `active_adapters` and a disabled
    flag); empty for a plain model."""
    return [m for m in model.modules() if hasattr(m, "_disable_adapters") and hasattr(m, "active_adapters")]


class ModelStates:
    """Numbers for the states of one model's weights and adapters, a new one each time the state changes."""

    def __init__(self, model: nn.Module) -> None:
        self.tensors = [*model.parameters(), *model.buffers()]
        self.layers = tuner_layers(model)
        self.state: tuple | None = None
        self.number = -1

    def current(self) -> int:
        """The number of the model's state now: the last one's while nothing changed."""
        state = (sum(t._version for t in self.tensors),
                 tuple((tuple(m.active_adapters), bool(m._disable_adapters)) for m in self.layers))
        if state != self.state:
            self.state, self.number = state, self.number + 1
        return self.number
