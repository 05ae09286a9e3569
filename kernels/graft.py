"""Graft kernels: fused retrieve + trie merge + rebuild, and retrieval alone.

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

The table update, ``adjacency_update``, is ``graft_update``'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeops._runtime import pow2
from treeops.tree import Tree

from ._launch import direct, scratch
from ._pdl import pdl_enter, pdl_options
from .graft_update import INT32_MAX, _contig

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
    PDL: tl.constexpr = 0,
):
    pdl_enter(PDL)
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
    PDL: tl.constexpr = 0,
):
    pdl_enter(PDL)
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
        **pdl_options(dev),
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
        **pdl_options(dev),
        num_warps=_num_warps(TB, 1),
    )
    return tok, par, dep, num
