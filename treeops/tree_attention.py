"""Tree-masked paged attention (docs/design.md op 1).

``tree_attention`` verifies (all tree nodes as queries) or drafts (the newest frontier) against a
paged KV cache whose first ``seq_lens[b]`` slots are the request's prefix and whose next
``num_nodes[b]`` slots hold the tree's own K/V, written by ``kv_append``. CUDA tensors run the
Triton kernels (``treeops.kernels.tree_attention``); CPU tensors run the PyTorch reference
(``treeops.reference.tree_attention``). It neither syncs with the host nor sizes a launch from
tensor values, so it can be captured in a CUDA graph.

Queries are rotated by the caller (they never reach the cache):
``q = treeops.rope(q, tree.positions(seq_lens))`` before ``tree_attention``.
"""

from __future__ import annotations

import math

import torch

from ._checks import (
    FLOAT_DTYPES,
    Memo,
    check_head_dim,
    check_paged_batch,
    check_range,
    check_same_device,
    check_tensor,
    cuda_device,
    signature,
)
from ._library import TREE, define
from .kernels import tree_attention as _k
from .kernels._replay import MISS, Replays
from .reference import tree_attention as _ref_attn
from .tree import Tree, check_tree

__all__ = ["tree_attention", "tree_attention_workspace"]


def _check_attention(
    q, k_cache, v_cache, block_table, seq_lens, tree, q_start, q_len, sm_scale, out, lse,
    workspace, validate,
) -> dict[str, int]:  # fmt: skip
    tree = check_tree(tree, validate=validate)
    sizes: dict[str, int] = {"B": tree.batch_size, "N": tree.capacity}
    check_tensor("q", q, shape=("B", "N", "H_q", "D"), dtype=FLOAT_DTYPES, sizes=sizes)
    check_head_dim("q", sizes["D"])
    check_tensor(
        "k_cache", k_cache, shape=("P", "page_size", "H_kv", "D"), dtype=q.dtype, sizes=sizes
    )
    check_tensor(
        "v_cache", v_cache, shape=("P", "page_size", "H_kv", "D"), dtype=q.dtype, sizes=sizes
    )
    if sizes["B"] * sizes["H_kv"] > 65535:  # the kernel's grid axis 1 (a CUDA limit)
        raise ValueError(
            f"Invalid shape of k_cache: batch x KV heads = {sizes['B']} x {sizes['H_kv']} "
            "exceeds 65535; split the batch"
        )
    if sizes["H_kv"] < 1 or sizes["H_q"] % sizes["H_kv"] != 0:
        raise ValueError(
            f"Invalid shape of k_cache: H_q = {sizes['H_q']} must be a multiple of "
            f"H_kv = {sizes['H_kv']}"
        )
    check_paged_batch(block_table, seq_lens, sizes)
    if q_start is not None:
        check_tensor(
            "q_start", q_start, shape=("B",), dtype=torch.int32, sizes=sizes, unit_last=True
        )
    if q_len is not None:
        check_tensor("q_len", q_len, shape=("B",), dtype=torch.int32, sizes=sizes, unit_last=True)
    if out is not None:
        check_tensor("out", out, shape=("B", "N", "H_q", "D"), dtype=q.dtype, sizes=sizes)
    if lse is not None:
        check_tensor("lse", lse, shape=("B", "N", "H_q"), dtype=torch.float32, sizes=sizes)
    if workspace is not None:
        check_tensor("workspace", workspace, shape=(None,), dtype=torch.float32, contiguous=True)
    if sm_scale is not None and not (
        isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale) and sm_scale > 0
    ):
        raise ValueError(f"Invalid value of sm_scale: expected a positive float, got {sm_scale!r}")
    check_same_device(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table,
        seq_lens=seq_lens,
        tree=tree.parents,
        q_start=q_start,
        q_len=q_len,
        out=out,
        lse=lse,
        workspace=workspace,
    )
    if validate:
        capacity = block_table.shape[1] * sizes["page_size"]
        check_range("seq_lens", seq_lens, 0, None)
        check_range("block_table", block_table, 0, sizes["P"])
        if int((seq_lens.long() + tree.num_nodes.long()).max()) > capacity:
            raise ValueError(
                f"Invalid value in seq_lens: seq_lens + num_nodes exceeds the "
                f"block table's capacity of {capacity} slots"
            )
        if q_start is not None:
            check_range("q_start", q_start, 0, sizes["N"] + 1)
        if q_len is not None:
            check_range("q_len", q_len, 0, sizes["N"] + 1)
    return sizes


