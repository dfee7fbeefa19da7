"""Tensor parallelism: the per-step protocol below the engine (`step_protocol`) and process launch
above it (`launch`)."""
