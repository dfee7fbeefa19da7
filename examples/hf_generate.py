"""HF `generate` on the paged engine: the same code, one extra argument.

    python examples/hf_generate.py
"""

import torch
from paged_backend.integrations.transformers_generate import enable
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

from paged_backend import default_model_path

enable()  # route generate(cache_implementation="paged") to the engine

path = default_model_path()  # SmolLM2-135M-Instruct; any causal LM id or folder works the same way
tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

chats = [[{"role": "user", "content": "Name three primary colours."}],
         [{"role": "user", "content": "What is the capital of Italy?"}]]
inputs = tokenizer.apply_chat_template(chats, add_generation_prompt=True, padding=True, return_tensors="pt",
                                       return_dict=True)

# Before: transformers' own generate loop.
before = model.generate(**inputs, max_new_tokens=24, do_sample=False)
# After: the same call on the paged, continuously batched engine.
after = model.generate(**inputs, max_new_tokens=24, do_sample=False, cache_implementation="paged")

assert torch.equal(before, after)
for text in tokenizer.batch_decode(after[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True):
    print(repr(text))

# Streamers, stopping criteria, logits processors and sampling options work as in ordinary generate.
single = tokenizer.apply_chat_template(chats[1], add_generation_prompt=True, return_tensors="pt", return_dict=True)
model.generate(**single, max_new_tokens=24, do_sample=True, temperature=0.7, top_p=0.9,
               streamer=TextStreamer(tokenizer, skip_prompt=True), cache_implementation="paged")