def _tree_attention_cuda(q, k_cache, v_cache, block_table, seq_lens, *rest):
    # rest: the tree's fields (Tree.FIELDS order: num_nodes 2nd, anc 4th), then the options
    q_start, q_len, scale, out, lse, workspace = rest[8:]
    with cuda_device(q):
        _k.tree_attention_fwd(
            q, k_cache, v_cache, block_table, seq_lens, rest[2], rest[4], q_start, q_len,
            scale, out, lse, workspace,
        )  # fmt: skip


def _tree_attention_cpu(q, k_cache, v_cache, block_table, seq_lens, *rest):
    tree, (q_start, q_len, scale, out, lse, _workspace) = Tree(*rest[:8]), rest[8:]
    _ref_attn.tree_attention(
        q, k_cache, v_cache, block_table, seq_lens, tree, q_start, q_len, sm_scale=scale,
        return_lse=lse is not None, out=out, lse=lse,
    )  # fmt: skip


_PASSED = Memo()
"""Signatures of calls whose checks passed (with ``validate=False``) -> the default scale."""
_REPLAYS = Replays("tree_attention")
"""Calls per signature replayed without the op's Python layers (``treeops.kernels._replay``)."""

_tree_attention_op = define(
    f"tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
    f"Tensor seq_lens, {TREE}, Tensor? q_start, Tensor? q_len, float sm_scale, Tensor(a!) out, "
    f"Tensor(b!)? lse, Tensor(c!)? workspace) -> ()",
    cpu=_tree_attention_cpu,
    cuda=_tree_attention_cuda,
)


