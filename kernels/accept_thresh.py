"""Acceptance, the kept set of top-k/top-p sampling rows (pass 2 of a sampling launch).

Pass 1 (``accept_stats._node_stats``, one program per (request, node, vocabulary split)) read
every logit once and left per-split maxima and normalisers and, for top-k/top-p rows, the maxima
of groups of GROUP tokens. Pass 2 (``_finish_node``, one program per node) merges the partials,
derives a lower bound L of the threshold from the group maxima (``_lower_bound``), rereads only
the groups whose maximum reaches L (about k groups for top-k: a few KB of the row) to collect
every token >= L into CAP slots, and sorts them to the exact kept set -- the first C tokens in
the order (logit descending, id ascending) -- storing its threshold key, id cut, mass and
per-block masses for the walker. Rows without top-k/top-p only store their merged normaliser.
When no bound exists (k above the number of groups) or more than CAP tokens reach it (a wide
nucleus), the program runs the exact multi-pivot search over the row instead
(``_count_search``/``_tie_cut``: several reads of the row by one program; slow, exact).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .accept_stats import (
    INT32_MIN,
    _count_search,
    _gather_candidates,
    _kept_set,
    _key,
    _lower_bound,
    _mass,
    _tie_cut,
)


@triton.jit
def _row_params(i_b, i_n, p_num_nodes, p_temp, p_topk_param, p_topp, V,
                HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr):  # fmt: skip
    """(T, k, top_p, use_k, use_p, trunc) of node i_n of request i_b; trunc: an active
    sampling node (T > 0) with top-k or top-p on (one the launch has no tensor for is off)."""
    n = tl.load(p_num_nodes + i_b)
    T_in = tl.load(p_temp + i_b).to(tl.float32)
    T = tl.where(T_in > 0, T_in, 1.0)
    k = tl.zeros([], dtype=tl.int32)
    top_p = tl.full([], 1.0, tl.float32)
    if HAS_TOPK:
        k = tl.load(p_topk_param + i_b).to(tl.int32)
    if HAS_TOPP:
        top_p = tl.load(p_topp + i_b).to(tl.float32)
    use_k = (k > 0) & (k < V)
    use_p = top_p < 1.0
    trunc = (i_n < n) & (T_in > 0) & (use_k | use_p)
    return T, k, top_p, use_k, use_p, trunc


@triton.jit
def _merge_node(p_wmax, p_wse, node, T, S: tl.constexpr, S_PAD: tl.constexpr):
    """The node's max and sum of exp((x - max) / T) over the whole row, from its S partials."""
    o_s = tl.arange(0, S_PAD)
    m_s = o_s < S
    pm = tl.load(p_wmax + node * S + o_s, mask=m_s, other=float("-inf"), volatile=True)
    ps = tl.load(p_wse + node * S + o_s, mask=m_s, other=0.0, volatile=True)
    m = tl.max(pm, axis=0)
    sc = tl.where(pm == float("-inf"), 0.0, tl.exp((pm - m) / T))
    return m, tl.sum(ps * sc, axis=0)


