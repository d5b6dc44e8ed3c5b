"""Triton kernels only (``@triton.jit``). Launchers and policy live in the modules above."""
