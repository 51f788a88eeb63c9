"""Paged attention: the KV block allocator, the cache tensors, batch metadata and the kernels."""
