"""Many LoRA adapters on one base model, chosen per request, mixed in one packed step.

An adapter is registered once (`LoRARegistry.add`, from a PEFT folder or a loaded `PeftModel`): its
weights are read, checked against the base model's modules and kept on the host. Up to `max_loras`
adapters sit in device *slots* at a time (`LoRASlots`): per targeted linear layer, the stacked A and
B of the loaded adapters, ranks padded to `max_lora_rank` with zeros, zeros where an adapter does not
target the module; slot 0 is the base model (no delta). The scheduler admits a request only when its
adapter has a slot (loaded already, or a slot no running request uses), so more distinct adapters
than slots means waiting, never failing; and it keeps one busy slot from taking new users while a
request waits for a slot (`slot_to_drain`), so that waiting ends.

Each packed token carries its request's slot. Per step, the runner turns those into a mask of each
token's rank columns (`LoRAStep`), opened as a context around the forward the way the attention ops
get their metadata. A forward hook on every targeted linear adds the whole batch's delta with two
matmuls (see `LoRALinearHook`): no loop over tokens or adapters. Outside a step the hooks add
nothing, so the model object stays the base model.

Eagerly, a linear is hooked when the first adapter targeting it loads. A compiled forward traces the hooks
into its graph and is not told of later ones (it drops the guards on the model's modules), so a compiled
engine hooks every linear an adapter may target before it compiles (`hook_adaptable_linears`; adapters
targeting anything else are refused when read) and gives every step a mask, zeros where no token runs an
adapter, so one graph serves steps with and without adapters.
"""

from paged_backend.model.lora.adapter import LoRAAdapter, LoRARequest, LoRASpec, LoRAWeights
from paged_backend.model.lora.reading import adaptable_linears, portable_source, read_lora_layers
from paged_backend.model.lora.registry import LoRARegistry
from paged_backend.model.lora.slots import LoRALinearHook, LoRASlots

__all__ = ["LoRAAdapter", "LoRALinearHook", "LoRARegistry", "LoRARequest", "LoRASlots", "LoRASpec", "LoRAWeights",
           "adaptable_linears", "portable_source", "read_lora_layers"]
