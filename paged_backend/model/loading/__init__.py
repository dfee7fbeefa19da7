"""Loading a model (a hub id, folder, GGUF file or the default model), vetting it for the engine, its
precision and rotary embedding, and the number of each state of its weights."""
