"""Graft kernels: fused retrieve + trie merge + rebuild, retrieval alone, and the table update.

``_graft_kernel``: one program per request walks the retrieved tree one depth at a time (at most
9 for the default template); breadth-first order makes each depth a contiguous range of retrieved
nodes, processed in tiles of LB (the template's widest depth, 16 by default). Per depth, three
passes separated by barriers, with per-node state (merged index, token, anc row) in a small
scratch buffer so that a parent's values are plain gathers: (1) the node's token (template mode:
``table[parent token, rank]``, up to ``count``) and a draft child of its merged parent with the
same token ([LB, 32] compares); (2) among the rest, the first node of the depth with the same
merged parent and token becomes a new node, numbered in order by a cumsum and kept while under
the budget; (3) repeats take that node's index, and the anc row is the parent's row | own bit.
Because nodes go in breadth-first order this equals the reference's serial loop. Then draft nodes,
new nodes (scattered to their index) and padding are written, and the links are computed from the
written parents in [NB, 32] tiles.

``adjacency_update``: stage 1, grid (nodes, splits of V, about 32 one-warp programs per SM): each
program streams its chunk of V once and keeps a running top-k of integer order keys (value desc,
id asc: ``graft_update``); a block enters the running list only while its best key beats the
list's worst, so most blocks cost one max. Split 0 also claims the node's token with
``atomic_min(owner[token], flat index)``. Stage 2, grid (node blocks): merge the splits' lists,
and the node whose index equals ``owner[token]`` writes the row and resets the owner to INT32_MAX
(losers read either their winner's index or INT32_MAX, never their own), so the owner buffer is
all INT32_MAX again after every update and no host sync or memset is needed. With ``topk_ids``
stage 1 only claims. By default (``UPDATE_TUNING["block_max"]``: 64 or 128 logits by vocabulary;
0 takes the lists above) stage 1 keeps a max per block of logits instead of a list, and stage 2
(one program per node) ranks the blocks and rereads the best (``graft_update``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeops import _runtime
from treeops._runtime import cdiv, interpreted, pow2
from treeops.tree import Tree

from ._launch import direct, scratch
from ._pdl import use_pdl
from .graft_update import (
    _block_max_kernel,
    _block_top_kernel,
    _claim_kernel,
    _topk_partial_kernel,
    _update_write_kernel,
)

INT32_MAX = 2**31 - 1
_BIG = tl.constexpr(1 << 30)
_I32MAX = tl.constexpr(INT32_MAX)


@triton.jit
def _draft_match(
    par_ptr,
    tok_ptr,
    row,
    n_draft,
    b_pk,
    b_t32,
    LB: tl.constexpr,
    NB: tl.constexpr,
    CN: tl.constexpr,
):
    """Per retrieved node: the draft child (index < n_draft) of merged node ``b_pk`` carrying
    token ``b_t32``, or _BIG; draft nodes read in [LB, CN] tiles."""
    b_dm = tl.full([LB], _BIG, tl.int32)
    for c in tl.static_range(0, NB, CN):
        o_c = c + tl.arange(0, CN)
        m_c = (o_c < n_draft) & (o_c > 0)
        b_cpar = tl.load(par_ptr + row + o_c, mask=m_c, other=-2)  # [CN]
        b_ctok = tl.load(tok_ptr + row + o_c, mask=m_c, other=0).to(tl.int32)
        m_dm = (b_cpar[None, :] == b_pk[:, None]) & (b_ctok[None, :] == b_t32[:, None])
        b_dm = tl.minimum(b_dm, tl.min(tl.where(m_dm, o_c[None, :], _BIG), axis=1))
    return b_dm


@triton.jit
def _cmp_key(m_un, b_pk, b_t32):
    """(merged parent, token) packed in an int64 for nodes still unmatched, else -1."""
    return tl.where(m_un, (b_pk.to(tl.int64) << 32) | (b_t32.to(tl.int64) & 0xFFFFFFFF), -1)


@triton.jit
def _retrieve_match(
    o_l,
    m_l,
    n_got,
    req,
    K: tl.constexpr,
    TB: tl.constexpr,
    LB: tl.constexpr,
    NB: tl.constexpr,
    CN: tl.constexpr,
    FROM_TABLE: tl.constexpr,
):
    """Pass 1 for retrieved nodes ``o_l`` [LB]: the parent (clamped), its merged node, the token
    (template: ``table[parent token, rank]`` while under ``limit``, stored to the scratch), and
    the draft child to reuse. Returns (parent, merged parent, live, draft match, unmatched,
    compare key, n_got). ``req``: the request's fixed inputs, as ``_graft_kernel`` packs them."""
    i_b, n_draft, active, limit, tok_ptr, par_ptr, table_ptr, t_par_ptr, t_rank_ptr, r_tok_ptr, \
        r_par_ptr, p_key, p_tok, N, T, V = req  # fmt: skip
    if FROM_TABLE:
        b_par = tl.load(t_par_ptr + o_l, mask=m_l, other=0)
    else:
        b_par = tl.load(r_par_ptr + i_b * T + o_l, mask=m_l, other=0)
    b_pp = tl.minimum(tl.maximum(b_par, 0), TB - 1)
    b_pk = tl.load(p_key + b_pp, mask=m_l, other=-1)
    if FROM_TABLE:
        b_rank = tl.load(t_rank_ptr + o_l, mask=m_l, other=0)
        b_ptok = tl.load(p_tok + b_pp, mask=m_l, other=-1)
        m_look = m_l & (b_ptok >= 0) & (b_ptok < V)
        b_nt = tl.load(table_ptr + b_ptok * K + b_rank, mask=m_look, other=-1)
        m_got = m_look & (b_nt >= 0) & (b_nt < V)
        m_got = m_got & (n_got + tl.cumsum(m_got.to(tl.int32), 0) <= limit)
        n_got += tl.sum(m_got.to(tl.int32), 0)
        b_tok = tl.where(m_got, b_nt, -1).to(tl.int64)
        tl.store(p_tok + o_l, b_tok, mask=m_l)
    else:
        b_tok = tl.load(r_tok_ptr + i_b * T + o_l, mask=m_l, other=-1)
        m_got = m_l
    m_live = m_got & (b_pk >= 0) & active
    # tokens compared as int32: vocabularies are < 2**31
    b_t32 = b_tok.to(tl.int32)
    b_dm = _draft_match(par_ptr, tok_ptr, i_b * N, n_draft, b_pk, b_t32, LB, NB, CN)
    m_un = m_live & (b_dm == _BIG)
    b_cmp = _cmp_key(m_un, b_pk, b_t32)
    return b_pp, b_pk, m_live, b_dm, m_un, b_cmp, n_got


