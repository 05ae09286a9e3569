"""Acceptance, the tree walk (the second half of ``treeops.kernels.accept``'s launch).

One program per request merges the per-split statistics of every node (vectorised over nodes)
and walks the tree in registers: greedy follows the child carrying the node's argmax; sampling
applies docs/design.md op 7's interval rule with the kept-set thresholds and per-block masses
that ``accept_stats`` stored. Then the stop ids and the budget cut the emitted tokens, and the
outputs (and the merged top-k ids) are written.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .accept_stats import BIG, INT32_MIN, _kept, _key, _weight


@triton.jit
def _greedy_walk(n, valid, par, tok, arg, nz, N, N_PAD: tl.constexpr):
    """Follow the child whose token is the node's argmax; emit the argmax at every node."""
    o = tl.arange(0, N_PAD)
    # node i continues the walk iff its token is its parent's argmax: every node's decision at
    # once, so a step is one reduction (the current node's first such child)
    par_s = tl.where(valid & (o > 0), par, 0).to(tl.int32)
    acc = valid & (o > 0) & (tok == tl.gather(arg, par_s, 0).to(tl.int64))
    path = tl.where(o == 0, 0, -1)
    cur = tl.zeros([], dtype=tl.int32)
    L = tl.where(n > 0, 1, 0)
    going = n > 0
    while going:
        nxt = tl.min(tl.where(acc & (par == cur), o, BIG), axis=0)
        going = nxt < BIG
        if going:
            path = tl.where(o == L, nxt, path)
            L += 1
            cur = nxt
            going = L <= N
    # the q-th emitted token is the argmax at the q-th node of the path; its weight is
    # exp(0) = 1, so log p = -log Z
    on = o < L
    at = tl.where(on, path, 0)
    em = tl.where(on, tl.gather(arg, at, 0).to(tl.int64), -1)
    lp = tl.where(on, -tl.log(tl.gather(nz, at, 0)), 0.0)
    return path, em, lp, L


