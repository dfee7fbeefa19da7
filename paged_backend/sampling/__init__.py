"""From logits to text: sampling parameters, the vectorised sampler, structured-output grammars,
prompt logprobs and incremental detokenization."""
