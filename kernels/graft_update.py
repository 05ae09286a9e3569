"""Graft's adjacency-table update kernels (launched by ``treeops.kernels.graft.adjacency_update``).

``_topk_partial_kernel``, grid (nodes, splits): each program streams its slice of V and keeps a
running top-k (value desc, id asc); split 0 also claims the node's token with
``atomic_min(owner[token], claim)``. ``_claim_kernel``: the claims alone (top-k ids given).
``_update_write_kernel``, grid (node blocks): merges the splits' lists (or reads the given ids),
and the node whose claim equals ``owner[token]`` writes the row and resets the owner to
INT32_MAX. A claim is the flattened node index (the lowest wins), or its mirror ``n_flat - 1 -
index`` when the last one wins.
"""

from __future__ import annotations

import triton
import triton.language as tl

_BIG = tl.constexpr(1 << 30)
_I32MAX = tl.constexpr(2**31 - 1)


@triton.jit(do_not_specialize=["N", "V", "n_flat", "chunk", "stride_b", "stride_n"])
def _topk_partial_kernel(
    x_ptr,
    tok_ptr,
    num_ptr,
    owner_ptr,
    ws_val_ptr,
    ws_id_ptr,
    N,
    V,
    n_flat,
    chunk,
    stride_b,
    stride_n,
    K: tl.constexpr,
    KB: tl.constexpr,
    S: tl.constexpr,
    BLOCK_V: tl.constexpr,
    LAST_WINS: tl.constexpr,
):
    i_f = tl.program_id(0).to(tl.int64)  # flattened node b*N + i
    i_s = tl.program_id(1)
    i_b = i_f // N
    i_n = i_f % N
    tok = tl.load(tok_ptr + i_f)
    valid = (i_n < tl.load(num_ptr + i_b)) & (tok >= 0) & (tok < V)
    if valid:
        if i_s == 0:
            if LAST_WINS:
                claim = (n_flat - 1 - i_f).to(tl.int32)
            else:
                claim = i_f.to(tl.int32)
            tl.atomic_min(owner_ptr + tok, claim)
        o_k = tl.arange(0, KB)
        # running top-k: empty slots are (-inf, _BIG + slot), beaten by any element
        b_rv = tl.full([KB], float("-inf"), tl.float32)
        b_ri = _BIG + o_k
        p_x = x_ptr + i_b * stride_b + i_n * stride_n
        lo = i_s * chunk
        hi = tl.minimum(lo + chunk, V)
        for start in range(lo, hi, BLOCK_V):
            o_v = start + tl.arange(0, BLOCK_V)
            m_v = o_v < hi
            b_x = tl.load(p_x + o_v, mask=m_v, other=float("-inf")).to(tl.float32)
            # the running list's worst entry (value asc, id desc) and the block's best
            wv = tl.min(tl.where(o_k < K, b_rv, float("inf")), 0)
            wi = tl.max(tl.where((o_k < K) & (b_rv == wv), b_ri, -1), 0)
            bv = tl.max(tl.where(m_v, b_x, float("-inf")), 0)
            bi = tl.min(tl.where(m_v & (b_x == bv), o_v, _I32MAX), 0)
            beats = (bv > wv) | ((bv == wv) & (bi < wi))
            while beats:
                b_rv = tl.where(b_ri == wi, bv, b_rv)
                b_ri = tl.where(b_ri == wi, bi, b_ri)
                m_v = m_v & (o_v != bi)
                wv = tl.min(tl.where(o_k < K, b_rv, float("inf")), 0)
                wi = tl.max(tl.where((o_k < K) & (b_rv == wv), b_ri, -1), 0)
                bv = tl.max(tl.where(m_v, b_x, float("-inf")), 0)
                bi = tl.min(tl.where(m_v & (b_x == bv), o_v, _I32MAX), 0)
                beats = (bv > wv) | ((bv == wv) & (bi < wi))
        p_ws = (i_f * S + i_s) * KB + o_k
        tl.store(ws_val_ptr + p_ws, b_rv)
        tl.store(ws_id_ptr + p_ws, b_ri)


