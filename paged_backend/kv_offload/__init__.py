"""A second tier for KV blocks behind the pool: host memory and a folder on disk (offloader.py)."""