@triton.jit
def _sample_walk(
    i_b,
    p_logits,
    s_lb,
    s_ln,
    s_lv,
    p_uni,
    s_ub,
    n,
    valid,
    par,
    tok,
    nm,
    nz,
    thr,
    cutv,
    p_wcs,
    p_wcm,
    T,
    N,
    V,
    NCH,
    N_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NCH_PAD: tl.constexpr,
):
    """docs/design.md op 7's interval rule, in unnormalised weights: at node c, u_c * Z_c is laid
    out as c's kept children's weights in sibling (= index) order, then every other kept token's
    weight in id order. A child's piece depends only on its parent's row and uniform, so every
    child's logit and every uniform are loaded at once, before the first step: a step is then
    register work, and only the node the walk stops at loads (its bonus token's scan)."""
    o = tl.arange(0, N_PAD)
    # a token repeated among siblings counts once, at its first sibling
    dup = (
        tl.max(
            (
                (par[:, None] == par[None, :])
                & (tok[:, None] == tok[None, :])
                & (o[None, :] < o[:, None])
                & valid[None, :]
            ).to(tl.int32),
            axis=1,
        )
        > 0
    )
    cand = valid & (o > 0) & ~dup & (tok >= 0) & (tok < V)
    # each child's kept weight and log-probability in its parent's row (one load of every
    # child's logit), and each node's goal u * Z
    par_s = tl.where(cand, par, 0).to(tl.int32)
    m_p = tl.gather(nm, par_s, 0)
    z_p = tl.gather(nz, par_s, 0)
    x_v = tl.load(
        p_logits + i_b * s_lb + par_s.to(tl.int64) * s_ln + tok * s_lv,
        mask=cand,
        other=float("-inf"),
    ).to(tl.float32)
    kept_v = _kept(_key(x_v), tok.to(tl.int32), tl.gather(thr, par_s, 0), tl.gather(cutv, par_s, 0))
    w_v = tl.where(cand & kept_v, _weight(x_v, m_p, T), 0.0)
    lp_v = (x_v - m_p) / T - tl.log(z_p)
    u_all = tl.load(p_uni + i_b * s_ub + o, mask=o < N, other=0.0).to(tl.float32)
    g_v = u_all * nz
    path = tl.where(o == 0, 0, -1)
    em = tl.full([N_PAD], -1, tl.int64)
    lp = tl.zeros([N_PAD], dtype=tl.float32)
    cur = tl.zeros([], dtype=tl.int32)
    L = tl.where(n > 0, 1, 0)
    bonus = tl.full([], -1, tl.int64)
    bonus_lp = tl.zeros([], dtype=tl.float32)
    going = n > 0
    while going:
        ch = cand & (par == cur)
        wc = tl.where(ch, w_v, 0.0)
        goal = tl.sum(tl.where(o == cur, g_v, 0.0), axis=0)
        hit = tl.min(tl.where((wc > 0) & (tl.cumsum(wc, 0) > goal), o, BIG), axis=0)
        if hit == BIG:
            # u lies past the children (always, at a leaf): scan every other kept token in id
            # order for the bonus token
            m_c = tl.sum(tl.where(o == cur, nm, 0.0), axis=0)
            z_c = tl.sum(tl.where(o == cur, nz, 0.0), axis=0)
            thr_c = tl.sum(tl.where(o == cur, thr, 0), axis=0)
            cut_c = tl.sum(tl.where(o == cur, cutv, 0), axis=0)
            p_row = p_logits + i_b * s_lb + cur.to(tl.int64) * s_ln
            goal2 = goal - tl.sum(wc, axis=0)
            # first block whose cumulative non-child mass passes goal2, from the block masses
            # the node's program stored; the scan starts there (it moves on if rounding says
            # the crossing is later, and falls back to the last positive block)
            o_c = tl.arange(0, NCH_PAD)
            m_c2 = o_c < NCH
            o_cs = (i_b * N + cur) * NCH + o_c
            c_s = tl.load(p_wcs + o_cs, mask=m_c2, other=0.0, volatile=True)
            c_m = tl.load(p_wcm + o_cs, mask=m_c2, other=float("-inf"), volatile=True)
            c_z = tl.where(c_m == float("-inf"), 0.0, c_s * tl.exp((c_m - m_c) / T))
            blk = (tok // BLOCK_V).to(tl.int32)
            corr = tl.sum(
                tl.where(ch[:, None] & (blk[:, None] == o_c[None, :]), wc[:, None], 0.0), axis=0
            )
            c_o = tl.maximum(c_z - corr, 0.0)
            c_cum = tl.cumsum(c_o, 0)
            c0 = tl.min(tl.where(m_c2 & (c_o > 0) & (c_cum > goal2), o_c, NCH_PAD), axis=0)
            c_last = tl.max(tl.where(m_c2 & (c_o > 0), o_c, 0), axis=0)
            c0 = tl.where(c0 < NCH_PAD, c0, c_last)
            run = tl.sum(tl.where(o_c < c0, c_o, 0.0), axis=0)
            found = tl.full([], BIG, tl.int32)
            last = tl.full([], -1, tl.int32)
            # the found and the last kept tokens' logits, taken from the block in registers
            x_found = tl.zeros([], dtype=tl.float32)
            x_last = tl.zeros([], dtype=tl.float32)
            v0 = c0 * BLOCK_V
            while (v0 < V) & (found == BIG):
                o_v = v0 + tl.arange(0, BLOCK_V)
                m_v = o_v < V
                b_x = tl.load(p_row + o_v.to(tl.int64) * s_lv, mask=m_v, other=float("-inf")).to(
                    tl.float32
                )
                b_w = tl.where(m_v & _kept(_key(b_x), o_v, thr_c, cut_c), _weight(b_x, m_c, T), 0.0)
                # zero the children's tokens of this block, one child at a time (few)
                rem = ch & (tok >= v0) & (tok < v0 + BLOCK_V)
                while tl.max(rem.to(tl.int32), axis=0) > 0:
                    t = tl.min(tl.where(rem, tok, V), axis=0)
                    b_w = tl.where(o_v == t.to(tl.int32), 0.0, b_w)
                    rem = rem & (tok != t)
                cs = run + tl.cumsum(b_w, 0)
                found = tl.min(tl.where((b_w > 0) & (cs > goal2), o_v, BIG), axis=0)
                x_found = tl.sum(tl.where(o_v == found, b_x, 0.0), axis=0)
                last_b = tl.max(tl.where(b_w > 0, o_v, -1), axis=0)
                if last_b >= 0:
                    last = last_b
                    x_last = tl.sum(tl.where(o_v == last_b, b_x, 0.0), axis=0)
                run += tl.sum(b_w, axis=0)
                v0 += BLOCK_V
            if (found == BIG) & (last >= 0):
                found = last
                x_found = x_last
            if found == BIG:
                # rounding past the end with every kept token a child: the last child's piece
                hit = tl.max(tl.where(ch & (wc > 0), o, -1), axis=0)
                hit = tl.where(hit < 0, BIG, hit)
            else:
                bonus = found.to(tl.int64)
                bonus_lp = (x_found - m_c) / T - tl.log(z_c)
        if hit < BIG:
            # the child's token, and its log-probability in its parent's row
            path = tl.where(o == L, hit, path)
            em = tl.where(o == L - 1, tl.sum(tl.where(o == hit, tok, 0), axis=0), em)
            lp = tl.where(o == L - 1, tl.sum(tl.where(o == hit, lp_v, 0.0), axis=0), lp)
            L += 1
            cur = hit
            going = L <= N
        else:
            going = False
    # the last emitted token is the bonus
    em = tl.where(o == L - 1, bonus, em)
    lp = tl.where(o == L - 1, bonus_lp, lp)
    return path, em, lp, L


@triton.jit
def _walk(
    i_b,
    p_logits,
    s_lb,
    s_ln,
    s_lv,
    p_tokens,
    s_tb,
    p_parents,
    s_pb,
    p_num_nodes,
    p_temp,
    p_uni,
    s_ub,
    p_stop,
    s_sb,
    n_stop,
    p_budget,
    p_wmax,
    p_warg,
    p_wse,
    p_wtkv,
    p_wtki,
    p_wthr,
    p_wcut,
    p_wz,
    p_wcs,
    p_wcm,
    p_acc,
    p_len,
    p_bonus,
    p_lp,
    p_topk,
    N,
    V,
    NCH,
    N_PAD: tl.constexpr,
    S: tl.constexpr,
    S_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NCH_PAD: tl.constexpr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    SAMPLE: tl.constexpr,
    HAS_STOP: tl.constexpr,
    STOP_PAD: tl.constexpr,
    HAS_BUDGET: tl.constexpr,
    HAS_LP: tl.constexpr,
    TRUNC: tl.constexpr,
):
    i_b = i_b.to(tl.int64)
    o = tl.arange(0, N_PAD)
    n = tl.load(p_num_nodes + i_b)
    # the per-node loads are masked by the buffers' bounds (o < N), not by n, and the nodes past
    # n are set aside after them: they are issued beside n's load instead of waiting for it
    in_n = o < N
    valid = o < n
    par = tl.where(valid, tl.load(p_parents + i_b * s_pb + o, mask=in_n, other=-1), -1)
    tok = tl.load(p_tokens + i_b * s_tb + o, mask=in_n, other=-1)
    tok = tl.where(valid, tok, -1).to(tl.int64)
    T = 1.0
    if SAMPLE:
        T_in = tl.load(p_temp + i_b).to(tl.float32)
        T = tl.where(T_in > 0, T_in, 1.0)
    # merge the per-split partials of every node: [N_PAD, S_PAD]
    o_s = tl.arange(0, S_PAD)
    o_ns = (i_b * N + o[:, None]) * S + o_s[None, :]
    m_in = in_n[:, None] & (o_s[None, :] < S)
    m_ns = valid[:, None] & (o_s[None, :] < S)
    pm = tl.load(p_wmax + o_ns, mask=m_in, other=float("-inf"), volatile=True)
    pm = tl.where(m_ns, pm, float("-inf"))
    pa = tl.where(m_ns, tl.load(p_warg + o_ns, mask=m_in, other=BIG, volatile=True), BIG)
    ps = tl.where(m_ns, tl.load(p_wse + o_ns, mask=m_in, other=0.0, volatile=True), 0.0)
    nm = tl.max(pm, axis=1)
    arg = tl.min(tl.where(pm == nm[:, None], pa, BIG), axis=1)
    sc = tl.where(pm == float("-inf"), 0.0, tl.exp((pm - nm[:, None]) / T))
    nz = tl.sum(ps * sc, axis=1)  # Z of each node: sum of exp((x - max) / T)
    if SAMPLE:
        if TRUNC:
            # the kept sets of pass 2 (``accept_thresh``): threshold, id cut, mass
            thr = tl.load(p_wthr + i_b * N + o, mask=in_n, other=INT32_MIN, volatile=True)
            thr = tl.where(valid, thr, INT32_MIN)
            cutv = tl.where(
                valid, tl.load(p_wcut + i_b * N + o, mask=in_n, other=0, volatile=True), 0
            )
            nz = tl.where(
                valid, tl.load(p_wz + i_b * N + o, mask=in_n, other=0.0, volatile=True), 0.0
            )
        else:
            # no request truncates (no pass 2): every token kept, Z as merged above (what
            # pass 2 stores for a row without top-k/top-p)
            thr = tl.full([N_PAD], INT32_MIN, tl.int32)
            cutv = tl.zeros([N_PAD], dtype=tl.int32) + V
    # walk: path[d] = node at depth d; em[q] = (q+1)-th emitted token; lp[q] its log-prob
    if SAMPLE:
        if T_in > 0:
            path, em, lp, L = _sample_walk(
                i_b, p_logits, s_lb, s_ln, s_lv, p_uni, s_ub, n, valid, par, tok, nm, nz, thr,
                cutv, p_wcs, p_wcm, T, N, V, NCH, N_PAD, BLOCK_V, NCH_PAD
            )  # fmt: skip
        else:
            path, em, lp, L = _greedy_walk(n, valid, par, tok, arg, nz, N, N_PAD)
    else:
        path, em, lp, L = _greedy_walk(n, valid, par, tok, arg, nz, N, N_PAD)
    # budget and stop ids cut the emitted tokens e_1..e_L
    cut = L
    if HAS_BUDGET:
        cut = tl.minimum(cut, tl.maximum(tl.load(p_budget + i_b).to(tl.int32), 1))
    if HAS_STOP:
        o_st = tl.arange(0, STOP_PAD)
        stops = tl.load(p_stop + i_b * s_sb + o_st, mask=o_st < n_stop, other=-1).to(tl.int64)
        is_stop = (
            tl.max(((em[:, None] == stops[None, :]) & (stops[None, :] >= 0)).to(tl.int32), axis=1)
            > 0
        )
        first = tl.min(tl.where(is_stop & (o < cut), o, BIG), axis=0)
        cut = tl.where(first < BIG, first + 1, cut)
    cut = tl.where(n > 0, cut, 0)
    bonus = tl.where(cut > 0, tl.sum(tl.where(o == cut - 1, em, 0), axis=0), -1)
    m_out = o < N
    tl.store(p_acc + i_b * N + o, tl.where(o < cut, path, -1), mask=m_out)
    tl.store(p_len + i_b, cut)
    tl.store(p_bonus + i_b, bonus)
    if HAS_LP:
        tl.store(p_lp + i_b * N + o, tl.where(o < cut, lp, 0.0), mask=m_out)
    if K > 0:
        # merge the split buffers: K extraction rounds over [N_PAD, S_PAD * K_PAD] candidates
        o_c = tl.arange(0, S_PAD * K_PAD)
        o_nc = (i_b * N + o[:, None]) * (S * K_PAD) + o_c[None, :]
        m_nc = valid[:, None] & (o_c[None, :] < S * K_PAD)
        cv = tl.load(p_wtkv + o_nc, mask=m_nc, other=float("-inf"), volatile=True)
        ci = tl.load(p_wtki + o_nc, mask=m_nc, other=BIG, volatile=True)
        avail = m_nc & (ci < V)
        for r in tl.static_range(K):
            bv = tl.max(tl.where(avail, cv, float("-inf")), axis=1)
            bi = tl.min(tl.where(avail & (cv == bv[:, None]), ci, BIG), axis=1)
            tl.store(
                p_topk + (i_b * N + o) * K + r, tl.where(valid & (bi < BIG), bi, -1), mask=m_out
            )
            avail = avail & (ci != bi[:, None])
