"""Acceptance kernels (docs/design.md op 7): greedy and lossless sampling in one launch.

One program per (request b, node i, vocabulary split s) reads node i's logits once and writes
partial statistics to a small workspace: running max and its lowest id (the argmax), the sum of
``exp((x - max) / T)``, optionally the k largest (value, id) pairs, and for sampling rows with
top-k/top-p the exact threshold of the kept set. Each program then bumps a per-request counter
(release/acquire); the last of the request's ``N * S`` programs merges the partials of all nodes
(vectorised over nodes) and walks the tree in registers -- at most N steps, each a few O(N)
vector operations -- then writes the outputs and resets the counter to 0, so the launch can be
replayed in a CUDA graph without a memset. ``phase=1/2`` splits the same code into two launches
(node statistics, then one walker program per request) as a fallback.

Kept set of a sampling node (top-k, then top-p): the first C tokens in the order (logit
descending, id ascending), i.e. ``key(x_t) > thr or (key(x_t) == thr and t <= idcut)`` with
``key`` an order-preserving int32 image of the fp32 logit. Fast path (two passes over the row):
pass 1 also stores the maxima of groups of tokens; the k-th largest group maximum (top-k), or
the smallest group maximum whose running mass of group maxima reaches top_p (top-p only), is a
lower bound L of the threshold; pass 2 compacts every token >= L into CAP slots, which are
sorted in registers by (key, id) to read off C, thr, idcut, Z and the per-block masses. When k
exceeds the number of groups or more than CAP tokens reach L (a wide nucleus), an exact
multi-pivot search over the 2^32 keys runs instead (NPIV pivots per pass, 8 passes for
NPIV = 16, plus tie and mass passes). Rows without top-k/top-p read the logits once.

The walker finds the bonus token of a sampling node from the per-block kept masses that the
node's program stored, then scans that block (and the next ones only if rounding says so), so
no request rescans a whole row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeops._accept_inputs import Acceptance
from treeops._runtime import refuse_in_capture

BIG = tl.constexpr(2147483647)
INT32_MIN = tl.constexpr(-2147483648)


@triton.jit
def _key(x):
    """Order-preserving int32 image of an fp32 value (-0.0 and +0.0 both map to 0)."""
    bits = x.to(tl.int32, bitcast=True)
    k = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where(x == 0.0, 0, k)


@triton.jit
def _weight(x, m, T):
    """``exp((x - m) / T)``, 0 for x = -inf; as exp2 of one multiply (a per-element fp32
    division and natural exp would make pass 1 compute-bound on the H200 at V = 128K)."""
    return tl.where(x == float("-inf"), 0.0, tl.exp2((x - m) * (1.4426950408889634 / T)))


@triton.jit
def _kept(key, ids, thr, idcut):
    return (key > thr) | ((key == thr) & (ids <= idcut))


@triton.jit
def _count_search(
    p_row,
    stride_v,
    V,
    m,
    T,
    thr0,
    cut0,
    goal,
    lo,
    hi,
    USE_MASS: tl.constexpr,
    BLOCK: tl.constexpr,
    NPIV: tl.constexpr,
):
    """Largest key ``lo`` with f(lo) >= goal, f(P) = count (or mass) of kept-by-(thr0, cut0)
    tokens with key >= P. Invariant: f(lo) >= goal > f(hi) (f(hi) = 0 on entry). Returns
    (lo, f(lo + 1))."""
    o_p = tl.arange(0, NPIV)
    f_hi = tl.zeros([], dtype=tl.float32)
    while hi.to(tl.int64) - lo.to(tl.int64) > 1:
        span = hi.to(tl.int64) - lo.to(tl.int64)
        piv = (lo.to(tl.int64) + (span * (o_p + 1).to(tl.int64)) // (NPIV + 1)).to(tl.int32)
        acc = tl.zeros([NPIV], dtype=tl.float32)
        for v0 in range(0, V, BLOCK):
            o_v = v0 + tl.arange(0, BLOCK)
            m_v = o_v < V
            b_x = tl.load(p_row + o_v.to(tl.int64) * stride_v, mask=m_v, other=float("-inf")).to(
                tl.float32
            )
            b_k = _key(b_x)
            m_k = m_v & _kept(b_k, o_v, thr0, cut0)
            if USE_MASS:
                b_w = tl.where(m_k, _weight(b_x, m, T), 0.0)
            else:
                b_w = tl.where(m_k, 1.0, 0.0)
            ge = b_k[:, None] >= piv[None, :]  # [BLOCK, NPIV]
            acc += tl.sum(tl.where(ge, b_w[:, None], 0.0), axis=0)
        ok = acc >= goal
        new_lo = tl.max(tl.where(ok, piv, lo), axis=0)
        new_hi = tl.min(tl.where(ok, hi, piv), axis=0)
        f_new_hi = tl.max(tl.where(piv == new_hi, acc, -1.0), axis=0)
        f_hi = tl.where(new_hi == hi, f_hi, f_new_hi)
        lo = new_lo
        hi = new_hi
    return lo, f_hi


@triton.jit
def _tie_cut(
    p_row,
    stride_v,
    V,
    m,
    T,
    thr,
    thr0,
    cut0,
    base,
    goal,
    USE_MASS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Lowest id t with key == thr (and kept by (thr0, cut0)) at which base + running count (or
    mass) of such tokens in id order reaches ``goal``; the last such id if it never does."""
    run = base
    found = tl.full([], BIG, tl.int32)
    last = tl.full([], -1, tl.int32)
    for v0 in range(0, V, BLOCK):
        o_v = v0 + tl.arange(0, BLOCK)
        m_v = o_v < V
        b_x = tl.load(p_row + o_v.to(tl.int64) * stride_v, mask=m_v, other=float("-inf")).to(
            tl.float32
        )
        b_k = _key(b_x)
        eq = m_v & (b_k == thr) & _kept(b_k, o_v, thr0, cut0)
        if USE_MASS:
            b_w = tl.where(eq, _weight(b_x, m, T), 0.0)
        else:
            b_w = tl.where(eq, 1.0, 0.0)
        cs = run + tl.cumsum(b_w, 0)
        pos = tl.min(tl.where(eq & (cs >= goal), o_v, BIG), axis=0)
        found = tl.minimum(found, pos)
        last = tl.maximum(last, tl.max(tl.where(eq, o_v, -1), axis=0))
        run += tl.sum(b_w, axis=0)
    return tl.where(found < BIG, found, last)


