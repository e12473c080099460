"""Triton kernels, one op per module, each beside its torch reference."""