@triton.jit(do_not_specialize=["N", "T", "V", "max_depth", "budget_val", "count_val"])
def _graft_kernel(
    # input tree, contiguous [B, N] / [B, N, W]
    tok_ptr,
    par_ptr,
    num_ptr,
    dep_ptr,
    anc_ptr,
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
    budget_ptr,
    budget_val,
    count_ptr,
    count_val,
    # template mode: table [V, K] and the template [T]
    table_ptr,
    t_par_ptr,
    t_rank_ptr,
    t_dep_ptr,
    # loaded mode: retrieved [B, T]
    r_tok_ptr,
    r_par_ptr,
    r_dep_ptr,
    r_num_ptr,
    # scratch per request: int32 [5, TB] (key, canon, parent key, new, -), int64 [2, TB]
    # (token, compare key), int32 [TB, WB] anc rows
    ws_i_ptr,
    ws_l_ptr,
    ws_anc_ptr,
    N,
    T,
    V,
    max_depth,
    K: tl.constexpr,
    W: tl.constexpr,
    NB: tl.constexpr,
    TB: tl.constexpr,
    WB: tl.constexpr,
    LB: tl.constexpr,
    CN: tl.constexpr,
    FROM_TABLE: tl.constexpr,
    BUDGET_T: tl.constexpr,
    COUNT_T: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    o_n = tl.arange(0, NB)  # [NB] output / draft node index
    o_j = tl.arange(0, TB)  # [TB] retrieved node index
    o_w = tl.arange(0, WB)  # [WB] anc word
    p_key = ws_i_ptr + i_b * 5 * TB
    p_canon = p_key + TB
    p_pkey = p_key + 2 * TB
    p_new = p_key + 3 * TB
    p_tok = ws_l_ptr + i_b * 2 * TB
    p_cmp = p_tok + TB
    p_anc = ws_anc_ptr + i_b * TB * WB

    if BUDGET_T:
        cap = tl.load(budget_ptr + i_b)
    else:
        cap = budget_val + tl.zeros([], tl.int32)
    cap = tl.minimum(tl.maximum(cap, 0), N)
    n_draft = tl.minimum(tl.load(num_ptr + i_b), cap)
    active = n_draft > 0
    m_d = o_n < n_draft
    p_row = i_b * N + o_n

    if FROM_TABLE:
        m_t = o_j < T
        b_rdep = tl.load(t_dep_ptr + o_j, mask=m_t, other=0)
        root_tok = tl.load(tok_ptr + i_b * N)
        if COUNT_T:
            limit = tl.load(count_ptr + i_b)
        else:
            limit = count_val + tl.zeros([], tl.int32)
    else:
        m_t = o_j < tl.load(r_num_ptr + i_b)
        b_rdep = tl.load(r_dep_ptr + i_b * T + o_j, mask=m_t, other=0)
        root_tok = tl.load(r_tok_ptr + i_b * T)
        limit = tl.zeros([], tl.int32)  # no count in loaded mode: unused

    # every retrieved node starts unmapped (-1); the root maps to merged node 0, anc bit 0
    tl.store(p_key + o_j, tl.where(o_j == 0, 0, -1))
    tl.store(p_pkey + o_j, tl.full([TB], -1, tl.int32))
    tl.store(p_new + o_j, tl.zeros([TB], tl.int32))
    tl.store(p_tok + o_j, tl.where(o_j == 0, root_tok, -1).to(tl.int64))
    tl.store(
        p_anc + o_j[:, None] * WB + o_w[None, :],
        tl.where((o_j[:, None] == 0) & (o_w[None, :] == 0), 1, 0),
    )
    tl.debug_barrier()
    n_used = n_draft
    n_got = tl.zeros([], tl.int32)
    # the fixed inputs of _retrieve_match, in its order
    req = (i_b, n_draft, active, limit, tok_ptr, par_ptr, table_ptr, t_par_ptr, t_rank_ptr,
           r_tok_ptr, r_par_ptr, p_key, p_tok, N, T, V)  # fmt: skip
    lo = tl.full([], 1, tl.int32)
    # breadth-first order: depth d occupies retrieved nodes [lo, hi)
    for d in range(1, max_depth + 1):
        hi = lo + tl.sum(((b_rdep == d) & m_t & (o_j > 0)).to(tl.int32), 0)
        if hi - lo <= LB:
            # the whole depth in one tile (always, in template mode): one pass in registers
            o_l = lo + tl.arange(0, LB)  # [LB]
            m_l = o_l < hi
            b_pp, b_pk, m_live, b_dm, m_un, b_cmp, n_got = _retrieve_match(
                o_l, m_l, n_got, req, K, TB, LB, NB, CN, FROM_TABLE
            )
            b_prow = tl.load(
                p_anc + b_pp[:, None] * WB + o_w[None, :], mask=m_l[:, None], other=0
            )  # [LB, WB] parents' anc rows
            m_same = (b_cmp[:, None] == b_cmp[None, :]) & (b_cmp[None, :] >= 0)  # [LB, LB]
            b_canon = tl.min(tl.where(m_same, o_l[None, :], _BIG), axis=1)
            m_first = (b_cmp >= 0) & (b_canon == o_l)
            b_idx = n_used + tl.cumsum(m_first.to(tl.int32), 0) - 1
            m_kept = m_first & (b_idx < cap)
            n_used += tl.sum(m_first.to(tl.int32), 0)
            b_fkey = tl.where(m_kept, b_idx, -1)
            b_ck = tl.sum(tl.where(b_canon[:, None] == o_l[None, :], b_fkey[None, :], 0), axis=1)
            b_key = tl.where(m_live, tl.where(m_un, b_ck, b_dm), -1)
            b_kc = tl.maximum(b_key, 0)[:, None]
            b_row = b_prow | tl.where(b_kc // 32 == o_w[None, :], 1 << (b_kc % 32), 0)
            tl.store(p_key + o_l, b_key, mask=m_l)
            tl.store(p_pkey + o_l, b_pk, mask=m_l)
            tl.store(p_new + o_l, m_kept.to(tl.int32), mask=m_l)
            tl.store(
                p_anc + o_l[:, None] * WB + o_w[None, :], b_row, mask=(m_l & (b_key >= 0))[:, None]
            )
            tl.debug_barrier()
        else:
            # pass 1: the token (template: a table look-up) and a draft child to reuse
            for c0 in range(lo, hi, LB):
                o_l = c0 + tl.arange(0, LB)  # [LB]
                m_l = o_l < hi
                b_pp, b_pk, m_live, b_dm, m_un, b_cmp, n_got = _retrieve_match(
                    o_l, m_l, n_got, req, K, TB, LB, NB, CN, FROM_TABLE
                )
                tl.store(p_cmp + o_l, b_cmp, mask=m_l)
                tl.store(p_key + o_l, tl.where(m_live & ~m_un, b_dm, -1), mask=m_l)
                tl.store(p_pkey + o_l, b_pk, mask=m_l)
            tl.debug_barrier()
            # pass 2: the first node of the level with the same merged parent and token is new,
            # numbered in order while under the budget
            for c0 in range(lo, hi, LB):
                o_l = c0 + tl.arange(0, LB)
                m_l = o_l < hi
                b_cmp = tl.load(p_cmp + o_l, mask=m_l, other=-1)
                b_canon = tl.full([LB], _BIG, tl.int32)
                for c1 in range(lo, hi, LB):
                    o_m = c1 + tl.arange(0, LB)
                    b_col = tl.load(p_cmp + o_m, mask=o_m < hi, other=-1)
                    m_same = (b_cmp[:, None] == b_col[None, :]) & (b_col[None, :] >= 0)
                    b_canon = tl.minimum(b_canon, tl.min(tl.where(m_same, o_m[None, :], _BIG), 1))
                m_first = (b_cmp >= 0) & (b_canon == o_l)
                b_idx = n_used + tl.cumsum(m_first.to(tl.int32), 0) - 1
                m_kept = m_first & (b_idx < cap)
                n_used += tl.sum(m_first.to(tl.int32), 0)
                tl.store(p_key + o_l, tl.where(m_kept, b_idx, -1), mask=m_first)
                tl.store(p_canon + o_l, b_canon, mask=m_l)
                tl.store(p_new + o_l, m_kept.to(tl.int32), mask=m_l)
            tl.debug_barrier()
            # pass 3: repeats take their first's index; anc row = parent's row | own bit
            for c0 in range(lo, hi, LB):
                o_l = c0 + tl.arange(0, LB)
                m_l = o_l < hi
                b_cmp = tl.load(p_cmp + o_l, mask=m_l, other=-1)
                b_canon = tl.load(p_canon + o_l, mask=m_l, other=0)
                m_dup = (b_cmp >= 0) & (b_canon != o_l)
                b_key = tl.load(p_key + o_l, mask=m_l, other=-1)
                b_ck = tl.load(
                    p_key + tl.minimum(tl.maximum(b_canon, 0), TB - 1), mask=m_dup, other=-1
                )
                b_key = tl.where(m_dup, b_ck, b_key)
                tl.store(p_key + o_l, b_key, mask=m_dup)
                if FROM_TABLE:
                    b_par = tl.load(t_par_ptr + o_l, mask=m_l, other=0)
                else:
                    b_par = tl.load(r_par_ptr + i_b * T + o_l, mask=m_l, other=0)
                b_pp = tl.minimum(tl.maximum(b_par, 0), TB - 1)
                m_set = m_l & (b_key >= 0)
                b_prow = tl.load(
                    p_anc + b_pp[:, None] * WB + o_w[None, :], mask=m_set[:, None], other=0
                )  # [LB, WB]
                b_kc = tl.maximum(b_key, 0)[:, None]
                b_row = b_prow | tl.where(b_kc // 32 == o_w[None, :], 1 << (b_kc % 32), 0)
                tl.store(p_anc + o_l[:, None] * WB + o_w[None, :], b_row, mask=m_set[:, None])
            tl.debug_barrier()
        lo = hi

    n_out = tl.minimum(n_used, cap)
    m_o = o_n < n_out
    m_aw = o_w[None, :] < W
    p_orow = i_b * N * W + o_n[:, None] * W + o_w[None, :]
    # draft nodes and padding from the draft tree; new nodes scattered to their index
    m_n = (m_d | ~m_o) & (o_n < N)
    tl.store(o_tok_ptr + p_row, tl.load(tok_ptr + p_row, mask=m_d, other=0), mask=m_n)
    tl.store(o_par_ptr + p_row, tl.load(par_ptr + p_row, mask=m_d, other=-1), mask=m_n)
    tl.store(o_dep_ptr + p_row, tl.load(dep_ptr + p_row, mask=m_d, other=0), mask=m_n)
    tl.store(
        o_anc_ptr + p_orow,
        tl.load(anc_ptr + p_orow, mask=m_d[:, None] & m_aw, other=0),
        mask=m_n[:, None] & m_aw,
    )
    m_new = (tl.load(p_new + o_j) != 0) & m_t
    b_nk = tl.minimum(tl.maximum(tl.load(p_key + o_j), 0), NB - 1)
    if FROM_TABLE:
        b_rtok = tl.load(p_tok + o_j)
    else:
        b_rtok = tl.load(r_tok_ptr + i_b * T + o_j, mask=m_t, other=0)
    p_new_row = i_b * N + b_nk
    tl.store(o_tok_ptr + p_new_row, b_rtok, mask=m_new)
    tl.store(o_par_ptr + p_new_row, tl.load(p_pkey + o_j), mask=m_new)
    tl.store(o_dep_ptr + p_new_row, b_rdep, mask=m_new)
    b_ranc = tl.load(p_anc + o_j[:, None] * WB + o_w[None, :], mask=m_new[:, None], other=0)
    tl.store(
        o_anc_ptr + i_b * N * W + b_nk[:, None] * W + o_w[None, :],
        b_ranc,
        mask=m_new[:, None] & m_aw,
    )
    tl.store(o_sc_ptr + p_row, tl.load(sc_ptr + p_row, mask=m_d, other=0.0), mask=o_n < N)
    tl.store(o_num_ptr + i_b, n_out)
    tl.debug_barrier()
    # links: first child and next sibling in increasing index, from the written parents
    o_par = tl.load(o_par_ptr + p_row, mask=m_o, other=-1)
    b_fc = tl.full([NB], _BIG, tl.int32)
    b_ns = tl.full([NB], _BIG, tl.int32)
    for c in tl.static_range(0, NB, CN):
        o_c = c + tl.arange(0, CN)
        b_cpar = tl.load(o_par_ptr + i_b * N + o_c, mask=o_c < n_out, other=-2)  # [CN]
        m_kid = b_cpar[None, :] == o_n[:, None]  # [p, i]
        b_fc = tl.minimum(b_fc, tl.min(tl.where(m_kid, o_c[None, :], _BIG), axis=1))
        m_sib = (b_cpar[None, :] == o_par[:, None]) & (o_c[None, :] > o_n[:, None])  # [i, j]
        b_ns = tl.minimum(b_ns, tl.min(tl.where(m_sib, o_c[None, :], _BIG), axis=1))
    b_fc = tl.where(m_o, b_fc, _BIG)
    b_ns = tl.where(m_o & (o_par >= 0), b_ns, _BIG)
    tl.store(o_fc_ptr + p_row, tl.where(b_fc < _BIG, b_fc, -1), mask=o_n < N)
    tl.store(o_ns_ptr + p_row, tl.where(b_ns < _BIG, b_ns, -1), mask=o_n < N)


@triton.jit(do_not_specialize=["T", "V", "max_depth", "count_val", "stride_root"])
def _retrieve_kernel(
    table_ptr,
    root_ptr,
    stride_root,
    t_par_ptr,
    t_rank_ptr,
    t_dep_ptr,
    count_ptr,
    count_val,
    o_tok_ptr,
    o_par_ptr,
    o_dep_ptr,
    o_num_ptr,
    ws_tok_ptr,
    ws_pos_ptr,
    T,
    V,
    max_depth,
    K: tl.constexpr,
    TB: tl.constexpr,
    COUNT_T: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    o_j = tl.arange(0, TB)
    m_t = o_j < T
    p_tok = ws_tok_ptr + i_b * TB
    p_pos = ws_pos_ptr + i_b * TB
    b_rpar = tl.load(t_par_ptr + o_j, mask=m_t, other=-1)
    b_pp = tl.minimum(tl.maximum(b_rpar, 0), TB - 1)
    b_rank = tl.load(t_rank_ptr + o_j, mask=m_t, other=0)
    b_rdep = tl.load(t_dep_ptr + o_j, mask=m_t, other=0)
    b_tok = tl.where(o_j == 0, tl.load(root_ptr + i_b * stride_root), -1).to(tl.int64)
    if COUNT_T:
        limit = tl.load(count_ptr + i_b)
    else:
        limit = count_val + tl.zeros([], tl.int32)
    tl.store(p_tok + o_j, b_tok)
    tl.debug_barrier()
    n_got = tl.zeros([], tl.int32)
    for d in range(1, max_depth + 1):
        m_at = (b_rdep == d) & (o_j > 0) & m_t
        b_ptok = tl.load(p_tok + b_pp, mask=m_at, other=-1)
        m_look = m_at & (b_ptok >= 0) & (b_ptok < V)
        b_nt = tl.load(table_ptr + b_ptok * K + b_rank, mask=m_look, other=-1).to(tl.int64)
        m_got = m_look & (b_nt >= 0) & (b_nt < V)
        m_got = m_got & (n_got + tl.cumsum(m_got.to(tl.int32), 0) <= limit)
        n_got += tl.sum(m_got.to(tl.int32), 0)
        b_tok = tl.where(m_at, tl.where(m_got, b_nt, -1), b_tok)
        tl.store(p_tok + o_j, b_tok, mask=m_at)
        tl.debug_barrier()
    # pack in template order: node j goes to slot pos[j]
    m_ok = ((b_tok >= 0) | (o_j == 0)) & m_t
    b_pos = tl.cumsum(m_ok.to(tl.int32), 0) - 1
    tl.store(p_pos + o_j, b_pos)
    tl.debug_barrier()
    b_ppos = tl.load(p_pos + b_pp, mask=m_ok & (o_j > 0), other=-1)
    n = tl.sum(m_ok.to(tl.int32), 0)
    p = i_b * T
    m_pad = (o_j >= n) & m_t
    tl.store(o_tok_ptr + p + o_j, tl.zeros([TB], tl.int64), mask=m_pad)
    tl.store(o_par_ptr + p + o_j, tl.full([TB], -1, tl.int32), mask=m_pad)
    tl.store(o_dep_ptr + p + o_j, tl.zeros([TB], tl.int32), mask=m_pad)
    b_slot = tl.maximum(b_pos, 0)
    tl.store(o_tok_ptr + p + b_slot, b_tok, mask=m_ok)
    tl.store(o_par_ptr + p + b_slot, b_ppos, mask=m_ok)
    tl.store(o_dep_ptr + p + b_slot, b_rdep, mask=m_ok)
    tl.store(o_num_ptr + i_b, n)


# ---------------------------------------------------------------------------- launchers


def _num_warps(tb: int, nb: int) -> int:
    return 16 if max(tb, nb) >= 256 else 8 if max(tb, nb) >= 128 else 4


def _contig(name: str, t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"Invalid layout of {name}: expected a contiguous tensor")
    return t


_is_contiguous = torch.Tensor.is_contiguous


def _contig_fields(prefix: str, tensors: tuple[torch.Tensor, ...]) -> None:
    """``_contig`` of each of a tree's fields (``Tree.FIELDS`` order), the first bad one named."""
    if not all(map(_is_contiguous, tensors)):  # the loop in C while all pass
        for f, u in zip(Tree.FIELDS, tensors):
            _contig(f"{prefix}.{f}", u)


def graft_fused(
    tree,
    budget: torch.Tensor | int,
    *,
    table: torch.Tensor | None = None,
    t_parents: torch.Tensor | None = None,
    t_ranks: torch.Tensor | None = None,
    t_depth: torch.Tensor | None = None,
    count: torch.Tensor | int | None = None,
    r_tokens: torch.Tensor | None = None,
    r_parents: torch.Tensor | None = None,
    r_depth: torch.Tensor | None = None,
    r_num: torch.Tensor | None = None,
    max_depth: int = 0,
    level_width: int = 32,
    out: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Retrieve (from ``table`` through the template, or the given ``r_*``) + merge + rebuild.

    ``level_width``: the widest depth of the retrieved tree if known (the template's), which
    sizes the per-depth tiles; wider depths are processed in several tiles.

    Returns the output tree's fields in ``Tree`` order (tokens, parents, num_nodes, depth, anc,
    first_child, next_sibling, scores), written into ``out`` when given.
    """
    _contig_fields("tree", tree.tensors())
    B, N = tree.parents.shape
    W = tree.anc.shape[2]
    dev = tree.parents.device
    if out is None:
        out = Tree.uninitialized(B, N, dev).tensors()
    _contig_fields("out", tuple(out))
    from_table = table is not None
    if from_table:
        assert t_parents is not None and t_ranks is not None and t_depth is not None
        T = t_parents.shape[0]
        V, K = table.shape
        r_args = (tree.tokens, tree.parents, tree.depth, tree.num_nodes)  # unused
        t_args = (table, t_parents, t_ranks, t_depth)
    else:
        assert r_tokens is not None and r_parents is not None and r_depth is not None
        assert r_num is not None
        T = r_tokens.shape[1]
        V, K = 1, 1
        r_args = (
            _contig("retrieved.tokens", r_tokens),
            _contig("retrieved.parents", r_parents),
            _contig("retrieved.depth", r_depth),
            r_num,
        )
        t_args = (tree.parents, tree.parents, tree.parents, tree.parents)  # unused
    budget_t = isinstance(budget, torch.Tensor)
    count_t = isinstance(count, torch.Tensor)
    if budget_t:
        _contig("budget", budget)
    if count_t:
        _contig("count", count)
    count_val = T - 1 if count is None or count_t else int(count)
    NB = max(pow2(N), 2)
    TB = max(pow2(T), 2)
    WB = max(pow2(W), 2)
    level_block = min(32, max(2, pow2(level_width)))
    ws_i, ws_l, ws_anc = scratch(
        ("graft", B, TB, WB), dev,
        lambda: (
            torch.empty(B * 5 * TB, dtype=torch.int32, device=dev),
            torch.empty(B * 2 * TB, dtype=torch.int64, device=dev),
            torch.empty(B * TB * WB, dtype=torch.int32, device=dev),
        ),
    )  # fmt: skip
    direct(_graft_kernel).launch(
        (B,),
        tree.tokens,
        tree.parents,
        tree.num_nodes,
        tree.depth,
        tree.anc,
        tree.scores,
        out[0],
        out[1],
        out[2],
        out[3],
        out[4],
        out[5],
        out[6],
        out[7],
        budget if budget_t else tree.num_nodes,
        0 if budget_t else int(budget),
        count if count_t else tree.num_nodes,
        count_val,
        *t_args,
        *r_args,
        ws_i,
        ws_l,
        ws_anc,
        N,
        T,
        V,
        max_depth,
        K=K,
        W=W,
        NB=NB,
        TB=TB,
        WB=WB,
        LB=level_block,
        CN=min(NB, 32),
        FROM_TABLE=from_table,
        BUDGET_T=budget_t,
        COUNT_T=count_t,
        num_warps=4,
    )
    return out


def retrieve(
    table: torch.Tensor,
    root_tokens: torch.Tensor,
    t_parents: torch.Tensor,
    t_ranks: torch.Tensor,
    t_depth: torch.Tensor,
    max_depth: int,
    count: torch.Tensor | int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed retrieval: (tokens [B, T] int64, parents [B, T] int32, depth [B, T] int32,
    num_nodes [B] int32)."""
    B = root_tokens.shape[0]
    T = t_parents.shape[0]
    V, K = table.shape
    dev = table.device
    tok = torch.empty(B, T, dtype=torch.int64, device=dev)
    par = torch.empty(B, T, dtype=torch.int32, device=dev)
    dep = torch.empty(B, T, dtype=torch.int32, device=dev)
    num = torch.empty(B, dtype=torch.int32, device=dev)
    count_t = isinstance(count, torch.Tensor)
    count_val = T - 1 if count is None or count_t else int(count)
    TB = max(pow2(T), 2)
    ws_tok, ws_pos = scratch(
        ("retrieve", B, TB), dev,
        lambda: (
            torch.empty(B * TB, dtype=torch.int64, device=dev),
            torch.empty(B * TB, dtype=torch.int32, device=dev),
        ),
    )  # fmt: skip
    direct(_retrieve_kernel).launch(
        (B,),
        table,
        root_tokens,
        root_tokens.stride(0),
        t_parents,
        t_ranks,
        t_depth,
        count if count_t else num,
        count_val,
        tok,
        par,
        dep,
        num,
        ws_tok,
        ws_pos,
        T,
        V,
        max_depth,
        K=K,
        TB=TB,
        COUNT_T=count_t,
        num_warps=_num_warps(TB, 1),
    )
    return tok, par, dep, num


UPDATE_TUNING = {
    "block_v": None,
    "programs_per_sm": 32,
    "num_warps": 1,
    "group": 0,
    "merge": "bitonic",
    "block_max": None,
    "rank32": True,
}
"""The update's configuration on the GPU. Stage 1: logits per block (None: the rule of
``update_tiling``), programs per SM that the splits of V aim for, warps per program, and the
top-k method: ``group`` 0 keeps a running list
that a block's best key enters while it beats the worst; ``group`` g > 0 keeps the largest
maxima of groups of g logits and rereads those groups (``_update_group``). The write stage:
``merge`` "passes" (K dependent max passes over the splits' lists) or "bitonic" (one top-KB a
row). ``block_max`` m > 0 replaces both: stage 1 keeps one max per m logits (a float max per
logit, no order keys), stage 2 rereads each node's k best blocks (``_update_by_block_maxima``);
0 keeps the lists; None (the default) takes m from the vocabulary (``_update_block_max``).
``rank32``: stage 2 of the block maxima ranks int32 keys where the logits are bf16 (their value
keys are exact in 16 bits), int64 ones otherwise; on an H100 (session 39,
bench/results/h100/graft_update_rank32_s39.json) int32 keys took 4-16 % off every row: B 1 / 8 /
64 at V 32,000 9.1 / 22.3 / 143 -> 8.6 / 20.5 / 129.5 µs, at V 128,256 15.2 / 64.6 / 450-491 ->
13.4 / 59.9 / 414.
``bench/bench_graft.py --sweep-update`` varies it; the splits and the method are part of
``update_workspace_key``, so a table's cached workspace follows it. H200, µs
(bench/results/h200/graft_update_block_max.json, session 33), B 1 / 8 / 64, lists -> m 64 -> m 128:
V 32,000 11.3 / 30.7 / 132.9 -> 9.1 / 19.9 / 120.6 -> 9.5 / 21.1 / 129.1; V 128,256 20.8 / 77.4
/ 439.6 -> 16.4 / 59.0 / 405.1 -> 14.2 / 53.7 / 366.7 (m 256: slower at both). Earlier, for the
lists (graft_update_sweep.json): the bitonic merge 21.15 against 21.57 µs at B 1 V 128,256;
groups of 16 (2,048-logit blocks) 19.2 at B 1 but 576 at B 64."""
BLOCK_MAX_SMALL_V = 65536
"""Vocabularies up to this size take 64-logit block maxima, larger ones 128 (the fastest of 64,
128 and 256 at every B of the sweep at V 32,000 and V 128,256; ``UPDATE_TUNING``)."""


def _splits(n_flat: int, V: int, block_v: int, device: torch.device) -> int:
    """Splits of V per node: enough programs to fill the GPU (at most ``programs_per_sm`` of
    them per SM, so that even one request's nodes stream at full bandwidth), at least one block
    of V each. Rounded down: 32 one-warp programs are all an SM holds at once, and a few more
    would run as a second wave (B 8's 480 nodes made 4,320 programs for 4,224 places). Depends
    on shapes and the SM count only (fixed for a CUDA graph)."""
    if device.type != "cuda":
        return min(2, cdiv(V, block_v))
    sms = _runtime.sm_count(device)
    want = UPDATE_TUNING["programs_per_sm"] * sms // max(n_flat, 1)
    return max(1, min(want, cdiv(V, block_v), 64))


def update_tiling(n_flat: int, V: int, device: torch.device) -> tuple[int, int]:
    """(logits per block, warps) of stage 1 for ``n_flat`` nodes of V logits: ``UPDATE_TUNING``'s,
    where ``block_v`` is None 512 and one warp, except that the block-maxima method takes
    1,024-logit blocks over two warps where, at that size, every program streams a single block
    (B <= 2 at V 32,000 on 132 SMs: half the programs of one-warp 512-logit blocks, each of one
    or two blocks); elsewhere two warps lose or tie (docs/design.md, op 6, the update).
    Shapes and the SM count only, so a captured launch keeps its tiling."""
    if interpreted():
        return 256, 1
    block_v, warps = UPDATE_TUNING["block_v"], UPDATE_TUNING["num_warps"]
    if block_v is None:
        block_v = 512
        one_block = _splits(n_flat, V, 1024, device) >= cdiv(V, 1024)
        if UPDATE_TUNING["block_max"] != 0 and one_block:
            block_v, warps = 1024, max(warps, 2)
    return block_v, warps


def _update_group(block_v: int, KB: int) -> int:
    """Stage 1's group size (0: the running-list method): ``UPDATE_TUNING["group"]`` where a
    block holds at least KB groups of it (the bitonic top-KB runs over a block's group maxima),
    else 0."""
    g = UPDATE_TUNING["group"]
    return g if g > 0 and block_v // g >= KB else 0


_MAX_CHUNK = 1 << 16
"""A split's ids fit the 16 bits that bf16 order keys give them (kernels.graft_update)."""


def update_splits(n_flat: int, V: int, device: torch.device) -> int:
    """Stage 1's splits of V per node (``_splits``, at least enough that a split's ids fit the
    16 bits of a bf16 order key, and none empty)."""
    block_v = update_tiling(n_flat, V, device)[0]
    S = max(_splits(n_flat, V, block_v, device), cdiv(V, _MAX_CHUNK))
    return cdiv(V, _chunk(V, S, block_v))


def _update_block_max(V: int, block_v: int) -> int:
    """Logits per block of the block-maxima method for a vocabulary of V (``UPDATE_TUNING
    ["block_max"]``, or by default 64 up to ``BLOCK_MAX_SMALL_V`` and 128 above; at most a
    stage-1 block of ``block_v``), or 0: the top-k lists."""
    mb = UPDATE_TUNING.get("block_max")
    if mb is None:
        mb = 64 if V <= BLOCK_MAX_SMALL_V else 128
    return min(mb, block_v) if mb else 0


def update_workspace_key(n_flat: int, V: int, K: int, device: torch.device) -> tuple[int, int, int]:
    """(nodes, float32 slots a node, int32 slots a node): the key, and the sizes, of
    ``adjacency_update``'s workspace for ``n_flat`` nodes of V logits and a table of width K:
    each split's top-k list (S * padded k slots of both), or with the block-maxima method each
    block's value key (cdiv(V, block) int32 slots and no float32 slot)."""
    mb = _update_block_max(V, update_tiling(n_flat, V, device)[0])
    if mb:
        return n_flat, 0, cdiv(V, mb)
    slots = update_splits(n_flat, V, device) * max(pow2(K), 2)
    return n_flat, slots, slots


def _chunk(V: int, S: int, block_v: int) -> int:
    """Ids per split: V / S rounded up to whole blocks (at most ``_MAX_CHUNK`` when V / S is,
    since ``block_v`` divides it)."""
    return cdiv(cdiv(V, S), block_v) * block_v


def _update_by_block_maxima(
    table, owner, ws_key, tokens, num_nodes, logits, S, chunk, mb, last_wins, block_v, warps
) -> None:  # fmt: skip
    """The update's block-maxima method (``graft_update._block_max_kernel`` then
    ``_block_top_kernel``): stage 1 keeps a max per ``mb`` logits, stage 2 rereads each winning
    node's K best blocks."""
    V, K = table.shape
    B, N = tokens.shape
    n_flat = B * N
    KB = max(pow2(K), 2)
    common = (tokens, num_nodes, owner)
    # PDL only where ``TREEOPS_PDL`` asks: late release made B 1 slower on an H100 (V 32,000:
    # 8.4 -> 10.5 us; docs/benchmarks.md)
    pdl = use_pdl(logits.device)
    direct(_block_max_kernel).launch(
        (n_flat, S), logits, *common, ws_key, N, V, n_flat, chunk, logits.stride(0),
        logits.stride(1), BLOCK_V=block_v, MB=mb, LAST_WINS=last_wins, PDL=pdl,
        num_warps=warps, launch_pdl=pdl > 0,
    )  # fmt: skip
    # int32 keys hold 16 bits of a bf16 value and 16 of a block index or tile position
    key32 = (UPDATE_TUNING["rank32"] and logits.dtype == torch.bfloat16
             and max(cdiv(V, mb), KB * mb) <= 1 << 16)  # fmt: skip
    direct(_block_top_kernel).launch(
        (n_flat,), logits, *common, table, ws_key, N, V, n_flat, logits.stride(0),
        logits.stride(1), K=K, KB=KB, NBP=max(pow2(cdiv(V, mb)), KB), MB=mb,
        LAST_WINS=last_wins, KEY32=key32, PDL=pdl, num_warps=4, launch_pdl=pdl > 0,
    )  # fmt: skip


def adjacency_update(
    table: torch.Tensor,
    owner: torch.Tensor,
    workspace: dict,
    tokens: torch.Tensor,
    num_nodes: torch.Tensor,
    logits: torch.Tensor | None,
    topk_ids: torch.Tensor | None,
    last_wins: bool,
) -> None:
    """``table[tokens[b, i]] = top-k(logits[b, i])`` (or ``topk_ids[b, i, :k]``) for
    ``i < num_nodes[b]``; duplicate tokens: lowest flattened index wins (highest when
    ``last_wins``). ``owner`` [V] int32 must be all INT32_MAX (it is again afterwards)."""
    V, K = table.shape
    B, N = tokens.shape
    n_flat = B * N
    KB = max(pow2(K), 2)
    _contig("tokens", tokens)
    if n_flat == 0:
        return
    # from the first launch on, a failure undoes the claims: only the write launch's winners
    # reset them, and a stale claim would block its token's row from every later update
    try:
        if logits is not None:
            key = update_workspace_key(n_flat, V, K, logits.device)
            S = update_splits(n_flat, V, logits.device)
            block_v, warps = update_tiling(n_flat, V, logits.device)
            chunk = _chunk(V, S, block_v)
            if key not in workspace:
                workspace[key] = (
                    torch.empty(n_flat * key[1], dtype=torch.float32, device=table.device),
                    torch.empty(n_flat * key[2], dtype=torch.int32, device=table.device),
                )
            ws_val, ws_id = workspace[key]
            mb = _update_block_max(V, block_v)
            if mb:
                _update_by_block_maxima(table, owner, ws_id, tokens, num_nodes, logits, S,
                                        chunk, mb, last_wins, block_v, warps)  # fmt: skip
                return
            direct(_topk_partial_kernel).launch(
                (n_flat, S),
                logits,
                tokens,
                num_nodes,
                owner,
                ws_val,
                ws_id,
                N,
                V,
                n_flat,
                chunk,
                logits.stride(0),
                logits.stride(1),
                K=K,
                KB=KB,
                S=S,
                BLOCK_V=block_v,
                GROUP=_update_group(block_v, KB),
                KEY32=logits.dtype == torch.bfloat16,
                LAST_WINS=last_wins,
                num_warps=warps,
            )
            n_cand = S * KB
            ids, s_ib, s_in, k_ids = ws_id, 0, 0, 0
        else:
            assert topk_ids is not None
            # before any launch: a claim left behind by a failed call would block later updates
            if topk_ids.stride(2) != 1 and topk_ids.shape[2] > 1:  # the rule of treeops._checks
                raise ValueError(
                    "Invalid stride of topk_ids: expected the last dimension contiguous"
                )
            direct(_claim_kernel).launch(
                (cdiv(n_flat, 256),),
                tokens,
                num_nodes,
                owner,
                N,
                V,
                n_flat,
                BLOCK=256,
                LAST_WINS=last_wins,
            )
            ws_val, ws_id = table, table  # unused
            n_cand = KB
            ids, k_ids = topk_ids, topk_ids.shape[2]
            s_ib, s_in = topk_ids.stride(0), topk_ids.stride(1)
        C = pow2(n_cand)
        block_m = max(1, min(64, 512 // C))
        direct(_update_write_kernel).launch(
            (cdiv(n_flat, block_m),),
            tokens,
            num_nodes,
            owner,
            table,
            ws_val,
            ws_id,
            ids,
            N,
            V,
            n_flat,
            k_ids,
            s_ib,
            s_in,
            n_cand,
            K=K,
            KB=KB,
            C=C,
            BLOCK_M=block_m,
            FROM_LOGITS=logits is not None,
            BITONIC=UPDATE_TUNING["merge"] == "bitonic",
            LAST_WINS=last_wins,
            num_warps=4,
        )
    except BaseException:
        owner.fill_(INT32_MAX)
        raise
