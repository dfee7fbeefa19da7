"""Scripted answers: a tiny random model made to write an exact text, through a logits processor.

`ScriptedClient` wraps an `EngineClient`; each request it receives is given a processor that forces
the tokens of `client.script` one by one (then EOS), before the request's own processor (logit_bias,
a thinking budget) runs, so those still act on top of the script. When the answer leaves the script
(a budget forced the end of the thinking), the script resumes after its `anchor` text: the tokens
after the anchor's last occurrence in the answer follow the script's tokens after its anchor.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import transformers as tf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from paged_backend import LLM

MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|python_tag|>", "[ARGS]", "[THINK]", "[/THINK]"]
SPECIAL_MARKERS = ["[TOOL_CALLS]"]  # a control token in Mistral's tokenizers: decoding drops it unless told not to
HARMONY_MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]


def marker_tokenizer(corpus: list[str], chat_template: str) -> tf.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with ChatML specials and every format's markers as single tokens."""
    fast = bpe_tokenizer(corpus, chat_template, ["<|im_start|>", "<|im_end|>"], eos="<|im_end|>")
    fast.add_tokens(MARKERS)
    fast.add_tokens(SPECIAL_MARKERS, special_tokens=True)
    return fast


def harmony_tokenizer(corpus: list[str], chat_template: str) -> tf.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with gpt-oss's harmony markers as special tokens, as in gpt-oss's own:
    `<|return|>` is its EOS; `harmony_llm` makes `<|call|>` a stop token too, as gpt-oss's generation config does."""
    fast = bpe_tokenizer(corpus, chat_template, HARMONY_MARKERS, eos="<|return|>")
    fast.add_special_tokens({"additional_special_tokens": [t for t in HARMONY_MARKERS if t != "<|return|>"]})
    return fast


def bpe_tokenizer(corpus: list[str], chat_template: str, specials: list[str], eos: str) -> tf.PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos, pad_token=eos,
                                      chat_template=chat_template)
    return fast


def with_template(tokenizer: tf.PreTrainedTokenizerFast, chat_template: str) -> tf.PreTrainedTokenizerFast:
    other = copy.deepcopy(tokenizer)
    other.chat_template = chat_template
    return other


def tiny_model(tokenizer, seed: int = 0) -> tf.PreTrainedModel:
    torch.manual_seed(seed)
    eos = tokenizer.eos_token_id
    config = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                            eos_token_id=eos, bos_token_id=None, pad_token_id=eos)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = eos
    return model.eval()


def tiny_llm(tokenizer) -> LLM:
    return LLM(tiny_model(tokenizer), tokenizer, num_kv_blocks=128)


def harmony_llm(tokenizer) -> LLM:
    """A tiny model over `harmony_tokenizer` that stops at `<|return|>` and at `<|call|>`."""
    model = tiny_model(tokenizer)
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")]
    return LLM(model, tokenizer, num_kv_blocks=128)


def force(row: torch.Tensor, token: int) -> torch.Tensor:
    row.fill_(float("-inf"))
    row[token] = 0.0
    return row


class ScriptedClient:
    """An EngineClient whose requests write `script` (text), whatever the model would (None: the model's
    own tokens)."""

    def __init__(self, inner: Any, anchor: str | None = None) -> None:
        self.inner = inner
        self.script = ""
        self.anchor = anchor

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode(self, text: str) -> list[int]:
        return list(self.inner.tokenizer.encode(text, add_special_tokens=False))

    def processor(self, then: Any) -> Any:
        if self.script is None:  # the model's own choice
            return then
        script, eos = self.encode(self.script), self.inner.tokenizer.eos_token_id
        anchor = self.encode(self.anchor) if self.anchor and self.anchor in self.script else None
        resume = self.encode(self.script.split(self.anchor, 1)[1]) if anchor else None

        def scripted(output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
            n = len(output_ids)
            if list(output_ids) == script[:n]:
                row = force(row, script[n] if n < len(script) else eos)
            elif anchor is not None and anchor[-1] in output_ids:
                at = len(output_ids) - 1 - list(reversed(output_ids)).index(anchor[-1])
                tail = list(output_ids[at + 1:])
                follows = tail == resume[:len(tail)]
                row = force(row, resume[len(tail)] if follows and len(tail) < len(resume) else eos)
            else:
                row = force(row, eos)
            return then(output_ids, row) if then is not None else row

        return scripted

    def generate(self, prompt, params=None, request_id=None, logits_processor=None, lora=None):
        return self.inner.generate(prompt, params, request_id, self.processor(logits_processor), lora)

    def stream(self, prompt, params=None, request_id=None, logits_processor=None, lora=None):
        return self.inner.stream(prompt, params, request_id, self.processor(logits_processor), lora)

    def submit(self, prompt, params, request_id, sink, logits_processor=None, lora=None):
        return self.inner.submit(prompt, params, request_id, sink, self.processor(logits_processor), lora)
