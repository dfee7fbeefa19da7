"""Where users enter: the offline `LLM`, the streaming `AsyncEngine`, beam search and the command line."""
