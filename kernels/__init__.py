"""Triton kernels (installed as ``treeops.kernels``): @triton.jit bodies and launchers only."""
