"""What a request names and what the registry keeps: `LoRARequest` (or a name: `LoRASpec`), a registered
`LoRAAdapter` and the plain weights an adapter travels as (`LoRAWeights`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch



@dataclass(frozen=True, slots=True)
class LoRARequest:
    """Which adapter a request runs with (vLLM's name). With `path`, an adapter not registered yet
    is registered under `name` from that PEFT folder on first use."""

    name: str
    path: str | None = None


LoRASpec = str | LoRARequest


@dataclass(frozen=True, slots=True, eq=False)
class LoRAAdapter:
    """One registered adapter: per targeted module, `(A [r, in], B [out, r], scaling)` on the host."""

    name: str
    id: int  # unique per registration: a re-registered name never shares cached K/V with its predecessor
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]]

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _, _ in self.weights.values())

    @property
    def target_modules(self) -> list[str]:
        return sorted({name.rsplit(".", 1)[-1] for name in self.weights})


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    """An adapter as plain data: its PEFT config and its `lora_A`/`lora_B` state dict on the host, in
    PEFT's saved key names. What a loaded `PeftModel` becomes to travel to another process (see
    `portable_source`); `add_lora` reads it like a folder."""

    config: dict
    state: dict[str, torch.Tensor]
