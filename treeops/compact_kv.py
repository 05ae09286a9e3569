"""KV-cache compaction after acceptance (docs/design.md op 8).

CUDA tensors run one Triton launch (``treeops.kernels.compact_kv``): one program per (request,
layer, KV head) walks the accepted path in increasing depth and copies slot ``s + i`` to slot
``s + depth(i)`` in place; CPU tensors run the reference (``treeops.reference.compact_kv``).
"""

from __future__ import annotations

import torch

from ._checks import cuda_device
from ._compact_inputs import Caches, check_compact_inputs
from ._library import TREE, define
from .kernels._replay import MISS, Replays
from .kernels.compact_kv import compact_kv_launch
from .reference import compact_kv as _ref
from .tree import Tree

__all__ = ["compact_kv"]


def _caches(layers: list[torch.Tensor]) -> Caches:
    # a stacked [L, pages, page_size, H_kv, D] cache travels as a one-element list
    return layers[0] if len(layers) == 1 and layers[0].dim() == 5 else layers


def _compact_cuda(k_caches, v_caches, block_table, seq_lens, *rest) -> None:
    accepted, accept_len, out = rest[8:]
    with cuda_device(block_table):
        compact_kv_launch(
            _caches(k_caches), _caches(v_caches), block_table, seq_lens, accepted, accept_len,
            out=out,
        )  # fmt: skip


def _compact_cpu(k_caches, v_caches, block_table, seq_lens, *rest) -> None:
    tree, (accepted, accept_len, out) = Tree(*rest[:8]), rest[8:]
    _ref.compact_kv(
        _caches(k_caches), _caches(v_caches), block_table, seq_lens, tree, accepted, accept_len,
        out=out,
    )  # fmt: skip


_REPLAYS = Replays("compact_kv")
"""Calls per signature replayed without the op's Python layers (``treeops.kernels._replay``)."""

_compact_op = define(
    f"compact_kv(Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor block_table, "
    f"Tensor seq_lens, {TREE}, Tensor accepted, Tensor accept_len, Tensor(c!) out) -> ()",
    cpu=_compact_cpu,
    cuda=_compact_cuda,
)


def compact_kv(
    k_caches: Caches,
    v_caches: Caches,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    tree: Tree,
    accepted: torch.Tensor,
    accept_len: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    validate: bool = False,
) -> torch.Tensor:
    """Compact the accepted path's K/V in place and return the new sequence lengths.

    Node i's K/V was written to slot ``s + i`` (``s = seq_lens[b]``) before verification; the
    node accepted at depth d (``accepted[b, d]``) moves to slot ``s + d`` for every layer and KV
    head, walking the path in increasing depth (safe in place: ``d <= i``, and a later node's
    source is beyond every earlier destination). Nodes already in place are skipped. Slots
    outside ``[s, s + accept_len)`` are untouched.

    Args:
        k_caches, v_caches: [L, num_pages, page_size, H_kv, D] (stacked layers) or a list/tuple of
            L tensors [num_pages, page_size, H_kv, D] of one shape, dtype and strides (any
            floating dtype, any strides). A contiguous cache is one page per request.
        block_table: [B, max_pages] int32, logical page -> physical page (unit stride along
            max_pages; the [B] inputs and ``accepted``'s last dimension need unit stride too).
        seq_lens: [B] int32/int64, tokens in the cache before this step (the tree root's slot).
        tree: the verified ``Tree`` (capacity N).
        accepted, accept_len: from ``accept_greedy`` / ``accept_sample`` ([B, N] int32, [B] int32).
        out: optional [B] int32 for the new lengths.
        validate: check index ranges, page coverage and depths (host syncs).

    Shapes, dtypes, devices and strides are always checked; values are the caller's
    responsibility when ``validate=False``: out-of-range indices (``block_table`` entries outside
    the cache, ``seq_lens + N`` beyond the block table, ``accept_len > N``, ``accepted`` entries
    outside ``[0, N)``) are undefined behaviour (copies outside the cache); ``validate=True``
    checks them (with a host sync).

    Returns:
        ``seq_lens + accept_len`` as [B] int32.

    With a list of layers the kernel reads a device table of layer pointers, built on the first
    call for those tensors and cached (call once before capturing a CUDA graph).

    Example:
        >>> import torch, treeops
        >>> t = treeops.Tree.from_parents(torch.tensor([[-1, 0, 0]], dtype=torch.int32),
        ...                               torch.tensor([3], dtype=torch.int32),
        ...                               torch.tensor([[9, 4, 6]]))
        >>> k = torch.arange(8.).reshape(1, 1, 8, 1, 1); v = -k
        >>> bt = torch.zeros(1, 1, dtype=torch.int32)
        >>> new = treeops.compact_kv(k, v, bt, torch.tensor([4], dtype=torch.int32), t,
        ...                          torch.tensor([[0, 2, -1]], dtype=torch.int32),
        ...                          torch.tensor([2], dtype=torch.int32), validate=True)
        >>> new.tolist(), k.flatten().tolist()
        ([6], [0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 6.0, 7.0])
    """
    key = check_compact_inputs(
        k_caches, v_caches, block_table, seq_lens, tree, accepted, accept_len, out, validate
    )
    tensors = None
    if key is not None and k_caches.__class__ is torch.Tensor:
        # stacked caches only: a list's layers reach the kernel through a table of their
        # pointers, which a replay would pass as recorded
        tensors = (k_caches, v_caches, block_table, seq_lens, accepted, accept_len, out,
                   *tree.tensors())  # fmt: skip
        res = _REPLAYS.run(key, tensors)
        if res is not MISS:
            return res
    else:
        key = None
    if out is None:
        out = torch.empty(seq_lens.shape[0], dtype=torch.int32, device=seq_lens.device)
    layers = [k_caches] if isinstance(k_caches, torch.Tensor) else list(k_caches)
    v_layers = [v_caches] if isinstance(v_caches, torch.Tensor) else list(v_caches)
    args = (layers, v_layers, block_table, seq_lens, *tree.tensors(), accepted, accept_len, out)
    _REPLAYS.call(key, tensors, _compact_op, *args, result=out)
    return out
