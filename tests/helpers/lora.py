"""What the LoRA tests share: a tiny PEFT model with two adapters of different ranks and targets, its
"legal" adapter saved to a folder, and PEFT's own greedy answer with an adapter active."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model

from helpers.models import build
from helpers.server import build_chat_tokenizer, tiny_llama

PROMPT = "hello there, how are you today?"
MAX_NEW = 8


def saved_peft_model(tmp_path_factory):
    """(tokenizer, PEFT model with "french" and "legal", the folder "legal" is saved in)."""
    tokenizer = build_chat_tokenizer([PROMPT, "say hello to the world", "how are you"] * 5)
    model = peft_model(tokenizer)
    folder = tmp_path_factory.mktemp("legal")
    model.save_pretrained(folder, selected_adapters=["legal"])
    return tokenizer, model, folder / "legal"


def peft_model(tokenizer):
    model = get_peft_model(tiny_llama(tokenizer), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                           adapter_name="french")
    model.add_adapter("legal", LoraConfig(r=8, lora_alpha=8, target_modules=["o_proj", "down_proj"]))
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return model.eval()


def peft_text(model, tokenizer, ids: list[int], adapter: str | None) -> str:
    with torch.no_grad():
        if adapter is None:
            with model.disable_adapter():
                out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False)
        else:
            model.set_adapter(adapter)
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


MLP = ["gate_proj", "up_proj", "down_proj"]


# Three adapters of different ranks, scalings and target modules.
ADAPTERS = {
    "alpha": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "beta": LoraConfig(r=8, lora_alpha=16, use_rslora=True, target_modules=ATTENTION + MLP),
    "gamma": LoraConfig(r=2, lora_alpha=4, target_modules=["o_proj", "down_proj"],
                        alpha_pattern={"down_proj": 12}),
}


def randomise_lora_b(model, seed: int) -> None:
    """PEFT starts B at zero (no change): random B makes every adapter change the output."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)


def peft_with_adapters():
    model = None
    for name, config in ADAPTERS.items():
        if model is None:
            model = get_peft_model(build("llama"), config, adapter_name=name)
        else:
            model.add_adapter(name, config)
    randomise_lora_b(model, seed=1)
    return model.eval()
