"""``graft_tail``'s kernel: a chain of table successors below each request's best leaf
(launched by ``treeops.graft_tail``; the reference is ``treeops.reference.graft.graft_tail``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeops._runtime import pow2
from treeops.tree import Tree

from ._launch import direct
from ._pdl import pdl_enter, pdl_options
from .graft import _contig_fields


@triton.jit(do_not_specialize=["N", "V", "budget_val", "count_val"])
def _graft_tail_kernel(
    # input tree, contiguous [B, N] / [B, N, W]
    tok_ptr,
    par_ptr,
    num_ptr,
    dep_ptr,
    anc_ptr,
    fc_ptr,
    ns_ptr,
    sc_ptr,
    # output tree
    o_tok_ptr,
    o_par_ptr,
    o_num_ptr,
    o_dep_ptr,
    o_anc_ptr,
    o_fc_ptr,
    o_ns_ptr,
    o_sc_ptr,
    table_ptr,  # [V, K] int32
    budget_ptr,
    budget_val,
    count_ptr,
    count_val,
    N,
    V,
    K: tl.constexpr,
    W: tl.constexpr,
    NB: tl.constexpr,
    WB: tl.constexpr,
    G: tl.constexpr,  # the most chain nodes a request can get (a bound of count)
    BUDGET_T: tl.constexpr,
    COUNT_T: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """One program per request: the tree copied to the output, then below its best leaf (the
    highest score among nodes without a child, the lowest index on ties) a chain of up to
    ``count`` nodes, each ``table[token above, 0]``, while the request holds fewer than
    ``min(budget, N)`` nodes."""
    pdl_enter(PDL)
    i_b = tl.program_id(0).to(tl.int64)
    o_n = tl.arange(0, NB)
    o_w = tl.arange(0, WB)
    m_n = o_n < N
    p_row = i_b * N + o_n
    p_arow = i_b * N * W + o_n[:, None] * W + o_w[None, :]
    m_aw = m_n[:, None] & (o_w[None, :] < W)
    b_tok = tl.load(tok_ptr + p_row, mask=m_n, other=0)
    b_fc = tl.load(fc_ptr + p_row, mask=m_n, other=-1)
    b_sc = tl.load(sc_ptr + p_row, mask=m_n, other=0.0)
    # 1. the tree as it is (padding included: a new node's slot holds a padding node's links)
    tl.store(o_tok_ptr + p_row, b_tok, mask=m_n)
    tl.store(o_par_ptr + p_row, tl.load(par_ptr + p_row, mask=m_n, other=-1), mask=m_n)
    tl.store(o_dep_ptr + p_row, tl.load(dep_ptr + p_row, mask=m_n, other=0), mask=m_n)
    tl.store(o_fc_ptr + p_row, b_fc, mask=m_n)
    tl.store(o_ns_ptr + p_row, tl.load(ns_ptr + p_row, mask=m_n, other=-1), mask=m_n)
    tl.store(o_sc_ptr + p_row, b_sc, mask=m_n)
    tl.store(o_anc_ptr + p_arow, tl.load(anc_ptr + p_arow, mask=m_aw, other=0), mask=m_aw)
    if BUDGET_T:
        cap = tl.load(budget_ptr + i_b)
    else:
        cap = budget_val + tl.zeros([], tl.int32)
    cap = tl.minimum(tl.maximum(cap, 0), N)
    if COUNT_T:
        want = tl.load(count_ptr + i_b)
    else:
        want = count_val + tl.zeros([], tl.int32)
    n = tl.load(num_ptr + i_b)
    room = tl.where((n > 0) & (n <= cap), tl.minimum(tl.maximum(want, 0), cap - n), 0)
    # 2. the best leaf: a valid node without a first child
    m_leaf = (o_n < n) & (b_fc < 0)
    best = tl.max(tl.where(m_leaf, b_sc, -float("inf")))
    a = tl.min(tl.where(m_leaf & (b_sc == best), o_n, NB))
    a = tl.minimum(a, N - 1)  # (no leaf: room is 0, nothing below is stored)
    above_tok = tl.sum(tl.where(o_n == a, b_tok, 0))
    dep = tl.load(dep_ptr + i_b * N + a)
    b_row = tl.load(anc_ptr + i_b * N * W + a * W + o_w, mask=o_w < W, other=0)
    tl.debug_barrier()  # step 1's writes land before the chain's rewrite of some of them
    # 3. the chain: each slot written once (a new node's first child and sibling stay -1, the
    # padding's; the node above gets the new node as its only child)
    above = a
    got = tl.zeros([], tl.int32)
    alive = room > 0
    for i in tl.static_range(G):
        ok_tok = (above_tok >= 0) & (above_tok < V)
        nt = tl.load(table_ptr + above_tok * K, mask=alive & (i < room) & ok_tok, other=-1)
        alive = alive & (i < room) & ok_tok & (nt >= 0) & (nt < V)
        idx = n + i
        b_row = b_row | tl.where(o_w == idx // 32, 1 << (idx % 32), 0)
        p_new = i_b * N + idx
        tl.store(o_tok_ptr + p_new, nt.to(tl.int64), mask=alive)
        tl.store(o_par_ptr + p_new, above.to(tl.int32), mask=alive)
        tl.store(o_dep_ptr + p_new, dep + 1 + i, mask=alive)
        tl.store(o_sc_ptr + p_new, 0.0, mask=alive)
        tl.store(o_anc_ptr + i_b * N * W + idx * W + o_w, b_row, mask=(o_w < W) & alive)
        tl.store(o_fc_ptr + i_b * N + above, idx, mask=alive)
        got += alive.to(tl.int32)
        above = tl.where(alive, idx, above)
        above_tok = tl.where(alive, nt.to(tl.int64), above_tok)
    tl.store(o_num_ptr + i_b, n + got)


def graft_tail(
    tree,
    table: torch.Tensor,
    count: torch.Tensor | int,
    budget: torch.Tensor | int,
    max_count: int,
    out: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, ...]:
    """The tree with a chain of up to ``count`` table successors below each request's best leaf
    (``_graft_tail_kernel``), into ``out`` when given; ``max_count`` bounds ``count`` (the
    kernel's unrolled loop). Returns the output tree's fields in ``Tree`` order."""
    _contig_fields("tree", tree.tensors())
    B, N = tree.parents.shape
    W = tree.anc.shape[2]
    dev = tree.parents.device
    if out is None:
        out = Tree.uninitialized(B, N, dev).tensors()
    _contig_fields("out", tuple(out))
    V, K = table.shape
    budget_t = isinstance(budget, torch.Tensor)
    count_t = isinstance(count, torch.Tensor)
    NB = max(pow2(N), 2)
    direct(_graft_tail_kernel).launch(
        (B,),
        *tree.tensors(),
        *out,
        table,
        budget if budget_t else tree.num_nodes,
        0 if budget_t else int(budget),
        count if count_t else tree.num_nodes,
        0 if count_t else int(count),
        N,
        V,
        K=K,
        W=W,
        NB=NB,
        WB=max(pow2(W), 2),
        G=max(1, min(int(max_count), N)),
        BUDGET_T=budget_t,
        COUNT_T=count_t,
        **pdl_options(table.device),
        num_warps=4 if NB >= 128 else 2,
    )
    return out
