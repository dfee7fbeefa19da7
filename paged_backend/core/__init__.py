"""The engine core: requests, the block pool, the KV cache manager (block tables, prefix cache) and the
scheduler. Nothing here touches a model or a tensor."""
