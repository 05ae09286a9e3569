"""Acceptance, per-node statistics (pass 1 of ``treeops.kernels.accept``'s launches) and the
kept-set helpers of pass 2 (``accept_thresh``).

One program per (request, node, vocabulary split) streams its slice of the node's logits once:
the running max and its lowest id, the sum of ``exp((x - max) / T)``, optionally the k largest
(value, id) pairs and, for sampling, per-block masses and (top-k/top-p rows) group maxima.
Results go to the launch's workspace, which pass 2 and the walker (``accept_walk``) merge.
"""

from __future__ import annotations

import triton
import triton.language as tl

BIG = tl.constexpr(2147483647)
INT32_MIN = tl.constexpr(-2147483648)
KEY_NONE = tl.constexpr(-9223372036854775808)  # below every ``_pair_key``
KEY_NEG_INF = tl.constexpr(-2139095041)  # ``_key(-inf)``, the least key of a non-NaN value


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
def _at_least(k):
    """The value v with ``x >= v`` exactly when ``_key(x) >= k``, for every non-NaN fp32 x:
    -inf for a key at or below -inf's, NaN (nothing) for one above +inf's. A row's passes then
    compare values, one instruction, where keys would take five per element."""
    return tl.where(k <= KEY_NEG_INF, float("-inf"), _unkey(k))


@triton.jit
def _kept_bound(thr, idcut):
    """(tv, cut) with ``_kept_v(x, ids, tv, cut) == _kept(_key(x), ids, thr, idcut)`` for every
    non-NaN x: tv the value whose key is thr; below -inf's key, -inf and every id."""
    below = thr < KEY_NEG_INF
    return _at_least(thr), tl.where(below, BIG, idcut)


@triton.jit
def _kept_v(x, ids, tv, idcut):
    """``_kept`` on values: x above tv, or equal to it (-0.0 equals 0.0, as their keys do) at an
    id up to idcut."""
    return (x > tv) | ((x == tv) & (ids <= idcut))


