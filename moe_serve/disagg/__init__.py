"""Prefill/decode disaggregation: moving a request's KV blocks from one instance to another."""
