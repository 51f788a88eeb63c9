"""Compute kernels: each op has a pure-torch reference and, where it pays, a Triton kernel."""