def tree_attention_workspace(
    q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor
) -> torch.Tensor:
    """Allocate the split-KV workspace ``tree_attention`` needs for these capacities.

    Its size depends only on shapes and the device (B, N, H_q, D, H_kv, block-table capacity, SM
    count), so one allocation serves every step; pass it as ``workspace=`` to keep allocations off
    the hot path (and out of a CUDA graph). fp32, 1-D, possibly empty.
    """
    if q.device.type != "cuda":
        return torch.zeros(0, dtype=torch.float32, device=q.device)
    B, N, H_q, D = q.shape
    cfg = _k.config_for(q, k_cache, block_table)
    return torch.zeros(_k.workspace_numel(B, N, H_q, D, cfg), dtype=torch.float32, device=q.device)


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    tree: Tree,
    q_start: torch.Tensor | None = None,
    q_len: torch.Tensor | None = None,
    *,
    sm_scale: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    validate: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of tree nodes over their request's prefix and their tree ancestors.

    Args:
        q: [B, N, H_q, D] fp16/bf16/fp32 (fp32 is computed with IEEE dots), any strides; row i is
            tree node i, already rotated by RoPE (``rope``). D in {64, 128, 256}.
        k_cache, v_cache: [num_pages, page_size, H_kv, D], q's dtype, any strides; any page size
            (a contiguous cache is one page per request). Slots ``0 .. seq_lens[b]-1`` of request
            b hold its prefix, slot ``seq_lens[b] + j`` tree node j (``kv_append`` puts it there).
        block_table: [B, max_pages] int32 (unit stride along max_pages), page ids of each
            request's logical pages; it must cover ``seq_lens[b] + num_nodes[b]`` slots.
        seq_lens: [B] int32 or int64, prefix length of each request (unit stride, as every
            [B] input).
        tree: the ``Tree`` (``num_nodes`` and ``anc`` are read). H_q must be a multiple of H_kv;
            query head h reads KV head ``h // (H_q // H_kv)``. B x H_kv <= 65535 (a grid axis
            of the GPU kernel; checked on every device, so that a CPU run fails as a GPU one would).
        q_start, q_len: [B] int32 (default 0 and N): the query nodes of request b are
            ``q_start[b] .. q_start[b] + q_len[b] - 1`` (and ``< num_nodes[b]``).
        sm_scale: softmax scale, default ``1 / sqrt(D)``.
        return_lse: also return the LSE, [B, N, H_q] fp32, natural log.
        out, lse: optional output buffers of those shapes ([B, N, H_q, D] q's dtype, any strides).
        workspace: optional fp32 split-KV scratch from ``tree_attention_workspace`` (contiguous).
        validate: also check value ranges and the tree's invariants (syncs with the host).

    Shapes, dtypes, devices and strides are always checked; values are the caller's
    responsibility when ``validate=False``: out-of-range indices (``block_table`` entries outside
    the cache, ``seq_lens + num_nodes`` beyond the block table, ``num_nodes > N``, ``q_start`` /
    ``q_len`` beyond N) are undefined behaviour; ``validate=True`` checks them (with a host sync).

    Query node i sees every prefix key and tree key j iff ``j < num_nodes[b]`` and bit j of
    ``tree.anc[b, i]`` (ancestor-or-self). Rows outside the query range, padding nodes and rows
    that see no key are 0 with LSE = -inf. No host sync; launch shapes depend only on capacities.

    Returns:
        ``out``, or ``(out, lse)`` if ``return_lse``.

    Example:
        >>> import torch, treeops
        >>> tree = treeops.Tree.from_parents(torch.tensor([[-1, 0, 0, 1]], dtype=torch.int32),
        ...                                  torch.tensor([4], dtype=torch.int32),
        ...                                  torch.tensor([[7, 3, 5, 2]]))
        >>> k_cache = torch.randn(2, 16, 2, 64); v_cache = torch.randn(2, 16, 2, 64)
        >>> block_table = torch.tensor([[1, 0]], dtype=torch.int32)
        >>> seq_lens = torch.tensor([10], dtype=torch.int32)
        >>> q = torch.randn(1, 4, 8, 64)
        >>> out, lse = treeops.tree_attention(q, k_cache, v_cache, block_table, seq_lens, tree,
        ...                                   return_lse=True, validate=True)
        >>> out.shape, lse.shape
        (torch.Size([1, 4, 8, 64]), torch.Size([1, 4, 8]))
    """
    key = tensors = None
    if not validate:
        fields = tree.tensors() if isinstance(tree, Tree) else (tree,)
        tensors = (q, k_cache, v_cache, block_table, seq_lens, q_start, q_len, out, lse,
                   workspace, *fields)  # fmt: skip
        key = signature(tensors, (sm_scale, return_lse))
        res = _REPLAYS.run(key, tensors)
        if res is not MISS:
            return res
    passed = _PASSED.get(key)
    if passed is None:
        sizes = _check_attention(
            q, k_cache, v_cache, block_table, seq_lens, tree, q_start, q_len, sm_scale, out, lse,
            workspace, validate,
        )  # fmt: skip
        if workspace is not None and q.is_cuda:
            B, N, H_q, D = q.shape
            need = _k.workspace_numel(B, N, H_q, D, _k.config_for(q, k_cache, block_table))
            if workspace.numel() < need:
                raise ValueError(
                    f"Invalid shape of workspace: expected at least [{need}] "
                    f"(tree_attention_workspace), got {list(workspace.shape)}"
                )
        passed = 1.0 / math.sqrt(sizes["D"])
        _PASSED.put(key, passed)
    scale = passed if sm_scale is None else float(sm_scale)
    if out is None or (lse is None and return_lse):
        B, N, H_q, D = q.shape  # sizes as ints: torch.empty parses them faster than a Size
        if out is None:
            out = torch.empty(B, N, H_q, D, dtype=q.dtype, device=q.device)
        if lse is None and return_lse:
            lse = torch.empty(B, N, H_q, dtype=torch.float32, device=q.device)
    args = (q, k_cache, v_cache, block_table, seq_lens, *tree.tensors(), q_start, q_len, scale,
            out, lse, workspace)  # fmt: skip
    result = (out, lse) if return_lse else out
    _REPLAYS.call(key, tensors, _tree_attention_op, *args, result=result)
    return result
