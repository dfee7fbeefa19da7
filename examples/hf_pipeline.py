"""The text-generation pipeline on the paged engine: every input of a call generates in one continuous batch.

    python examples/hf_pipeline.py
"""

import torch
from paged_backend.integrations.pipeline import PagedTextGenerationPipeline
from paged_backend.integrations.pipeline import pipeline as paged_pipeline
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

from paged_backend import default_model_path

path = default_model_path()  # SmolLM2-135M-Instruct; any causal LM id or folder works the same way
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

questions = ["What is the capital of France?", "Give me a synonym of 'happy'.", "What is 12 times 3?"]
chats = [[{"role": "user", "content": q}] for q in questions]

# Before: the stock pipeline, one generate() per batch of batch_size inputs.
stock = pipeline("text-generation", model=model, tokenizer=tokenizer)
before = stock(chats, max_new_tokens=20, do_sample=False, batch_size=2)

# After: the same pipeline class swapped in; all inputs share the engine's continuous batch.
paged = pipeline("text-generation", model=model, tokenizer=tokenizer, pipeline_class=PagedTextGenerationPipeline)
after = paged(chats, max_new_tokens=20, do_sample=False)

assert after == before
for result in after:
    print(repr(result[0]["generated_text"][-1]["content"]))

# The helper does the same swap (and loads the default model when given none).
helper = paged_pipeline(model=model, tokenizer=tokenizer)
print(helper("The three primary colours are", max_new_tokens=12, return_full_text=False)[0]["generated_text"])