@triton.jit
def _finish_node(
    node,
    p_logits,
    s_lb,
    s_ln,
    s_lv,
    p_num_nodes,
    p_temp,
    p_topk_param,
    p_topp,
    p_wmax,
    p_wse,
    p_wthr,
    p_wcut,
    p_wz,
    p_wcs,
    p_wcm,
    p_wgm,
    p_wcand,
    p_wsel,
    N,
    V,
    NCH,
    S: tl.constexpr,
    S_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_T: tl.constexpr,
    NPIV: tl.constexpr,
    NCH_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    GC: tl.constexpr,
    READ: tl.constexpr,
    CAP: tl.constexpr,
    CAP_S: tl.constexpr,
    SUB: tl.constexpr,
    MASS_TILE: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    HAS_TOPP: tl.constexpr,
):
    """Pass 2 of node ``node`` = request * N + i: its kept set's threshold key, id cut and mass
    Z (``p_wthr``, ``p_wcut``, ``p_wz``; rows without top-k/top-p: INT32_MIN, V and the whole
    row's normaliser) and, for top-k/top-p rows, the kept mass per vocabulary block."""
    i_n = (node % N).to(tl.int32)
    i_b = node // N
    T, k, top_p, use_k, use_p, trunc = _row_params(
        i_b, i_n, p_num_nodes, p_temp, p_topk_param, p_topp, V, HAS_TOPK, HAS_TOPP
    )
    m, z = _merge_node(p_wmax, p_wse, node, T, S, S_PAD)
    thr = tl.full([], INT32_MIN, tl.int32)
    cut = tl.zeros([], dtype=tl.int32) + V
    if trunc:
        p_cs = p_wcs + node * NCH
        p_cm = p_wcm + node * NCH
        p_row = p_logits + i_b * s_lb + i_n.to(tl.int64) * s_ln
        p_gm = p_wgm + node * G_PAD
        L, ok = _lower_bound(p_gm, V, m, T, z, k, top_p, use_k, G_PAD, GROUP, GC)
        count = tl.zeros([], dtype=tl.int32)
        if ok:
            p_sel = p_wsel + node * G_PAD
            p_cand = p_wcand + node * CAP
            count = _gather_candidates(
                p_row, s_lv, V, L, p_gm, p_sel, p_cand, GROUP, G_PAD, GC, CAP, READ
            )
        # sorted in CAP_S slots when the candidates fit (the usual top-k: about k of them), a
        # sort of a quarter of the size, else in CAP
        if ok & (count <= CAP_S):
            thr, cut, z = _kept_set(p_wcand + node * CAP, count, m, T, z, k, top_p, use_k, use_p,
                                    p_cs, p_cm, NCH, BLOCK_V, NCH_PAD, CAP_S, SUB,
                                    MASS_TILE)  # fmt: skip
        elif ok & (count <= CAP):
            thr, cut, z = _kept_set(p_wcand + node * CAP, count, m, T, z, k, top_p, use_k, use_p,
                                    p_cs, p_cm, NCH, BLOCK_V, NCH_PAD, CAP, SUB,
                                    MASS_TILE)  # fmt: skip
        else:
            # exact multi-pivot search over the whole row (wide nucleus, k beyond the groups)
            hi = _key(m) + 1
            lo0 = tl.full([], INT32_MIN, tl.int32)
            if use_k:
                thr, f_gt = _count_search(p_row, s_lv, V, m, T, k.to(tl.float32), lo0, hi,
                                          V * 1.0, False, BLOCK_T, NPIV)  # fmt: skip
                cut = _tie_cut(
                    p_row, s_lv, V, m, T, thr, lo0, cut, f_gt, k.to(tl.float32), False, BLOCK_T
                )
            if use_p:
                # the mass top-p is relative to: all tokens (pass 1's sum) or the top-k set
                z_k = z
                if use_k:
                    z_k = _mass(p_row, s_lv, V, m, T, thr, cut, p_cs, p_cm, BLOCK_T, False)
                goal = top_p * z_k
                # tokens below t weigh at most V exp((t - m) / T) together, so at t_lo (1 %
                # under (1 - top_p) z_k, for rounding) those at or above it reach the goal: a
                # start for the search above its lower bound thr's, where the values are dense
                t_lo = m + T * (tl.log((1.0 - top_p) * z_k / V) - 0.01)
                lo_p = tl.maximum(thr, _key(tl.minimum(t_lo, m)))
                thr_p, f_gt = _count_search(
                    p_row, s_lv, V, m, T, goal, lo_p, hi, z_k, True, BLOCK_T, NPIV
                )
                cut = _tie_cut(p_row, s_lv, V, m, T, thr_p, thr, cut, f_gt, goal, True, BLOCK_T)
                thr = thr_p
            z = _mass(p_row, s_lv, V, m, T, thr, cut, p_cs, p_cm, BLOCK_V, True)
    tl.store(p_wthr + node, thr)
    tl.store(p_wcut + node, cut)
    tl.store(p_wz + node, z)
