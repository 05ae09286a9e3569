"""Graft at the deep end: ``graft_tail`` hangs a chain of the successor table's first
successors below each request's best leaf (docs/design.md op 6).

Graft's ``graft`` refills a pruned tree from its root's successors, which a good draft already
proposes; when the whole drafted path is accepted, a chain below its leaf is accepted after it
for the price of verification alone. A custom op ``torch.ops.treeops.graft_tail``: CUDA tensors
run ``treeops.kernels.graft_tail`` (one launch), CPU tensors ``treeops.reference.graft``. No host
sync unless ``validate=True``.
"""

from __future__ import annotations

import torch

from ._checks import cuda_device
from ._library import OUT_TREE, TREE, define
from .graft import (
    _PASSED,
    AdjacencyTable,
    _check_graft_args,
    _check_out_memory,
    _copy_into,
    _key,
    _result_tree,
    _split,
)
from .kernels import graft_tail as _kt
from .kernels._replay import MISS, Replays
from .reference import graft as _ref
from .tree import Tree

__all__ = ["graft_tail"]


def _graft_tail_cuda(*args):
    tree, rest, out = Tree(*args[:8]), args[8:-8], args[-8:]
    table, count, count_int, budget, budget_int, max_count = rest
    with cuda_device(table):
        _kt.graft_tail(
            tree, table, count if count is not None else count_int,
            budget if budget is not None else budget_int, max_count, out=out,
        )  # fmt: skip


def _graft_tail_cpu(*args):
    tree, rest, out = Tree(*args[:8]), args[8:-8], args[-8:]
    table, count, count_int, budget, budget_int, max_count = rest
    # counts above max_count act as it, as in the kernel's loop of max_count steps
    count = count.clamp(max=max_count) if count is not None else min(count_int, max_count)
    res = _ref.graft_tail(tree, table, count, budget if budget is not None else budget_int)
    _copy_into(res, out)


_graft_tail_op = define(
    f"graft_tail({TREE}, Tensor table, Tensor? count, int count_int, Tensor? budget, "
    f"int budget_int, int max_count, {OUT_TREE}) -> ()",
    cpu=_graft_tail_cpu,
    cuda=_graft_tail_cuda,
)

_GRAFT_TAIL_REPLAYS = Replays("graft_tail")
"""Calls per ``_key`` replayed without the op's Python layers (``treeops.kernels._replay``);
the table's tensor is among a replay's tensors (tables of equal shapes share a key)."""


def graft_tail(
    tree: Tree,
    table: AdjacencyTable,
    count: torch.Tensor | int,
    budget: torch.Tensor | int,
    *,
    max_count: int | None = None,
    out: Tree | None = None,
    validate: bool = False,
) -> Tree:
    """Extend each request's most probable path past the draft: below its best leaf (the node
    without children of the highest score, the lowest index on ties) a chain of up to
    ``count[b]`` nodes, each the table's first successor (``table.table[token, 0]``) of the node
    above, while the request holds fewer than ``min(budget[b], N)`` nodes (root included).

    Where ``graft`` refills the tree near its root, this grows it at its deep end: when the
    whole drafted path is accepted, the chain's tokens can be accepted after it, for the price
    of verifying them (no draft forward). The chain stops at an empty entry or a token outside
    ``[0, V)``; a request with no node, or more than ``budget`` of them, is left as it is. New
    nodes score 0.

    Args:
        tree: the (pruned) draft tree, [B, N].
        table: an ``AdjacencyTable`` on the tree's device.
        count: chain nodes per request, an int >= 0 or a [B] int32 tensor.
        budget: nodes per request at most, an int >= 1 or a [B] int32 tensor.
        max_count: the most chain nodes per request, counts above it acting as it (it sizes
            the kernel's loop; default ``count`` for an int, N for a tensor).
        out: a ``Tree`` of the tree's shape to write into (not the tree's memory).
    Returns the extended tree (``out`` when given). No host sync unless ``validate=True``.
    """
    key = None
    tensors: tuple = ()
    if not validate and isinstance(table, AdjacencyTable):
        # an int count, budget or max_count is launched as a scalar: all three are in the key
        key, tensors = _key(
            "graft_tail", (tree, out), (table.table, budget, count), (table.k, max_count)
        )
    if _PASSED.get(key) is None:
        if count is None:
            raise ValueError("Invalid value of count: expected an int >= 0 or a [B] int32 tensor")
        _check_graft_args(tree, table, budget, count, out, validate)
        if max_count is not None and (
            not isinstance(max_count, int) or isinstance(max_count, bool) or max_count < 0
        ):
            raise ValueError(f"Invalid value of max_count: expected an int >= 0, got {max_count!r}")
        if isinstance(count, int) and max_count is not None and count > max_count:
            raise ValueError(
                f"Invalid value of count: expected at most max_count = {max_count}, got {count}"
            )
        _PASSED.put(key, True)
    elif out is not None:
        _check_out_memory(out, tree)
    res = _GRAFT_TAIL_REPLAYS.run(key, tensors)
    if res is not MISS:
        return res if out is None else out
    if max_count is None:
        max_count = count if isinstance(count, int) else tree.capacity
    result, out = _result_tree(out, tree)
    _GRAFT_TAIL_REPLAYS.call(
        key, tensors, _graft_tail_op, *tree.tensors(), table.table, *_split(count, 0),
        *_split(budget, 0), max_count, *out.tensors(), result=result,
    )  # fmt: skip
    return out
