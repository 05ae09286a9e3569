"""treeops: Triton kernels for speculative decoding with draft trees.

Every op is a fused Triton kernel for CUDA tensors and a PyTorch reference for CPU tensors:
``kv_append`` (KV append with RoPE), ``tree_attention`` (tree-masked paged attention),
``build_tree`` (EAGLE and CAST tree build), ``cast_*`` (CAST's selection rules), ``CastPlanner``
(λ-CAST: tree sizes from the measured throughput), ``graft`` / ``graft_tail`` / ``prune`` /
``AdjacencyTable`` (Graft), ``accept_greedy`` / ``accept_sample`` (lossless acceptance) and
``compact_kv`` (KV compaction). ``Tree`` is the batch of padded draft trees they share.
``prepare`` makes a per-layer op's call once and replays its kernel launches per layer. Each
op's module is ``treeops.<op>`` (its function shadows the module as an attribute of ``treeops``;
import from the module path: ``from treeops.tree_attention import ...``).
"""

from . import accept as _accept
from . import build_tree as _build
from . import cast as _cast
from . import cast_plan as _cast_plan
from . import compact_kv as _compact
from . import graft as _graft
from . import graft_tail as _graft_tail
from . import kv_append as _kv_append
from . import prepared as _prepared
from . import prune as _prune
from . import tree_attention as _tree_attention
from ._version import __version__
from .accept import *  # noqa: F403
from .build_tree import *  # noqa: F403
from .cast import *  # noqa: F403
from .cast_plan import *  # noqa: F403
from .compact_kv import *  # noqa: F403
from .graft import *  # noqa: F403
from .graft_tail import *  # noqa: F403
from .kv_append import *  # noqa: F403
from .prepared import *  # noqa: F403
from .prune import *  # noqa: F403
from .tree import Tree, anc_words
from .tree_attention import *  # noqa: F403

__all__ = ["Tree", "anc_words", "__version__"]
for _m in (
    _tree_attention, _kv_append, _build, _cast, _cast_plan, _graft, _graft_tail, _accept,
    _compact, _prepared, _prune,
):  # fmt: skip
    __all__ += list(_m.__all__)
del _m