@triton.jit
def _mass(p_row, stride_v, V, m, T, thr, cut, p_cs, p_cm, BLOCK: tl.constexpr, STORE: tl.constexpr):
    """Mass of the kept set; with STORE, also each block's mass (and m) for the walker."""
    z = tl.zeros([], dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        o_v = v0 + tl.arange(0, BLOCK)
        m_v = o_v < V
        b_x = tl.load(p_row + o_v.to(tl.int64) * stride_v, mask=m_v, other=float("-inf")).to(
            tl.float32
        )
        m_k = m_v & _kept(_key(b_x), o_v, thr, cut)
        b_z = tl.sum(tl.where(m_k, _weight(b_x, m, T), 0.0), axis=0)
        if STORE:
            tl.store(p_cs + v0 // BLOCK, b_z)
            tl.store(p_cm + v0 // BLOCK, m)
        z += b_z
    return z


@triton.jit
def _unkey(k):
    bits = tl.where(k >= 0, k, k ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fast_threshold(
    p_row,
    stride_v,
    V,
    m,
    T,
    z_all,
    k,
    top_p,
    use_k,
    use_p,
    p_gm,
    p_cand,
    p_cs,
    p_cm,
    NCH,
    BLOCK_V: tl.constexpr,
    NCH_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    CAP: tl.constexpr,
    SUB: tl.constexpr,
):
    """Kept set of a top-k/top-p row in two passes when it is small: a lower bound L on the
    threshold from the group maxima, every token >= L compacted into CAP slots, sorted in
    registers by (logit desc, id asc). Returns (thr, idcut, Z, ok); ok = 0 if L was not found
    or more than CAP tokens reach it (then the caller runs the exact search)."""
    tl.debug_barrier()  # group maxima were stored by other threads of this program
    o_g = tl.arange(0, G_PAD)
    n_g = (V + GROUP - 1) // GROUP
    gm = tl.load(p_gm + o_g, mask=o_g < n_g, other=float("-inf"))
    gs = tl.sort(gm, descending=True)
    L = tl.full([], float("-inf"), tl.float32)
    ok = n_g > 0
    if use_k:
        # k distinct group maxima are >= the k-th largest of them
        ok = k <= n_g
        L = tl.sum(tl.where(o_g == k - 1, gs, 0.0), axis=0)
    else:
        # tokens >= L carry at least the group maxima's mass, which reaches top_p * Z
        gw = tl.where(gs == float("-inf"), 0.0, tl.exp((gs - m) / T))
        cw = tl.cumsum(gw, 0)
        pos = tl.min(tl.where((cw >= top_p * z_all) & (o_g < n_g), o_g, G_PAD), axis=0)
        ok = pos < G_PAD
        L = tl.sum(tl.where(o_g == pos, gs, 0.0), axis=0)
    ok = ok & (L > float("-inf"))
    count = tl.zeros([], dtype=tl.int32)
    if ok:
        for v0 in range(0, V, BLOCK_V):
            o_v = v0 + tl.arange(0, BLOCK_V)
            m_v = o_v < V
            b_x = tl.load(p_row + o_v.to(tl.int64) * stride_v, mask=m_v, other=float("-inf")).to(
                tl.float32
            )
            sel = m_v & (b_x >= L)
            slot = count + tl.cumsum(sel.to(tl.int32), 0) - 1
            packed = (_key(b_x).to(tl.int64) << 32) | (2147483647 - o_v.to(tl.int64))
            tl.store(p_cand + slot, packed, mask=sel & (slot < CAP))
            count += tl.sum(sel.to(tl.int32), axis=0)
        ok = count <= CAP
    thr = tl.full([], INT32_MIN, tl.int32)
    cut = tl.zeros([], dtype=tl.int32) + V
    z = z_all
    if ok:
        tl.debug_barrier()
        o_c = tl.arange(0, CAP)
        cand = tl.load(p_cand + o_c, mask=o_c < count, other=-9223372036854775807 - 1)
        srt = tl.sort(cand, descending=True)
        k_s = (srt >> 32).to(tl.int32)
        id_s = (2147483647 - (srt & 0xFFFFFFFF)).to(tl.int32)
        x_s = _unkey(k_s)
        valid = o_c < count
        w_s = tl.where(valid, _weight(x_s, m, T), 0.0)
        C = count
        z_k = z_all
        if use_k:
            C = tl.minimum(C, k)
            z_k = tl.sum(tl.where(o_c < k, w_s, 0.0), axis=0)
        if use_p:
            cum = tl.cumsum(w_s, 0)
            c_p = tl.min(tl.where(valid & (cum >= top_p * z_k), o_c, CAP), axis=0) + 1
            C = tl.minimum(C, c_p)
        thr = tl.sum(tl.where(o_c == C - 1, k_s, 0), axis=0)
        cut = tl.sum(tl.where(o_c == C - 1, id_s, 0), axis=0)
        w_s = tl.where(o_c < C, w_s, 0.0)
        z = tl.sum(w_s, axis=0)
        # per-block kept mass for the walker, from the kept tokens (SUB of them at a time)
        tl.store(p_cand + o_c, srt)
        tl.debug_barrier()
        o_b = tl.arange(0, NCH_PAD)
        acc = tl.zeros([NCH_PAD], dtype=tl.float32)
        for c0 in range(0, C, SUB):
            o_s = c0 + tl.arange(0, SUB)
            m_s = o_s < C
            p_s = tl.load(p_cand + o_s, mask=m_s, other=0)
            i_s = (2147483647 - (p_s & 0xFFFFFFFF)).to(tl.int32)
            w = tl.where(m_s, _weight(_unkey((p_s >> 32).to(tl.int32)), m, T), 0.0)
            blk = i_s // BLOCK_V
            acc += tl.sum(
                tl.where(m_s[:, None] & (blk[:, None] == o_b[None, :]), w[:, None], 0.0), axis=0
            )
        tl.store(p_cs + o_b, acc, mask=o_b < NCH)
        tl.store(p_cm + o_b, m + tl.zeros([NCH_PAD], dtype=tl.float32), mask=o_b < NCH)
    return thr, cut, z, ok


@triton.jit
def _node_stats(
    pid,
    p_logits,
    s_lb,
    s_ln,
    s_lv,
    p_num_nodes,
    p_temp,
    p_topk_param,
    p_topp,
    p_wmax,
    p_warg,
    p_wse,
    p_wtkv,
    p_wtki,
    p_wthr,
    p_wcut,
    p_wcs,
    p_wcm,
    p_wgm,
    p_wcand,
    N,
    V,
    CHUNK,
    S: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_T: tl.constexpr,
    NPIV: tl.constexpr,
    NCH,
    NCH_PAD: tl.constexpr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    SAMPLE: tl.constexpr,
    NEED_SE: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    CAP: tl.constexpr,
    SUB: tl.constexpr,
):
    i_s = (pid % S).to(tl.int32)
    i_n = ((pid // S) % N).to(tl.int32)
    i_b = pid // (S * N)
    n = tl.load(p_num_nodes + i_b)
    active = i_n < n
    T = 1.0
    if SAMPLE:
        T_in = tl.load(p_temp + i_b).to(tl.float32)
        T = tl.where(T_in > 0, T_in, 1.0)
    p_row = p_logits + i_b * s_lb + i_n.to(tl.int64) * s_ln
    p_cs = p_wcs + pid * NCH
    p_cm = p_wcm + pid * NCH
    v_start = i_s * CHUNK
    v_end = tl.minimum(v_start + CHUNK, V)
    trunc = False
    if SAMPLE:
        k = tl.load(p_topk_param + i_b).to(tl.int32)
        top_p = tl.load(p_topp + i_b).to(tl.float32)
        use_k = (k > 0) & (k < V)
        use_p = top_p < 1.0
        trunc = active & (T_in > 0) & (use_k | use_p)
    p_gm = p_wgm + pid * G_PAD
    m = tl.full([], float("-inf"), tl.float32)
    arg = tl.full([], BIG, tl.int32)
    se = tl.zeros([], dtype=tl.float32)
    o_k = tl.arange(0, K_PAD)
    tkv = tl.where(o_k < K, float("-inf"), float("inf"))
    tki = V + o_k
    if active:
        for v0 in range(v_start, v_end, BLOCK_V):
            o_v = v0 + tl.arange(0, BLOCK_V)
            m_v = o_v < v_end
            # upcast right after the load: bf16 arithmetic is wrong under the interpreter
            b_x = tl.load(p_row + o_v.to(tl.int64) * s_lv, mask=m_v, other=float("-inf")).to(
                tl.float32
            )
            b_m = tl.max(b_x, axis=0)
            b_a = tl.min(tl.where(m_v & (b_x == b_m), o_v, BIG), axis=0)
            arg = tl.where((b_m > m) | ((b_m == m) & (b_a < arg)), b_a, arg)
            new_m = tl.maximum(m, b_m)
            if NEED_SE:
                scale = tl.where(new_m == float("-inf"), 1.0, tl.exp((m - new_m) / T))
                b_z = tl.sum(tl.where(m_v, _weight(b_x, new_m, T), 0.0), axis=0)
                se = se * scale + b_z
                if SAMPLE:
                    # per-block mass (relative to the running max) lets the walker find the
                    # block of the bonus token without rescanning the row
                    tl.store(p_cs + v0 // BLOCK_V, b_z)
                    tl.store(p_cm + v0 // BLOCK_V, new_m)
                    if trunc:
                        # maxima of groups of GROUP tokens: distinct tokens, so the k-th largest
                        # group maximum bounds the k-th largest logit from below
                        o_g = v0 // GROUP + tl.arange(0, BLOCK_V // GROUP)
                        b_g = tl.max(tl.reshape(b_x, [BLOCK_V // GROUP, GROUP]), axis=1)
                        tl.store(p_gm + o_g, b_g, mask=o_g < G_PAD)
            m = new_m
            if K > 0:
                # insert the block's better elements into the unsorted top-K buffer; after the
                # first blocks most blocks insert nothing (one max-reduction each)
                taken = o_v < 0
                wv = tl.min(tkv, axis=0)
                wi = tl.max(tl.where(tkv == wv, tki, -1), axis=0)
                cv = tl.max(tl.where(m_v & ~taken, b_x, float("-inf")), axis=0)
                ci = tl.min(tl.where(m_v & ~taken & (b_x == cv), o_v, BIG), axis=0)
                better = (ci < BIG) & ((cv > wv) | ((cv == wv) & (ci < wi)))
                while better:
                    lane = (tkv == wv) & (tki == wi)
                    tkv = tl.where(lane, cv, tkv)
                    tki = tl.where(lane, ci, tki)
                    taken = taken | (o_v == ci)
                    wv = tl.min(tkv, axis=0)
                    wi = tl.max(tl.where(tkv == wv, tki, -1), axis=0)
                    cv = tl.max(tl.where(m_v & ~taken, b_x, float("-inf")), axis=0)
                    ci = tl.min(tl.where(m_v & ~taken & (b_x == cv), o_v, BIG), axis=0)
                    better = (ci < BIG) & ((cv > wv) | ((cv == wv) & (ci < wi)))
    o_w = pid.to(tl.int64)
    if SAMPLE:
        lo0 = tl.full([], INT32_MIN, tl.int32)
        thr = lo0
        cut = tl.zeros([], dtype=tl.int32) + V
        if trunc:
            hi = _key(m) + 1
            thr, cut, z, fast = _fast_threshold(
                p_row,
                s_lv,
                V,
                m,
                T,
                se,
                k,
                top_p,
                use_k,
                use_p,
                p_gm,
                p_wcand + pid * CAP,
                p_cs,
                p_cm,
                NCH,
                BLOCK_V,
                NCH_PAD,
                GROUP,
                G_PAD,
                CAP,
                SUB,
            )
            if fast:
                se = z
            else:
                # exact multi-pivot search over the whole row (wide nucleus, k beyond CAP)
                if use_k:
                    thr, f_gt = _count_search(
                        p_row,
                        s_lv,
                        V,
                        m,
                        T,
                        lo0,
                        cut,
                        k.to(tl.float32),
                        lo0,
                        hi,
                        False,
                        BLOCK_T,
                        NPIV,
                    )
                    cut = _tie_cut(
                        p_row, s_lv, V, m, T, thr, lo0, cut, f_gt, k.to(tl.float32), False, BLOCK_T
                    )
                if use_p:
                    # the mass top-p is relative to: all tokens (pass 1's sum) or the top-k set
                    z_k = se
                    if use_k:
                        z_k = _mass(p_row, s_lv, V, m, T, thr, cut, p_cs, p_cm, BLOCK_T, False)
                    goal = top_p * z_k
                    thr_p, f_gt = _count_search(
                        p_row, s_lv, V, m, T, thr, cut, goal, thr, hi, True, BLOCK_T, NPIV
                    )
                    cut = _tie_cut(p_row, s_lv, V, m, T, thr_p, thr, cut, f_gt, goal, True, BLOCK_T)
                    thr = thr_p
                se = _mass(p_row, s_lv, V, m, T, thr, cut, p_cs, p_cm, BLOCK_V, True)
        tl.store(p_wthr + o_w, thr)
        tl.store(p_wcut + o_w, cut)
    tl.store(p_wmax + o_w, m)
    tl.store(p_warg + o_w, arg)
    tl.store(p_wse + o_w, se)
    if K > 0:
        tl.store(p_wtkv + o_w * K_PAD + o_k, tkv)
        tl.store(p_wtki + o_w * K_PAD + o_k, tki)


@triton.jit
def _greedy_walk(n, valid, par, tok, arg, nz, N, N_PAD: tl.constexpr):
    """Follow the child whose token is the node's argmax; emit the argmax at every node."""
    o = tl.arange(0, N_PAD)
    path = tl.where(o == 0, 0, -1)
    em = tl.full([N_PAD], -1, tl.int64)
    lp = tl.zeros([N_PAD], dtype=tl.float32)
    cur = tl.zeros([], dtype=tl.int32)
    L = tl.where(n > 0, 1, 0)
    going = n > 0
    while going:
        am = tl.sum(tl.where(o == cur, arg, 0), axis=0)
        z_c = tl.sum(tl.where(o == cur, nz, 0.0), axis=0)
        # the argmax's weight is exp(0) = 1: log p = -log Z
        lp = tl.where(o == L - 1, -tl.log(z_c), lp)
        em = tl.where(o == L - 1, am.to(tl.int64), em)
        nxt = tl.min(
            tl.where(valid & (o > 0) & (par == cur) & (tok == am.to(tl.int64)), o, BIG), axis=0
        )
        going = nxt < BIG
        if going:
            path = tl.where(o == L, nxt, path)
            L += 1
            cur = nxt
            going = L <= N
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
    """docs/design.md op 7's interval rule, node by node, in unnormalised weights: u * Z is laid out
    as the kept children's weights in sibling (= index) order, then every other kept token's
    weight in id order."""
    o = tl.arange(0, N_PAD)
    path = tl.where(o == 0, 0, -1)
    em = tl.full([N_PAD], -1, tl.int64)
    lp = tl.zeros([N_PAD], dtype=tl.float32)
    cur = tl.zeros([], dtype=tl.int32)
    L = tl.where(n > 0, 1, 0)
    going = n > 0
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
    while going:
        m_c = tl.sum(tl.where(o == cur, nm, 0.0), axis=0)
        z_c = tl.sum(tl.where(o == cur, nz, 0.0), axis=0)
        thr_c = tl.sum(tl.where(o == cur, thr, 0), axis=0)
        cut_c = tl.sum(tl.where(o == cur, cutv, 0), axis=0)
        u = tl.load(p_uni + i_b * s_ub + cur).to(tl.float32)
        p_row = p_logits + i_b * s_lb + cur.to(tl.int64) * s_ln
        ch = cand & (par == cur)
        xc = tl.load(p_row + tok * s_lv, mask=ch, other=float("-inf")).to(tl.float32)
        wc = tl.where(
            ch & _kept(_key(xc), tok.to(tl.int32), thr_c, cut_c), _weight(xc, m_c, T), 0.0
        )
        cum = tl.cumsum(wc, 0)
        goal = u * z_c
        hit = tl.min(tl.where(ch & (wc > 0) & (cum > goal), o, BIG), axis=0)
        if hit == BIG:
            # u lies past the children: scan every other kept token in id order
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
                    b_w = tl.where(o_v.to(tl.int64) == t, 0.0, b_w)
                    rem = rem & (tok != t)
                cs = run + tl.cumsum(b_w, 0)
                found = tl.min(tl.where((b_w > 0) & (cs > goal2), o_v, BIG), axis=0)
                last = tl.maximum(last, tl.max(tl.where(b_w > 0, o_v, -1), axis=0))
                run += tl.sum(b_w, axis=0)
                v0 += BLOCK_V
            if (found == BIG) & (last >= 0):
                found = last
            if found == BIG:
                # rounding past the end with every kept token a child: the last child's piece
                hit = tl.max(tl.where(ch & (wc > 0), o, -1), axis=0)
                hit = tl.where(hit < 0, BIG, hit)
            else:
                x_b = tl.load(p_row + found.to(tl.int64) * s_lv).to(tl.float32)
                lp = tl.where(o == L - 1, (x_b - m_c) / T - tl.log(z_c), lp)
                em = tl.where(o == L - 1, found.to(tl.int64), em)
        if hit < BIG:
            x_h = tl.sum(tl.where(o == hit, xc, 0.0), axis=0)
            lp = tl.where(o == L - 1, (x_h - m_c) / T - tl.log(z_c), lp)
            em = tl.where(o == L - 1, tl.sum(tl.where(o == hit, tok, 0), axis=0), em)
            path = tl.where(o == L, hit, path)
            L += 1
            cur = hit
            going = L <= N
        else:
            going = hit < 0
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
):
    i_b = i_b.to(tl.int64)
    o = tl.arange(0, N_PAD)
    n = tl.load(p_num_nodes + i_b)
    valid = o < n
    par = tl.load(p_parents + i_b * s_pb + o, mask=valid, other=-1)
    tok = tl.load(p_tokens + i_b * s_tb + o, mask=valid, other=-1).to(tl.int64)
    T = 1.0
    if SAMPLE:
        T_in = tl.load(p_temp + i_b).to(tl.float32)
        T = tl.where(T_in > 0, T_in, 1.0)
    # merge the per-split partials of every node: [N_PAD, S_PAD]
    o_s = tl.arange(0, S_PAD)
    o_ns = (i_b * N + o[:, None]) * S + o_s[None, :]
    m_ns = valid[:, None] & (o_s[None, :] < S)
    pm = tl.load(p_wmax + o_ns, mask=m_ns, other=float("-inf"), volatile=True)
    pa = tl.load(p_warg + o_ns, mask=m_ns, other=BIG, volatile=True)
    ps = tl.load(p_wse + o_ns, mask=m_ns, other=0.0, volatile=True)
    nm = tl.max(pm, axis=1)
    arg = tl.min(tl.where(pm == nm[:, None], pa, BIG), axis=1)
    sc = tl.where(pm == float("-inf"), 0.0, tl.exp((pm - nm[:, None]) / T))
    nz = tl.sum(ps * sc, axis=1)  # Z of each node: sum of exp((x - max) / T) over its kept set
    if SAMPLE:
        thr = tl.load(p_wthr + i_b * N + o, mask=valid, other=INT32_MIN, volatile=True)
        cutv = tl.load(p_wcut + i_b * N + o, mask=valid, other=0, volatile=True)
    # walk: path[d] = node at depth d; em[q] = (q+1)-th emitted token; lp[q] its log-prob
    if SAMPLE:
        if T_in > 0:
            path, em, lp, L = _sample_walk(
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
                N_PAD,
                BLOCK_V,
                NCH_PAD,
            )
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


@triton.jit(do_not_specialize=["B", "N", "V", "CHUNK", "NCH", "n_stop"])
def _accept_kernel(
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
    p_topk_param,
    p_topp,
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
    p_wcs,
    p_wcm,
    p_wgm,
    p_wcand,
    p_count,
    p_acc,
    p_len,
    p_bonus,
    p_lp,
    p_topk,
    B,
    N,
    V,
    CHUNK,
    NCH,
    N_PAD: tl.constexpr,
    S: tl.constexpr,
    S_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_T: tl.constexpr,
    NPIV: tl.constexpr,
    NCH_PAD: tl.constexpr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    SAMPLE: tl.constexpr,
    NEED_SE: tl.constexpr,
    HAS_STOP: tl.constexpr,
    STOP_PAD: tl.constexpr,
    HAS_BUDGET: tl.constexpr,
    HAS_LP: tl.constexpr,
    PHASE: tl.constexpr,
    FENCE: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    CAP: tl.constexpr,
    SUB: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    if PHASE != 2:
        _node_stats(
            pid,
            p_logits,
            s_lb,
            s_ln,
            s_lv,
            p_num_nodes,
            p_temp,
            p_topk_param,
            p_topp,
            p_wmax,
            p_warg,
            p_wse,
            p_wtkv,
            p_wtki,
            p_wthr,
            p_wcut,
            p_wcs,
            p_wcm,
            p_wgm,
            p_wcand,
            N,
            V,
            CHUNK,
            S,
            BLOCK_V,
            BLOCK_T,
            NPIV,
            NCH,
            NCH_PAD,
            K,
            K_PAD,
            SAMPLE,
            NEED_SE,
            GROUP,
            G_PAD,
            CAP,
            SUB,
        )
    if PHASE == 0:
        i_b = pid // (S * N)
        if FENCE:
            # every thread's workspace stores are ordered before the release below
            tl.inline_asm_elementwise(
                "fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
            )
        tl.debug_barrier()
        count = tl.atomic_add(p_count + i_b, 1, sem="acq_rel", scope="gpu")
        if count == N * S - 1:
            _walk(
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
                N_PAD,
                S,
                S_PAD,
                BLOCK_V,
                NCH_PAD,
                K,
                K_PAD,
                SAMPLE,
                HAS_STOP,
                STOP_PAD,
                HAS_BUDGET,
                HAS_LP,
            )
            tl.store(p_count + i_b, 0)
    if PHASE == 2:
        _walk(
            pid,
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
            N_PAD,
            S,
            S_PAD,
            BLOCK_V,
            NCH_PAD,
            K,
            K_PAD,
            SAMPLE,
            HAS_STOP,
            STOP_PAD,
            HAS_BUDGET,
            HAS_LP,
        )


def _pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


_COUNTERS: dict[torch.device, torch.Tensor] = {}
# every counter buffer ever handed out stays alive: a CUDA graph captured with an older, smaller
# one keeps replaying atomics into it after a larger batch made a new one
_RETIRED: list[torch.Tensor] = []


def _counters(device: torch.device, B: int) -> torch.Tensor:
    """Per-request arrival counters, zero between launches (the last arriver resets its own).
    Cached per device so that a launch allocates nothing and needs no memset. Built by an eager
    call (a miss during CUDA-graph capture raises): a graph captured on another stream than its
    warm-up's still finds them. Launches that run concurrently on different streams must not
    share them: one stream per device, or ``workspace`` (kernel-level ``accept_launch``)."""
    c = _COUNTERS.get(device)
    if c is None or c.numel() < B:
        refuse_in_capture("accept's arrival counters (per device, up to the largest batch)")
        if c is not None:
            _RETIRED.append(c)
        c = torch.zeros(max(B, 64), dtype=torch.int32, device=device)
        _COUNTERS[device] = c
    return c


def _interpreted() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def default_splits(B: int, N: int, V: int, device: torch.device, block_v: int) -> int:
    """Vocabulary splits per node for greedy: enough programs to fill the GPU twice over, each
    split at least two blocks long. Depends on capacities and the SM count only."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    s = 1
    while B * N * s < 2 * sms and s * 2 * block_v * 2 <= V and s < 16:
        s *= 2
    return s


def accept_launch(
    tree,
    target_logits,
    *,
    temperature=None,
    top_k=None,
    top_p=None,
    uniforms=None,
    stop_ids=None,
    max_new_tokens=None,
    return_logprobs=False,
    topk_ids=0,
    out=None,
    num_splits=None,
    block_v=None,
    phase=None,
    workspace=None,
    num_pivots=16,
    cap=None,
    max_groups=None,
) -> Acceptance:
    """Launch the acceptance kernel (greedy when ``uniforms`` is None). Inputs are assumed
    validated by ``treeops.accept``. ``phase=0``: one fused launch; ``phase=1``: two launches
    (node statistics, then the walk), a fallback. ``num_splits``/``block_v`` override the
    defaults (tests use small ones to exercise the split and block loops). The default phase is
    0, or ``TREEOPS_ACCEPT_PHASE`` from the environment."""
    if phase is None:
        import os

        phase = int(os.environ.get("TREEOPS_ACCEPT_PHASE", "0"))
    B, N, V = target_logits.shape
    dev = target_logits.device
    sample = uniforms is not None
    if block_v is None:
        block_v = min(4096 if not sample else 2048, _pow2(V))
    block_t = max(16, min(block_v, 512))
    if sample:
        S = 1
    else:
        S = num_splits if num_splits is not None else default_splits(B, N, V, dev, block_v)
    per_split = -(-V // S)
    chunk = -(-per_split // block_v) * block_v
    K = int(topk_ids)
    K_PAD = _pow2(max(K, 1))
    if out is None:
        out = Acceptance(
            torch.empty(B, N, dtype=torch.int32, device=dev),
            torch.empty(B, dtype=torch.int32, device=dev),
            torch.empty(B, dtype=torch.int64, device=dev),
            torch.empty(B, N, dtype=torch.float32, device=dev) if return_logprobs else None,
            torch.empty(B, N, K, dtype=torch.int32, device=dev) if K else None,
        )
    NCH = -(-V // block_v) if sample else 1
    # top-k/top-p fast path: group maxima (at most max_groups groups) and CAP candidate slots,
    # both sorted in registers (512 each on the GPU; 64 under the interpreter, whose tl.sort
    # takes about a second for 1024 elements)
    if cap is None:
        cap = 64 if _interpreted() else 512
    if max_groups is None:
        max_groups = 64 if _interpreted() else 512
    group = min(block_v, _pow2(-(-V // max_groups)))
    G_PAD = _pow2(-(-V // group))
    CAP = _pow2(cap)
    BNS = B * N * S
    n_f = [
        BNS,
        BNS,
        BNS * K_PAD if K else 1,
        B * N * NCH if sample else 1,
        B * N * NCH if sample else 1,
    ]
    n_i = [BNS, BNS * K_PAD if K else 1, B * N if sample else 1, B * N if sample else 1]
    n_f.append(B * N * G_PAD if sample else 1)
    if workspace is None:
        ws_f = torch.empty(sum(n_f), dtype=torch.float32, device=dev)
        ws_i = torch.empty(sum(n_i), dtype=torch.int32, device=dev)
        count = _counters(dev, B)
    else:
        ws_f, ws_i, count = workspace
    w_max, w_se, w_tkv, w_cs, w_cm, w_gm = torch.split(ws_f[: sum(n_f)], n_f)
    w_cand = torch.empty(B * N * CAP if sample else 1, dtype=torch.int64, device=dev)
    w_arg, w_tki, w_thr, w_cut = torch.split(ws_i[: sum(n_i)], n_i)
    dummy_f = w_se
    has_stop = stop_ids is not None
    n_stop = stop_ids.shape[-1] if has_stop else 0
    s_sb = (stop_ids.stride(0) if stop_ids.dim() == 2 else 0) if has_stop else 0
    tk, tp = tree.tokens, tree.parents
    num_warps = 8 if (block_v >= 4096 or sample) and not _interpreted() else 4
    common = dict(
        N_PAD=_pow2(N),
        S=S,
        S_PAD=_pow2(S),
        BLOCK_V=block_v,
        BLOCK_T=block_t,
        NPIV=num_pivots,
        NCH_PAD=_pow2(NCH),
        K=K,
        K_PAD=K_PAD,
        SAMPLE=sample,
        NEED_SE=sample or bool(return_logprobs),
        HAS_STOP=has_stop,
        STOP_PAD=_pow2(max(n_stop, 1)),
        HAS_BUDGET=max_new_tokens is not None,
        HAS_LP=bool(return_logprobs),
        FENCE=not _interpreted(),
        GROUP=group,
        G_PAD=G_PAD,
        CAP=CAP,
        SUB=min(128, CAP),
        num_warps=num_warps,
    )
    args = [
        target_logits,
        target_logits.stride(0),
        target_logits.stride(1),
        target_logits.stride(2),
        tk,
        tk.stride(0),
        tp,
        tp.stride(0),
        tree.num_nodes,
        temperature if sample else dummy_f,
        top_k if sample else w_arg,
        top_p if sample else dummy_f,
        uniforms if sample else dummy_f,
        uniforms.stride(0) if sample else 0,
        stop_ids if has_stop else w_arg,
        s_sb,
        n_stop,
        max_new_tokens if max_new_tokens is not None else w_arg,
        w_max,
        w_arg,
        w_se,
        w_tkv,
        w_tki,
        w_thr,
        w_cut,
        w_cs,
        w_cm,
        w_gm,
        w_cand,
        count,
        out.accepted,
        out.accept_len,
        out.bonus,
        out.logprobs if return_logprobs else dummy_f,
        out.topk if K else w_arg,
        B,
        N,
        V,
        chunk,
        NCH,
    ]
    assert tk.stride(1) == 1 and tp.stride(1) == 1, "tree fields are contiguous along N"
    if phase == 0:
        _accept_kernel[(B * N * S,)](*args, PHASE=0, **common)
    else:
        _accept_kernel[(B * N * S,)](*args, PHASE=1, **common)
        _accept_kernel[(B,)](*args, PHASE=2, **common)
    return out
