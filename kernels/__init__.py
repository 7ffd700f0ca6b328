"""Triton kernels of dpara_rt, each beside its torch reference."""
