"""The model side: loading and vetting a HF model, the paged cache it writes through, the attention it
reads through, the runner that packs a step into one forward (compiled, padded, captured), LoRA, and
the per-architecture adapters."""
