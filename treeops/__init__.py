"""treeops: Triton kernels for speculative decoding with draft trees.

Ops (each a fused Triton kernel for CUDA tensors, a PyTorch reference for CPU tensors):
tree-masked attention and KV append (``attention``), tree build and CAST selection (``build``,
``cast``), Graft retrieval and merge (``graft``), lossless acceptance (``accept``) and KV
compaction (``compact``). ``Tree`` is the batch of padded draft trees they share.
"""

from . import accept as _accept
from . import attention as _attention
from . import build as _build
from . import cast as _cast
from . import compact as _compact
from . import graft as _graft
from .accept import *  # noqa: F403
from .attention import *  # noqa: F403
from .build import *  # noqa: F403
from .cast import *  # noqa: F403
from .compact import *  # noqa: F403
from .graft import *  # noqa: F403
from .tree import Tree, anc_words

__version__ = "0.1.0"

__all__ = ["Tree", "anc_words", "__version__"]
for _m in (_attention, _build, _cast, _graft, _accept, _compact):
    __all__ += list(_m.__all__)
del _m
