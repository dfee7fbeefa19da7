"""The quantized linears the engine swaps into a model (int4, int8, GGUF Q4), the small-step linear,
and the fused projections, with the choice of which to use."""
