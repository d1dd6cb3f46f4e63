"""Triton kernels for multi-adapter prefill work, each beside its torch reference: to come."""
