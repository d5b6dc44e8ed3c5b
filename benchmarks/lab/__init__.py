"""Kernels tried outside the library, with the scripts that measure them against it."""
