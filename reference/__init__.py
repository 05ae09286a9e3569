"""PyTorch references (installed as ``treeops.reference``): each op written the obvious way,
in fp32/fp64, with the public signature. They are the specification the kernels are tested against.
"""