@triton.jit
def _count_search(
    p_row,
    stride_v,
    V,
    m,
    T,
    goal,
    lo,
    hi,
    f_lo,
    USE_MASS: tl.constexpr,
    BLOCK: tl.constexpr,
    NPIV: tl.constexpr,
):
    """Largest key ``lo`` with f(lo) >= goal, f(P) = count (or mass) of the kept tokens with
    key >= P. Invariant: f(lo) >= goal > f(hi) (f(hi) = 0 on entry); ``f_lo`` is f(lo) or a
    bound above it (the row's total). Returns (lo, f(lo + 1)). The entry ``lo`` is at or above
    the kept set's threshold key, so every pivot (strictly above ``lo``) is above it and every
    token at or above a pivot is kept: a pass tests no token's membership.

    A pass over the row places pivots in (lo, hi) and keeps the two around the goal: NPIV 1,
    two of the keys' midpoint, the values' and the interpolated one (below); else NPIV keys
    spread evenly. The keys of bf16 (fp16) logits differ only above their low 16 (13) bits, so
    the search runs on ``key >> SHIFT`` (order-preserving and one-to-one on those keys): half
    the passes. A pass sums into
    per-slot accumulators, reduced once at its end, so that an iteration waits on its loads
    only (one program scans the whole row), and compares values with the pivots' values
    (``_at_least``), not keys."""
    SHIFT: tl.constexpr = (
        16
        if p_row.dtype.element_ty == tl.bfloat16
        else (13 if p_row.dtype.element_ty == tl.float16 else 0)
    )
    o_p = tl.arange(0, NPIV)
    f_hi = tl.zeros([], dtype=tl.float32)
    # in SHIFT space: F(a) = f(a << SHIFT), so F(lo >> SHIFT) >= f(lo) >= goal and
    # F(((hi - 1) >> SHIFT) + 1) <= f(hi) < goal
    lo = lo >> SHIFT
    hi = ((hi - 1) >> SHIFT) + 1
    o_b = tl.arange(0, BLOCK)
    slow = lo < lo  # the last pass left more than half the keys' span
    while hi.to(tl.int64) - lo.to(tl.int64) > 1:
        span = hi.to(tl.int64) - lo.to(tl.int64)
        if NPIV == 1:
            # two pivots: the value where f, linear between the bracket's ends, meets the goal
            # (the row's mass is smooth where its values are dense) and the values' midpoint,
            # or after a pass that did not halve the keys' span, the keys' midpoint (so the
            # passes stay within twice the keys' bisection where values bunch near 0, on rows
            # of tiny or equal logits); each counted in a [BLOCK] accumulator in the load's
            # layout (a [BLOCK, NPIV] tile would take the loaded tile through shared memory,
            # and a barrier, every iteration). bench/exact_passes.py counts the passes.
            o_2 = tl.arange(0, 2)
            piv_k = (lo.to(tl.int64) + span // 2).to(tl.int32)
            v_lo = _at_least(lo << SHIFT)
            v_hi = _at_least(hi << SHIFT)
            fin = (v_lo > float("-inf")) & (v_hi == v_hi)
            piv_v = _key(0.5 * v_lo + 0.5 * v_hi) >> SHIFT
            piv_v = tl.where(fin & (piv_v > lo) & (piv_v < hi), piv_v, piv_k)
            r = (f_lo - goal) / (f_lo - f_hi)
            piv_i = _key(v_lo + r * (v_hi - v_lo)) >> SHIFT
            piv_i = tl.where(fin, tl.minimum(tl.maximum(piv_i, lo + 1), hi - 1), piv_k)
            piv = tl.where(o_2 == 0, piv_i, tl.where(slow, piv_k, piv_v))
        else:
            piv = (lo.to(tl.int64) + (span * (o_p + 1).to(tl.int64)) // (NPIV + 1)).to(tl.int32)
        # the pivots as values: key >> SHIFT >= piv exactly when x >= _at_least(piv << SHIFT)
        pv = _at_least(piv << SHIFT)
        pv_lo = tl.min(pv, axis=0)
        pv_hi = tl.max(pv, axis=0)
        acc_lo = tl.zeros([BLOCK], dtype=tl.float32)
        acc_hi = tl.zeros([BLOCK], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK, NPIV], dtype=tl.float32)
        # each iteration issues the next tile's loads before it counts this one: one program
        # streams the row, so a tile's memory latency is otherwise waited out in full
        nxt = tl.load(p_row + o_b.to(tl.int64) * stride_v, mask=o_b < V, other=float("-inf"))
        for v0 in range(0, V, BLOCK):
            o_v = v0 + o_b
            m_v = o_v < V
            b_x = nxt.to(tl.float32)
            o_n = o_v + BLOCK
            nxt = tl.load(p_row + o_n.to(tl.int64) * stride_v, mask=o_n < V, other=float("-inf"))
            if USE_MASS:
                b_w = _weight(b_x, m, T)  # 0 past V (loaded as -inf)
            else:
                b_w = tl.where(m_v, 1.0, 0.0)
            if NPIV == 1:
                acc_lo += tl.where(b_x >= pv_lo, b_w, 0.0)
                acc_hi += tl.where(b_x >= pv_hi, b_w, 0.0)
            else:
                ge = b_x[:, None] >= pv[None, :]  # [BLOCK, NPIV]
                acc2 += tl.where(ge, b_w[:, None], 0.0)
        if NPIV == 1:
            acc = tl.where(pv == pv_hi, tl.sum(acc_hi, axis=0), tl.sum(acc_lo, axis=0))
        else:
            acc = tl.sum(acc2, axis=0)
        ok = acc >= goal
        new_lo = tl.max(tl.where(ok, piv, lo), axis=0)
        new_hi = tl.min(tl.where(ok, hi, piv), axis=0)
        f_new_hi = tl.max(tl.where(piv == new_hi, acc, -1.0), axis=0)
        f_hi = tl.where(new_hi == hi, f_hi, f_new_hi)
        f_new_lo = tl.max(tl.where(piv == new_lo, acc, -1.0), axis=0)
        f_lo = tl.where(new_lo == lo, f_lo, f_new_lo)
        slow = (new_hi.to(tl.int64) - new_lo.to(tl.int64)) * 2 > span
        lo = new_lo
        hi = new_hi
    # back to a whole key: the one key with these high bits (a negative key's low SHIFT bits
    # are all ones, ``_key``'s image of a negative value)
    if SHIFT > 0:
        lo = (lo << SHIFT) | tl.where(lo < 0, (1 << SHIFT) - 1, 0)
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
    tv0, cut0 = _kept_bound(thr0, cut0)
    tv = _at_least(thr)  # thr is a token's key: x == tv exactly when _key(x) == thr
    for v0 in range(0, V, BLOCK):
        o_v = v0 + tl.arange(0, BLOCK)
        m_v = o_v < V
        b_x = tl.load(p_row + o_v.to(tl.int64) * stride_v, mask=m_v, other=float("-inf")).to(
            tl.float32
        )
        eq = m_v & (b_x == tv) & _kept_v(b_x, o_v, tv0, cut0)
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
    tv, cut = _kept_bound(thr, cut)
    for v0 in range(0, V, BLOCK):
        o_v = v0 + tl.arange(0, BLOCK)
        m_v = o_v < V
        b_x = tl.load(p_row + o_v.to(tl.int64) * stride_v, mask=m_v, other=float("-inf")).to(
            tl.float32
        )
        m_k = m_v & _kept_v(b_x, o_v, tv, cut)
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
def _pair_key(x, ids):
    """(fp32 value, int32 id >= 0) as one int64, ordered by value, then by lower id (the
    greedy argmax's tie rule): ``_key(x)`` in the high half, ``2^31 - 1 - id`` in the low."""
    return (_key(x).to(tl.int64) << 32) | (2147483647 - ids).to(tl.int64)


@triton.jit
def _lower_bound(
    p_gm,
    V,
    m,
    T,
    z_all,
    k,
    top_p,
    use_k,
    G_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    GC: tl.constexpr,
):
    """Lower bound L of a top-k/top-p row's threshold from its group maxima ``p_gm`` [G_PAD]
    (the max of each GROUP tokens; -inf past the row), taken over GC coarse groups (G_PAD / GC
    consecutive groups each, so that only GC values are sorted): the k-th largest coarse maximum
    (top-k), or the smallest coarse maximum at which the running mass of the sorted coarse maxima
    reaches top_p * z_all (top-p only). Returns (L, ok); ok = 0 when no such bound exists.

    Coarse groups are disjoint sets of tokens, so k of them reaching L means k tokens do; the
    fine maxima then tell ``_gather_candidates`` which GROUP-token groups to reread."""
    n_g = (V + GROUP - 1) // GROUP
    R: tl.constexpr = G_PAD // GC
    o_g = tl.arange(0, GC)
    # coarse group c is fine groups [c R, c R + R): one strided [GC] load per offset keeps GC
    # values live instead of G_PAD (a [G_PAD] load took registers enough to halve the
    # programs an SM holds; the maxima are a few KB per node, in L2)
    gm = tl.full([GC], float("-inf"), tl.float32)
    for r in tl.static_range(R):
        o_f = o_g * R + r
        gm = tl.maximum(gm, tl.load(p_gm + o_f, mask=o_f < n_g, other=float("-inf"), volatile=True))
    n_c = (n_g + R - 1) // R  # coarse groups holding a token
    gs = tl.sort(gm, descending=True)
    L = tl.full([], float("-inf"), tl.float32)
    ok = n_c > 0
    if use_k:
        # k distinct coarse maxima are >= the k-th largest of them
        ok = k <= n_c
        L = tl.sum(tl.where(o_g == k - 1, gs, 0.0), axis=0)
    else:
        # tokens >= L carry at least the coarse maxima's mass, which reaches top_p * Z
        gw = tl.where(gs == float("-inf"), 0.0, tl.exp((gs - m) / T))
        cw = tl.cumsum(gw, 0)
        pos = tl.min(tl.where((cw >= top_p * z_all) & (o_g < n_c), o_g, GC), axis=0)
        ok = pos < GC
        L = tl.sum(tl.where(o_g == pos, gs, 0.0), axis=0)
    return L, ok & (L > float("-inf"))


@triton.jit
def _gather_candidates(p_row, stride_v, V, L, p_gm, p_sel, p_cand, GROUP: tl.constexpr,
                       G_PAD: tl.constexpr, GC: tl.constexpr, CAP: tl.constexpr,
                       READ: tl.constexpr):  # fmt: skip
    """Store every token of the row with logit >= L into ``p_cand`` [CAP] as (key << 32 |
    (2^31 - 1 - id)) int64 (the first CAP of them, in no particular order) and return how many
    there are (possibly > CAP). Reads only the groups whose maximum (``p_gm`` [G_PAD]) reaches
    L, READ // GROUP of them (at least one) at a time; their ids go through ``p_sel`` [G_PAD]
    int32, each read's ids loaded beside the read before (so a read is one memory latency, not
    two). Each read waits on the one before (the running count), so fine groups, few tokens
    each, are what keeps the number of reads low. The group maxima are scanned GC at a time
    (registers for GC values, not G_PAD), their selected ids appended in order."""
    n_g = (V + GROUP - 1) // GROUP
    o_c = tl.arange(0, GC)
    n_sel = tl.zeros([], dtype=tl.int32)
    for g0 in tl.static_range(0, G_PAD, GC):
        o_g = g0 + o_c
        gm = tl.load(p_gm + o_g, mask=o_g < n_g, other=float("-inf"), volatile=True)
        sel_g = (o_g < n_g) & (gm >= L)
        pos = n_sel + tl.cumsum(sel_g.to(tl.int32), 0) - 1
        tl.store(p_sel + pos, o_g, mask=sel_g)
        n_sel += tl.sum(sel_g.to(tl.int32), axis=0)
    tl.debug_barrier()  # the group ids are read back by other threads of this program
    R: tl.constexpr = READ // GROUP if GROUP < READ else 1
    o_t = tl.arange(0, GROUP)
    count = tl.zeros([], dtype=tl.int32)
    o_R = tl.arange(0, R)
    gid_next = tl.load(p_sel + o_R, mask=o_R < n_sel, other=0, volatile=True)
    for r0 in range(0, n_sel, R):
        o_r = r0 + o_R
        m_r = o_r < n_sel
        gid = gid_next
        tid = gid[:, None] * GROUP + o_t[None, :]  # [R, GROUP] token ids
        m_t = m_r[:, None] & (tid < V)
        x = tl.load(p_row + tid.to(tl.int64) * stride_v, mask=m_t, other=float("-inf")).to(
            tl.float32
        )
        # the next read's group ids, in flight beside this read
        gid_next = tl.load(p_sel + o_r + R, mask=o_r + R < n_sel, other=0, volatile=True)
        # slots group by group (the candidates' order is free): a scan along each group and
        # one over the R group counts, not a scan over the flattened tile
        sel = m_t & (x >= L)
        s32 = sel.to(tl.int32)
        n_row = tl.sum(s32, axis=1)  # [R]
        base = count + tl.cumsum(n_row, 0) - n_row
        slot = base[:, None] + tl.cumsum(s32, 1) - 1
        packed = (_key(x).to(tl.int64) << 32) | (2147483647 - tid.to(tl.int64))
        tl.store(p_cand + slot, packed, mask=sel & (slot < CAP))
        count += tl.sum(n_row, axis=0)
    return count


@triton.jit
def _kept_set(
    p_cand,
    count,
    m,
    T,
    z_all,
    k,
    top_p,
    use_k,
    use_p,
    p_cs,
    p_cm,
    NCH,
    BLOCK_V: tl.constexpr,
    NCH_PAD: tl.constexpr,
    CAP: tl.constexpr,
    SUB: tl.constexpr,
    MASS_TILE: tl.constexpr,
):
    """Kept set of a top-k/top-p row from its ``count`` (<= CAP) candidates (every token above
    a lower bound of the threshold, in any order), sorted in registers by (logit desc, id asc).
    Returns (thr, idcut, Z) and stores the kept mass of each vocabulary block (relative to m)."""
    o_c = tl.arange(0, CAP)
    cand = tl.load(p_cand + o_c, mask=o_c < count, other=-9223372036854775807 - 1, volatile=True)
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
    # per-block kept mass for the walker, from the kept tokens
    o_b = tl.arange(0, NCH_PAD)
    if CAP * NCH_PAD <= MASS_TILE:
        # from the sorted candidates in registers (a [CAP, NCH_PAD] tile of at most MASS_TILE
        # entries): no store and reread through memory
        acc = tl.sum(
            tl.where((id_s // BLOCK_V)[:, None] == o_b[None, :], w_s[:, None], 0.0), axis=0
        )
    else:
        # SUB of them at a time, reread from the sorted slots
        tl.debug_barrier()  # every thread read the unsorted slots before they are overwritten
        tl.store(p_cand + o_c, srt)
        tl.debug_barrier()
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
    return thr, cut, z


@triton.jit
def _truncations(p_topk_param, p_topp, i_b, V, HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr):
    """(top-k on, top-p on) for request ``i_b``: from its values where the launch has the
    tensor, off where it has none."""
    use_k = False
    use_p = False
    if HAS_TOPK:
        k = tl.load(p_topk_param + i_b).to(tl.int32)
        use_k = (k > 0) & (k < V)
    if HAS_TOPP:
        use_p = tl.load(p_topp + i_b).to(tl.float32) < 1.0
    return use_k, use_p


@triton.jit
def _block(p_row, s_lv, v0, v_end, V, BLOCK_V: tl.constexpr):
    """The row's logits ``[v0, v0 + BLOCK_V)`` as loaded (-inf past V, and for a block at or
    past ``v_end``, the split's end: the load ahead of a split's last block reads nothing). The
    block-wide ``v0 < v_end`` is one predicate for every lane, so the load stays vectorised."""
    o_v = v0 + tl.arange(0, BLOCK_V)
    return tl.load(p_row + o_v.to(tl.int64) * s_lv, mask=(o_v < V) & (v0 < v_end),
                   other=float("-inf"))  # fmt: skip


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
    p_wcs,
    p_wcm,
    p_wgm,
    N,
    V,
    CHUNK,
    S: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NCH,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    SAMPLE: tl.constexpr,
    NEED_SE: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    AHEAD: tl.constexpr,
    VEC: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    HAS_TOPP: tl.constexpr,
    TRUNC: tl.constexpr,
):
    """Pass 1 of program ``pid`` = (request, node, split): its split's max, lowest argmax and
    sum of ``exp((x - max) / T)`` (NEED_SE), the top-K (value, id) pairs (K > 0) and, sampling,
    each vocabulary block's mass (relative to the split's running max at that block) and, for
    top-k/top-p rows, the group maxima (the input of ``_lower_bound``). Splits are CHUNK tokens,
    a multiple of BLOCK_V, so blocks and groups never straddle two programs. ``AHEAD`` 2: the
    next block's load is issued before this block is reduced (two blocks in flight a program,
    for launches too small to fill the GPU's memory pipeline); 1: one block at a time. ``VEC``:
    the blocks' alignment told to the compiler (vector loads where the row allows them).
    ``HAS_TOPK`` / ``HAS_TOPP``: the launch has that per-request tensor (else the truncation is
    off for every request); ``TRUNC``: either."""
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
    node = pid // S
    p_cs = p_wcs + node * NCH
    p_cm = p_wcm + node * NCH
    v_start = i_s * CHUNK
    if VEC:
        # CHUNK is a multiple of BLOCK_V but not specialised (one compiled kernel for every
        # split count): said so, every block's first token is known BLOCK_V-aligned, which with
        # the row's 16-byte alignment (V and the strides specialised divisible by 16) lets the
        # logits' loads be 16-byte vectors instead of one 16-bit load per element
        v_start = tl.multiple_of(v_start, BLOCK_V)
    v_end = tl.minimum(v_start + CHUNK, V)
    trunc = False
    if SAMPLE:
        if TRUNC:  # else no request truncates: no group maxima for pass 2
            use_k, use_p = _truncations(p_topk_param, p_topp, i_b, V, HAS_TOPK, HAS_TOPP)
            trunc = active & (T_in > 0) & (use_k | use_p)
    p_gm = p_wgm + node * G_PAD
    m = tl.full([], float("-inf"), tl.float32)
    arg = tl.full([], BIG, tl.int32)
    se = tl.zeros([], dtype=tl.float32)
    o_k = tl.arange(0, K_PAD)
    # top-K (K > 0) as (value, id) keys, ``_pair_key``: ordered by value, then by lower id, and
    # distinct, so one max-reduction finds a block's best element not yet taken and one
    # min-reduction the buffer's worst. Empty slots are (-inf, V + j), padding slots (+inf,
    # V + j): below (above) every real element, never confused with one.
    tk = _pair_key(tl.where(o_k < K, float("-inf"), float("inf")), V + o_k)
    if AHEAD == 2:
        # the first block is loaded before ``active`` is known (every node's row exists): in the
        # small launches that take AHEAD 2 the load then leaves beside num_nodes', not after it
        b_next = _block(p_row, s_lv, v_start, v_end, V, BLOCK_V)
    if active:
        for v0 in range(v_start, v_end, BLOCK_V):
            o_v = v0 + tl.arange(0, BLOCK_V)
            # the split's blocks are whole (CHUNK is a multiple of BLOCK_V) but the last, which
            # V cuts: "< V", V specialised divisible by 16, keeps the load vectorised ("< v_end"
            # would load one 16-bit value per instruction)
            m_v = o_v < V
            if AHEAD == 2:
                b_raw = b_next
                b_next = _block(p_row, s_lv, v0 + BLOCK_V, v_end, V, BLOCK_V)
            else:
                b_raw = tl.load(p_row + o_v.to(tl.int64) * s_lv, mask=m_v, other=float("-inf"))
            # upcast right after the load: bf16 arithmetic is wrong under the interpreter
            b_x = b_raw.to(tl.float32)
            if K > 0:
                b_k = tl.where(m_v, _pair_key(b_x, o_v), KEY_NONE)
                c = tl.max(b_k, axis=0)  # the block's max and its lowest argmax, in one
                b_m = _unkey((c >> 32).to(tl.int32))
                b_a = (2147483647 - (c & 0xFFFFFFFF)).to(tl.int32)
            else:
                b_m = tl.max(b_x, axis=0)
                b_a = arg
                # only a block reaching the running max can hold the lowest argmax (blocks come
                # in token order): the others, most of them, skip a compare, a select and a
                # block-wide min per element
                if b_m >= m:
                    b_a = tl.min(tl.where(m_v & (b_x == b_m), o_v, BIG), axis=0)
            arg = tl.where((b_m > m) | ((b_m == m) & (b_a < arg)), b_a, arg)
            new_m = tl.maximum(m, b_m)
            if NEED_SE:
                scale = tl.where(new_m == float("-inf"), 1.0, tl.exp((m - new_m) / T))
                # tokens past the split loaded as -inf, which _weight maps to 0: no mask here
                b_z = tl.sum(_weight(b_x, new_m, T), axis=0)
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
                # insert the block's better elements, best first, into the unsorted buffer
                # (after the first blocks most blocks insert nothing: the one max above)
                worst = tl.min(tk, axis=0)
                while c > worst:
                    tk = tl.where(tk == worst, c, tk)
                    worst = tl.min(tk, axis=0)
                    c = tl.max(tl.where(b_k < c, b_k, KEY_NONE), axis=0)
    o_w = pid.to(tl.int64)
    tl.store(p_wmax + o_w, m)
    tl.store(p_warg + o_w, arg)
    tl.store(p_wse + o_w, se)
    if K > 0:
        tl.store(p_wtkv + o_w * K_PAD + o_k, _unkey((tk >> 32).to(tl.int32)))
        tl.store(p_wtki + o_w * K_PAD + o_k, (2147483647 - (tk & 0xFFFFFFFF)).to(tl.int32))
