"""Speculative decoding: its configuration, the n-gram and draft-model proposers, and verification."""
