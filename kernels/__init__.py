"""Triton kernels (installed as ``treeops.kernels``): @triton.jit bodies and their launchers.

Launchers take tensors and scalars only; validation and policy live in the public ops above.
"""
