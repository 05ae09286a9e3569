"""Graft's pruning kernels: ``prune`` (keep the root and the first ``keep[b]`` draft nodes of each
request) and the checkpoint rule (``PruneCheckpoints.check``), one launch each.

``_prune_kernel``: one program per request. Nodes are in rank order and ancestor-closed, so the
kept nodes are the prefix ``[0, num)``, ``num = min(num_nodes, min(keep, N - 1) + 1)`` for an
active request (an inactive one, ``num_nodes <= 0``, keeps its count). Their tokens, parents,
depth, ``anc`` rows and scores are unchanged (a prefix keeps every ancestor); a sibling link that
points past the prefix becomes -1 (children and siblings are linked in increasing index, so the
first link past ``num`` ends the list). Padding past ``num`` gets the padding values. Only the
kept prefix is read.

``_checkpoint_kernel``: one program per block of requests: an unmarked request (``keep >=
NO_PRUNE``) whose best score is under the threshold gets ``keep_value``; every request's ``stop``
is ``keep < NO_PRUNE`` afterwards. A threshold of -inf updates nothing (a step that is no
checkpoint).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeops._runtime import cdiv, pow2

from ._launch import direct
from ._pdl import pdl_enter, pdl_options

NO_PRUNE = 1 << 30
_NO_PRUNE = tl.constexpr(NO_PRUNE)

MAX_BLOCK = 1024
"""Nodes (and ``anc`` words) per tile of the prune kernel; larger trees loop over tiles."""


@triton.jit
def _prune_kernel(
    tok_ptr,
    par_ptr,
    num_ptr,
    dep_ptr,
    anc_ptr,
    fc_ptr,
    ns_ptr,
    sc_ptr,
    keep_ptr,
    keep_int,
    o_tok_ptr,
    o_par_ptr,
    o_num_ptr,
    o_dep_ptr,
    o_anc_ptr,
    o_fc_ptr,
    o_ns_ptr,
    o_sc_ptr,
    N,
    W: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_A: tl.constexpr,
    KEEP_T: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    pdl_enter(PDL)
    i_b = tl.program_id(0).to(tl.int64)
    nn = tl.load(num_ptr + i_b)
    if KEEP_T:
        k = tl.minimum(tl.load(keep_ptr + i_b), N - 1)
    else:
        k = keep_int + tl.zeros([], tl.int32)  # the host capped it at N - 1
    num = tl.where(nn > 0, tl.minimum(nn, k + 1), nn)
    tl.store(o_num_ptr + i_b, num)
    row = i_b * N
    for start in range(0, N, BLOCK):
        o_i = start + tl.arange(0, BLOCK)
        m_in = o_i < N
        m_v = m_in & (o_i < num)
        p = row + o_i
        tl.store(o_tok_ptr + p, tl.load(tok_ptr + p, mask=m_v, other=0), mask=m_in)
        tl.store(o_par_ptr + p, tl.load(par_ptr + p, mask=m_v, other=-1), mask=m_in)
        tl.store(o_dep_ptr + p, tl.load(dep_ptr + p, mask=m_v, other=0), mask=m_in)
        tl.store(o_sc_ptr + p, tl.load(sc_ptr + p, mask=m_v, other=0.0), mask=m_in)
        b_fc = tl.load(fc_ptr + p, mask=m_v, other=-1)
        tl.store(o_fc_ptr + p, tl.where(b_fc < num, b_fc, -1), mask=m_in)
        b_ns = tl.load(ns_ptr + p, mask=m_v, other=-1)
        tl.store(o_ns_ptr + p, tl.where(b_ns < num, b_ns, -1), mask=m_in)
    # anc: row b is N * W contiguous words, word e belongs to node e // W
    row_a = row * W
    for start in range(0, N * W, BLOCK_A):
        o_e = start + tl.arange(0, BLOCK_A)
        m_in = o_e < N * W
        m_v = m_in & (o_e // W < num)
        p = row_a + o_e
        tl.store(o_anc_ptr + p, tl.load(anc_ptr + p, mask=m_v, other=0), mask=m_in)


@triton.jit(do_not_specialize=["B", "keep_value"])
def _checkpoint_kernel(
    keep_ptr,
    best_ptr,
    stop_ptr,
    B,
    keep_value,
    threshold,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    pdl_enter(PDL)
    o_b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o_b < B
    b_keep = tl.load(keep_ptr + o_b, mask=m, other=0)
    b_best = tl.load(best_ptr + o_b, mask=m, other=0.0)
    hit = m & (b_keep >= _NO_PRUNE) & (b_best < threshold)
    b_keep = tl.where(hit, keep_value, b_keep)
    tl.store(keep_ptr + o_b, b_keep, mask=hit)
    tl.store(stop_ptr + o_b, b_keep < _NO_PRUNE, mask=m)


# ---------------------------------------------------------------------------- launchers


def _num_warps(block: int) -> int:
    return 4 if block >= 512 else 2 if block >= 128 else 1


def prune(
    tree: tuple[torch.Tensor, ...],
    keep: torch.Tensor | None,
    keep_int: int,
    out: tuple[torch.Tensor, ...],
) -> None:
    """Write the pruned tree into ``out``.

    ``tree``, ``out``: a tree's 8 fields in ``Tree.FIELDS`` order (tokens [B, N] int64, parents
    [B, N] int32, num_nodes [B] int32, depth [B, N] int32, anc [B, N, W] int32, first_child and
    next_sibling [B, N] int32, scores [B, N] float32), contiguous, ``out`` not aliasing
    ``tree``. ``keep``: [B] int32 (unit stride) or None, then ``keep_int`` >= 0 for every
    request."""
    tok, par, num, dep, anc, fc, ns, sc = tree
    B, N = par.shape
    W = anc.shape[2]
    block = min(pow2(N), MAX_BLOCK)
    block_a = min(pow2(N * W), MAX_BLOCK)
    keep_t = keep is not None
    direct(_prune_kernel).launch(
        (B,),
        tok, par, num, dep, anc, fc, ns, sc,
        keep if keep_t else num,
        0 if keep_t else min(keep_int, N - 1),
        *out,
        N,
        W=W,
        BLOCK=block,
        BLOCK_A=block_a,
        KEEP_T=keep_t,
        **pdl_options(tok.device), num_warps=_num_warps(max(block, block_a)),
    )  # fmt: skip


def checkpoint(
    keep: torch.Tensor,
    best_score: torch.Tensor,
    keep_value: int,
    threshold: float,
    stop: torch.Tensor,
) -> None:
    """``keep`` [B] int32 (updated in place), ``best_score`` [B] float32, ``stop`` [B] bool
    (written), all unit-stride; ``threshold`` -inf marks nothing."""
    B = keep.shape[0]
    if B == 0:
        return
    block = min(max(pow2(B), 32), MAX_BLOCK)
    direct(_checkpoint_kernel).launch(
        (cdiv(B, block),), keep, best_score, stop, B, keep_value, threshold, BLOCK=block,
        **pdl_options(keep.device), num_warps=1 if block <= 128 else 4,
    )  # fmt: skip