@triton.jit(do_not_specialize=["N", "n_flat"])
def _claim_kernel(
    tok_ptr, num_ptr, owner_ptr, N, V, n_flat, BLOCK: tl.constexpr, LAST_WINS: tl.constexpr
):
    o_f = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_f = o_f < n_flat
    tok = tl.load(tok_ptr + o_f, mask=m_f, other=-1)
    num = tl.load(num_ptr + o_f // N, mask=m_f, other=0)
    valid = m_f & (o_f % N < num) & (tok >= 0) & (tok < V)
    if LAST_WINS:
        claim = (n_flat - 1 - o_f).to(tl.int32)
    else:
        claim = o_f.to(tl.int32)
    tl.atomic_min(owner_ptr + tok, claim, mask=valid)


@triton.jit(do_not_specialize=["N", "V", "n_flat", "k_ids", "stride_ib", "stride_in", "n_cand"])
def _update_write_kernel(
    tok_ptr,
    num_ptr,
    owner_ptr,
    table_ptr,
    ws_val_ptr,
    ws_id_ptr,
    ids_ptr,
    N,
    V,
    n_flat,
    k_ids,
    stride_ib,
    stride_in,
    n_cand,
    K: tl.constexpr,
    KB: tl.constexpr,
    C: tl.constexpr,
    BLOCK_M: tl.constexpr,
    FROM_LOGITS: tl.constexpr,
    LAST_WINS: tl.constexpr,
):
    o_f = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [M] flat nodes
    m_f = o_f < n_flat
    tok = tl.load(tok_ptr + o_f, mask=m_f, other=-1)
    num = tl.load(num_ptr + o_f // N, mask=m_f, other=0)
    valid = m_f & (o_f % N < num) & (tok >= 0) & (tok < V)
    if LAST_WINS:
        claim = (n_flat - 1 - o_f).to(tl.int32)
    else:
        claim = o_f.to(tl.int32)
    owner = tl.load(owner_ptr + tok, mask=valid, other=-1)
    win = valid & (owner == claim)
    o_k = tl.arange(0, KB)
    if FROM_LOGITS:
        # merge the splits' lists: n_cand = S * KB candidates per node, C its power of two
        o_c = tl.arange(0, C)
        p_c = o_f[:, None] * n_cand + o_c[None, :]
        m_c = win[:, None] & (o_c[None, :] < n_cand)
        b_v = tl.load(ws_val_ptr + p_c, mask=m_c, other=float("-inf"))  # [M, C]
        b_i = tl.load(ws_id_ptr + p_c, mask=m_c, other=_BIG)
        m_alive = b_i < V
        b_row = tl.full([BLOCK_M, KB], -1, tl.int32)
        for r in tl.static_range(K):
            bv = tl.max(tl.where(m_alive, b_v, float("-inf")), axis=1)
            bi = tl.min(tl.where(m_alive & (b_v == bv[:, None]), b_i, _I32MAX), axis=1)
            b_row = tl.where(o_k[None, :] == r, tl.where(bi < V, bi, -1)[:, None], b_row)
            m_alive = m_alive & (b_i != bi[:, None])
    else:
        p_i = o_f[:, None] // N * stride_ib + o_f[:, None] % N * stride_in + o_k[None, :]
        b_row = tl.load(ids_ptr + p_i, mask=win[:, None] & (o_k[None, :] < k_ids), other=-1)
    m_w = win[:, None] & (o_k[None, :] < K)
    tl.store(table_ptr + tok[:, None] * K + o_k[None, :], b_row, mask=m_w)
    tl.store(owner_ptr + tok, tl.full([BLOCK_M], _I32MAX, tl.int32), mask=win)
