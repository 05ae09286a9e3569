"""Tree build (docs/design.md op 3) and CAST selection (op 5): Triton kernels and their launchers.

``expand`` — one launch per draft layer, one program per (request, frontier row):
  1. stream the row's logits once (``BLOCK_V`` at a time): online max/sum for the softmax and a
     running top-K kept as packed int64 keys ``(order-preserving bits of the logit) << 32 |
     (2^31 - 1 - token)`` — one max-reduction picks the larger logit and, on ties, the lower id.
     A block is merged only when its max beats the current K-th key, so after the first blocks
     the top-K costs nothing beyond the max the softmax needs; no [B, W, V] probability is stored;
  2. write the row's K candidates (path score = parent score x probability);
  3. the last row of a request to finish (an arrival counter) ranks the request's W*K
     candidates and writes the next frontier and the prefix sums of its best scores;
  4. the last request to finish computes the batch-level decision — EAGLE's fixed width, or
     CAST's width (Algorithm 1 with C1 on the device view of the cost table, k capped at the
     most valid next-frontier rows of an active request, at least 1) and depth flag — and trims
     every request's frontier to that width.
  The vocabulary size and the logits' strides are specialised (a model's vocabulary is fixed),
  so that the masked row loads vectorise. Counters are returned to 0 by the program that
  consumed them, so the launch can be replayed
  in a CUDA graph. Every writer releases at GPU scope before a barrier and the arrival atomic;
  readers of other programs' data load with ``.cg`` (L2, not a stale L1).

``emit`` — two launches, one program per request each:
  1. top ``N - 1`` of the step's candidates by packed key (score bits << 32 | (2^31 - 1 - index)),
     a bitonic ``tl.topk``; writes the selection, each selected candidate's node position, and
     the prefix sums CAST's rerank needs;
  2. every program recomputes the batch-level verify count (Algorithm 1 with C3 over the
     [B, N] prefix sums — a few KB, cheaper than a third launch — k capped at 1 + the most
     selected candidates of an active request), then emits its request's tree:
     tokens, parents, depth, ``anc`` (walking candidate parents, at most D steps), links.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from treeops._runtime import refuse_in_capture
from treeops.tree import Tree, anc_words

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# below every key a real logit or score can produce (ordered(-inf) << 32 is about -2^63 + 2^55)
_KEY_MIN = -9223372036854775807 - 1


@triton.jit
def _ordered(x):
    """float32 -> int32 whose signed order is the float order (-0.0 must be normalised first)."""
    xb = x.to(tl.int32, bitcast=True)
    return xb ^ ((xb >> 31) & 0x7FFFFFFF)


@triton.jit
def _unordered(o):
    """Inverse of ``_ordered`` (the map is an involution)."""
    return (o ^ ((o >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _cand_key(s, o, C: tl.constexpr, CPAD: tl.constexpr):
    """Packed rank key of candidates (score, slot): valid (score >= 0) by score bits over
    2^31 - 1 - slot; invalid below every valid key, still distinct; padding (slot >= C) lowest."""
    key = tl.where(
        s >= 0,
        (s.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (0x7FFFFFFF - o).to(tl.int64),
        -9223372036854775807 + CPAD - o.to(tl.int64),
    )
    return tl.where(o < C, key, -9223372036854775807 - 1)


@triton.jit
def _release_then_arrive(P_CTR, LANES: tl.constexpr, FENCE: tl.constexpr):
    """Every thread fences its writes at GPU scope (``LANES`` = threads per program: one fence
    each), the CTA meets, then one acq_rel atomic arrives (CUDA's threadfence-reduction pattern).
    Returns the counter's previous value. The interpreter runs programs one after another and
    has no inline assembly, so it skips the fence."""
    if FENCE:
        tl.inline_asm_elementwise(
            "fence.acq_rel.gpu;\n\tmov.b32 $0, $1;",
            "=r,r",
            [tl.zeros([LANES], dtype=tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    tl.debug_barrier()
    return tl.atomic_add(P_CTR, 1, sem="acq_rel")


@triton.jit
def _stream_row(
    p_row, v_lo, v_hi, V, row_ok, K: tl.constexpr, KP: tl.constexpr, BLOCK_V: tl.constexpr
):
    """Online max/sum and running top-K keys of logits ``[v_lo, v_hi)`` of one row."""
    o_k = tl.arange(0, KP)
    key_min = tl.full([KP], -9223372036854775807 - 1, tl.int64)
    # distinct sentinels so that "the worst slot" is unique; any real key beats them
    b_top = tl.where(o_k < K, key_min + 1 + o_k, 9223372036854775807)
    b_thr = tl.min(b_top)
    m_run = tl.sum(tl.zeros([KP], tl.float32)) - float("inf")  # fp32 scalars (loop-carried)
    s_run = tl.sum(tl.zeros([KP], tl.float32))
    if row_ok:
        # two tiles in flight ahead of the one being reduced (a tile's registers are raw
        # 16-bit values: cheap), so each HBM round trip overlaps two tiles of work. Masks
        # combine "< V" (V is specialised: the loads vectorise) with a uniform chunk bound.
        o_b = tl.arange(0, BLOCK_V)
        b_n1 = tl.load(
            p_row + v_lo + o_b, mask=(v_lo + o_b < V) & (v_lo < v_hi), other=-float("inf")
        )
        b_n2 = tl.load(
            p_row + v_lo + BLOCK_V + o_b,
            mask=(v_lo + BLOCK_V + o_b < V) & (v_lo + BLOCK_V < v_hi),
            other=-float("inf"),
        )
        for v0 in range(v_lo, v_hi, BLOCK_V):
            o_v = v0 + o_b
            m_v = o_v < V
            b_raw = b_n1
            b_n1 = b_n2
            v2 = v0 + 2 * BLOCK_V
            b_n2 = tl.load(p_row + v2 + o_b, mask=(v2 + o_b < V) & (v2 < v_hi), other=-float("inf"))
            b_x = b_raw.to(tl.float32) + 0.0
            b_max = tl.max(b_x)
            m_new = tl.maximum(m_run, b_max)
            m_use = tl.where(m_new == -float("inf"), 0.0, m_new)  # all -inf so far: no NaN
            s_run = s_run * tl.exp(m_run - m_use) + tl.sum(tl.exp(b_x - m_use))
            m_run = m_new
            # a block element with the K-th best value loses the tie (larger id): strict >
            if _ordered(b_max) > (b_thr >> 32).to(tl.int32):
                b_key = (_ordered(b_x).to(tl.int64) << 32) | (0x7FFFFFFF - o_v).to(tl.int64)
                b_key = tl.where(m_v, b_key, -9223372036854775807 - 1)  # [BLOCK_V]
                b_best = tl.max(b_key)
                while b_best > b_thr:  # at most K rounds per block
                    b_top = tl.where(b_top == b_thr, b_best, b_top)
                    b_key = tl.where(b_key == b_best, -9223372036854775807 - 1, b_key)
                    b_thr = tl.min(b_top)
                    b_best = tl.max(b_key)
    return m_run, s_run, b_top


@triton.jit
def _combine_splits(
    PM, PS, PK, o_row, SPLIT: tl.constexpr, SP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr
):
    """Merge the SPLIT partial (max, sum, top-K keys) of one row (written by other programs)."""
    o_s = tl.arange(0, SP)
    o_k = tl.arange(0, KP)
    m_s = o_s < SPLIT
    b_pm = tl.load(PM + o_row * SPLIT + o_s, mask=m_s, other=-float("inf"), cache_modifier=".cg")
    b_ps = tl.load(PS + o_row * SPLIT + o_s, mask=m_s, other=0.0, cache_modifier=".cg")
    m_run = tl.max(b_pm)
    m_use = tl.where(m_run == -float("inf"), 0.0, m_run)
    s_run = tl.sum(tl.where(m_s, b_ps * tl.exp(b_pm - m_use), 0.0))
    b_keys = tl.load(
        PK + (o_row * SPLIT + o_s)[:, None] * KP + o_k[None, :],
        mask=m_s[:, None] & (o_k < K)[None, :],
        other=-9223372036854775807 - 1,
        cache_modifier=".cg",
    )  # [SP, KP]
    b_top = tl.full([KP], 9223372036854775807, tl.int64)
    for j in tl.static_range(K):
        b_best = tl.max(tl.max(b_keys, axis=1), axis=0)
        b_top = tl.where(o_k == j, b_best, b_top)
        b_keys = tl.where(b_keys == b_best, -9223372036854775807 - 1, b_keys)
    return m_run, s_run, b_top


@triton.jit(do_not_specialize=["B", "layer", "C1", "C2", "L", "M"])
def _expand_kernel(
    LOGITS,
    FS,
    FR,
    FT,
    ACT,
    SEQ,
    CT,
    CS,
    CP,
    DEC,
    UH,
    CTR,
    CUM,
    TAB_T,
    TAB_D,
    RCTR,
    PM,
    PS,
    PK,
    B,
    V,
    layer,
    s_lb,
    s_lw,
    C1,
    C2,
    L,
    M,
    W: tl.constexpr,
    K: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,
    NMAX: tl.constexpr,
    CUMW: tl.constexpr,
    KP: tl.constexpr,
    CPAD: tl.constexpr,
    WP: tl.constexpr,
    BP: tl.constexpr,
    DP: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SPLIT: tl.constexpr,
    SP: tl.constexpr,
    CHUNK: tl.constexpr,
    JB: tl.constexpr,
    LANES: tl.constexpr,
    FENCE: tl.constexpr,
    CAST: tl.constexpr,
):
    i_p = tl.program_id(0)
    i_row = i_p // SPLIT
    i_s = i_p % SPLIT
    i_b = i_row // W
    i_r = i_row % W
    i_b64 = i_b.to(tl.int64)

    # ---- 1. one pass over (a chunk of) the row: online softmax + running top-K of packed keys
    b_fs = tl.load(FS + i_b64 * W + i_r)
    b_act = tl.load(ACT + i_b64) != 0
    row_ok = (b_fs >= 0) & b_act
    p_row = LOGITS + i_b64 * s_lb + i_r.to(tl.int64) * s_lw
    v_lo = i_s * CHUNK
    m_run, s_run, b_top = _stream_row(
        p_row, v_lo, tl.minimum(v_lo + CHUNK, V), V, row_ok, K, KP, BLOCK_V
    )
    if SPLIT > 1:
        # the row's last chunk to finish merges the partials and carries on
        o_part = i_row.to(tl.int64) * SPLIT + i_s
        tl.store(PM + o_part, m_run)
        tl.store(PS + o_part, s_run)
        tl.store(PK + o_part * KP + tl.arange(0, KP), b_top)
        if _release_then_arrive(RCTR + i_row, LANES, FENCE) == SPLIT - 1:
            tl.store(RCTR + i_row, 0)
            m_run, s_run, b_top = _combine_splits(PM, PS, PK, i_row.to(tl.int64), SPLIT, SP, K, KP)
            _finish_row(
                FS,
                FR,
                FT,
                ACT,
                SEQ,
                CT,
                CS,
                CP,
                DEC,
                UH,
                CTR,
                CUM,
                TAB_T,
                TAB_D,
                B,
                layer,
                C1,
                C2,
                L,
                M,
                i_b64,
                i_r,
                b_fs,
                row_ok,
                m_run,
                s_run,
                b_top,
                W,
                K,
                D,
                R,
                NMAX,
                CUMW,
                KP,
                CPAD,
                WP,
                BP,
                DP,
                JB,
                LANES,
                FENCE,
                CAST,
            )
    else:
        _finish_row(
            FS,
            FR,
            FT,
            ACT,
            SEQ,
            CT,
            CS,
            CP,
            DEC,
            UH,
            CTR,
            CUM,
            TAB_T,
            TAB_D,
            B,
            layer,
            C1,
            C2,
            L,
            M,
            i_b64,
            i_r,
            b_fs,
            row_ok,
            m_run,
            s_run,
            b_top,
            W,
            K,
            D,
            R,
            NMAX,
            CUMW,
            KP,
            CPAD,
            WP,
            BP,
            DP,
            JB,
            LANES,
            FENCE,
            CAST,
        )


@triton.jit
def _finish_row(
    FS,
    FR,
    FT,
    ACT,
    SEQ,
    CT,
    CS,
    CP,
    DEC,
    UH,
    CTR,
    CUM,
    TAB_T,
    TAB_D,
    B,
    layer,
    C1,
    C2,
    L,
    M,
    i_b64,
    i_r,
    b_fs,
    row_ok,
    m_run,
    s_run,
    b_top,
    W: tl.constexpr,
    K: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,
    NMAX: tl.constexpr,
    CUMW: tl.constexpr,
    KP: tl.constexpr,
    CPAD: tl.constexpr,
    WP: tl.constexpr,
    BP: tl.constexpr,
    DP: tl.constexpr,
    JB: tl.constexpr,
    LANES: tl.constexpr,
    FENCE: tl.constexpr,
    CAST: tl.constexpr,
):
    C: tl.constexpr = W * K
    o_k = tl.arange(0, KP)
    key_min = tl.full([KP], -9223372036854775807 - 1, tl.int64)

    # ---- 2. the row's candidates in rank order (logit desc, id asc)
    b_kv = tl.where(o_k < K, b_top, key_min)
    b_rank = tl.sum((b_kv[None, :] > b_kv[:, None]).to(tl.int32), axis=1)  # [KP], keys distinct
    b_tok = (0x7FFFFFFF - (b_kv & 0xFFFFFFFF)).to(tl.int64)
    b_logit = _unordered((b_kv >> 32).to(tl.int32))
    m_fin = tl.where(m_run == -float("inf"), 0.0, m_run)
    b_p = tl.exp(b_logit - m_fin) / s_run
    b_score = b_fs * b_p
    b_par = tl.load(FR + i_b64 * W + i_r)
    o_slot = i_b64 * (D * C) + layer * C + i_r * K
    m_k = o_k < K
    o_dst = o_slot + tl.where(row_ok, b_rank, o_k)
    tl.store(CS + o_dst, tl.where(row_ok, b_score, -1.0), mask=m_k)
    tl.store(CT + o_dst, tl.where(row_ok, b_tok, 0), mask=m_k)
    tl.store(CP + o_dst, tl.where(row_ok, tl.zeros([KP], tl.int32) + b_par, -1), mask=m_k)

    # ---- 3. last row of the request: rank its W*K candidates, write the next frontier
    if _release_then_arrive(CTR + i_b64, LANES, FENCE) == W - 1:
        tl.store(CTR + i_b64, 0)
        o_c = tl.arange(0, CPAD)
        m_c = o_c < C
        p_cs = CS + i_b64 * (D * C) + layer * C
        b_s = tl.load(p_cs + o_c, mask=m_c, other=-1.0, cache_modifier=".cg")
        ok_c = b_s >= 0
        c_key = _cand_key(b_s, o_c, C, CPAD)
        # rank (how many outrank each) and the score sum of those at or above it, against
        # chunks of JB candidates: a [CPAD, CPAD] compare at once would set the register
        # budget of the whole kernel (and so its occupancy)
        c_rank = tl.zeros([CPAD], tl.int32)
        c_cum = tl.where(ok_c, b_s, 0.0)
        for j0 in tl.static_range(0, CPAD, JB):
            o_j = j0 + tl.arange(0, JB)
            s_j = tl.load(p_cs + o_j, mask=o_j < C, other=-1.0, cache_modifier=".cg")
            gt = _cand_key(s_j, o_j, C, CPAD)[None, :] > c_key[:, None]  # [CPAD, JB]
            c_rank += tl.sum(gt.to(tl.int32), axis=1)
            c_cum += tl.sum(tl.where(gt, tl.maximum(s_j, 0.0)[None, :], 0.0), axis=1)
        sel = m_c & (c_rank < W)
        c_tok = tl.load(
            CT + i_b64 * (D * C) + layer * C + o_c, mask=sel & ok_c, other=0, cache_modifier=".cg"
        )
        o_f = i_b64 * W + c_rank
        tl.store(FS + o_f, tl.where(ok_c, b_s, -1.0), mask=sel)
        tl.store(FR + o_f, tl.where(ok_c, layer * C + o_c, -1), mask=sel)
        tl.store(FT + o_f, tl.where(ok_c, c_tok, 0), mask=sel)
        tl.store(CUM + i_b64 * CUMW + c_rank, c_cum, mask=sel)

        # ---- 4. last request: the batch-level decision
        if _release_then_arrive(CTR + B, LANES, FENCE) == B - 1:
            tl.store(CTR + B, 0)
            o_w = tl.arange(0, WP)
            m_w = o_w < W
            if CAST:
                o_b = tl.arange(0, BP)
                m_b = o_b < B
                b_a = tl.load(ACT + o_b, mask=m_b, other=0) != 0
                b_seq = tl.load(SEQ + o_b, mask=m_b & b_a, other=0)
                o_d = tl.arange(0, DP)
                b_wid = tl.load(DEC + o_d, mask=o_d < layer, other=0)
                ctx = tl.maximum(tl.max(b_seq) + tl.sum(b_wid).to(tl.int64), 0)  # bucket >= 0
                bucket = tl.minimum(ctx // L, M - 1)
                b_cum = tl.load(
                    CUM + o_b[:, None] * CUMW + o_w[None, :],
                    mask=(m_b & b_a)[:, None] & m_w[None, :],
                    other=0.0,
                    cache_modifier=".cg",
                )  # [BP, WP]
                # Algorithm 1 on the sums U_k with threshold C1 * n_act: the batch mean's
                # maximisers without its rounding (U / 3 breaks dyadic ties; the reference agrees)
                n_act = tl.maximum(tl.sum(b_a.to(tl.int32)), 1).to(tl.float32)
                b_U = tl.sum(b_cum, axis=0)  # [WP]
                t1 = tl.load(TAB_T + bucket * NMAX)
                b_c = tl.load(TAB_D + bucket * NMAX + o_w, mask=m_w, other=0.0) / t1
                # k capped at the most valid next-frontier rows of an active request (written
                # above by each request's last program, before its arrival): past it U is flat,
                # and on a plateau of costs the largest k would name rows no request has
                b_fv = tl.load(
                    FS + o_b.to(tl.int64)[:, None] * W + o_w[None, :],
                    mask=(m_b & b_a)[:, None] & m_w[None, :],
                    other=-1.0,
                    cache_modifier=".cg",
                )  # [BP, WP]
                cap = tl.maximum(tl.max(tl.sum((b_fv >= 0).to(tl.int32), axis=1)), 1)
                b_obj = tl.where(m_w & (o_w < cap), b_U - (C1 * n_act) * b_c, -float("inf"))
                n = tl.max(tl.where(b_obj == tl.max(b_obj), o_w + 1, 0))
                u_n = tl.sum(tl.where(o_w + 1 == n, b_U, 0.0)) / n_act
                c_n = tl.sum(tl.where(o_w + 1 == n, b_c, 0.0))
                tl.store(UH + layer, u_n)
                # FIFO [1, phi_0, .., phi_{i-1}], phi_j = u_{j+1} / u_j; its last R entries
                u_j = tl.where(o_d == layer, u_n, tl.load(UH + o_d, mask=o_d < layer, other=0.0))
                u_jm1 = tl.load(UH + o_d - 1, mask=(o_d >= 1) & (o_d <= layer), other=0.0)
                phi = tl.where(u_jm1 > 0, u_j / tl.where(u_jm1 > 0, u_jm1, 1.0), 0.0)
                e = tl.where(o_d == 0, 1.0, phi)
                in_fifo = (o_d <= layer) & (o_d >= layer + 1 - R)
                alpha = tl.sum(tl.where(in_fifo, e, 0.0)) / tl.minimum(layer + 1, R).to(tl.float32)
                flag = (alpha * u_n / c_n >= C2) & (layer + 1 < D)
                # trim every request's frontier to the batch width
                o_b64 = o_b.to(tl.int64)
                cut = m_b[:, None] & m_w[None, :] & (o_w[None, :] >= n)
                o_fw = o_b64[:, None] * W + o_w[None, :]
                tl.store(FS + o_fw, tl.full([BP, WP], -1.0, tl.float32), mask=cut)
                tl.store(FR + o_fw, tl.full([BP, WP], -1, tl.int32), mask=cut)
                tl.store(FT + o_fw, tl.zeros([BP, WP], tl.int64), mask=cut)
            else:
                n = W
                flag = layer + 1 < D
            tl.store(DEC + layer, n)
            tl.store(DEC + D + layer, flag.to(tl.int32))


@triton.jit(do_not_specialize=["n_layers"])
def _select_kernel(
    CS,
    SEL,
    POS,
    CUM,
    n_layers,
    D: tl.constexpr,
    C: tl.constexpr,
    N: tl.constexpr,
    CUMW: tl.constexpr,
    TP: tl.constexpr,
    NP: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    o_t = tl.arange(0, TP)
    m_t = o_t < n_layers * C
    b_s = tl.load(CS + i_b * (D * C) + o_t, mask=m_t, other=-1.0)
    ok = b_s >= 0
    b_key = tl.where(
        ok,
        (b_s.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (0x7FFFFFFF - o_t).to(tl.int64),
        -9223372036854775807 - 1,
    )
    b_top = tl.topk(b_key, NP)  # [NP] descending: score desc, candidate index asc
    o_j = tl.arange(0, NP)
    ok_j = (b_top >= 0) & (o_j < N - 1)
    c_idx = (0x7FFFFFFF - (b_top & 0xFFFFFFFF)).to(tl.int32)
    c_s = tl.where(ok_j, _unordered((b_top >> 32).to(tl.int32)), 0.0)
    tl.store(SEL + i_b * N + o_j, tl.where(ok_j, c_idx, -1), mask=o_j < N - 1)
    tl.store(POS + i_b * (D * C) + c_idx, o_j + 1, mask=ok_j)
    # utilities of the rerank: 1 (root) + the j best scores, at column j
    tl.store(CUM + i_b * CUMW + o_j + 1, 1.0 + tl.cumsum(c_s, axis=0), mask=o_j + 1 < N)
    tl.store(CUM + i_b * CUMW, 1.0)


@triton.jit(do_not_specialize=["B", "n_layers", "C3", "L", "M"])
def _emit_kernel(
    CT,
    CS,
    CP,
    SEL,
    POS,
    CUM,
    ACT,
    SEQ,
    ROOT,
    DEC,
    TAB_T,
    TOK,
    PAR,
    NUM,
    DEP,
    ANC,
    FC,
    NS,
    SC,
    B,
    n_layers,
    C3,
    L,
    M,
    D: tl.constexpr,
    C: tl.constexpr,
    N: tl.constexpr,
    AW: tl.constexpr,
    CUMW: tl.constexpr,
    NMAX: tl.constexpr,
    NP: tl.constexpr,
    BP: tl.constexpr,
    LOG_D: tl.constexpr,
    DOT_T: tl.constexpr,
    CAST: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    o_n = tl.arange(0, NP)
    m_n = o_n < N
    if CAST:
        o_b = tl.arange(0, BP)
        m_b = o_b < B
        b_a = tl.load(ACT + o_b, mask=m_b, other=0) != 0
        ctx = tl.maximum(tl.max(tl.load(SEQ + o_b, mask=m_b & b_a, other=0)), 0)  # bucket >= 0
        bucket = tl.minimum(ctx // L, M - 1)
        b_cum = tl.load(
            CUM + o_b[:, None] * CUMW + o_n[None, :],
            mask=(m_b & b_a)[:, None] & m_n[None, :],
            other=0.0,
        )  # [BP, NP]
        n_act = tl.maximum(tl.sum(b_a.to(tl.int32)), 1).to(tl.float32)
        b_U = tl.sum(b_cum, axis=0)  # Algorithm 1 on the sums, threshold C3 * n_act
        t1 = tl.load(TAB_T + bucket * NMAX)
        b_c = tl.load(TAB_T + bucket * NMAX + o_n, mask=m_n, other=0.0) / t1
        # k capped at 1 + the most selected candidates of an active request (SEL, written by
        # the select launch): the count never exceeds max_b num_nodes[b]
        b_sa = tl.load(
            SEL + o_b.to(tl.int64)[:, None] * N + o_n[None, :],
            mask=(m_b & b_a)[:, None] & (o_n < N - 1)[None, :],
            other=-1,
        )  # [BP, NP]
        cap = 1 + tl.max(tl.sum((b_sa >= 0).to(tl.int32), axis=1))
        b_obj = tl.where(m_n & (o_n < cap), b_U - (C3 * n_act) * b_c, -float("inf"))
        n = tl.max(tl.where(b_obj == tl.max(b_obj), o_n + 1, 0))
    else:
        n = N
    if i_b == 0:
        tl.store(DEC + 2 * D, n)

    act = tl.load(ACT + i_b) != 0
    b_sel = tl.load(SEL + i_b * N + o_n - 1, mask=(o_n >= 1) & m_n, other=-1)  # node j <- sel[j-1]
    have = tl.sum(((b_sel >= 0) & (o_n >= 1) & m_n).to(tl.int32))
    m = tl.where(act, tl.minimum(n, 1 + have), 0)
    live = o_n < m
    cand = live & (o_n >= 1)
    base = i_b * (D * C)
    b_tok = tl.load(CT + base + b_sel, mask=cand, other=0)
    b_tok = tl.where(live & (o_n == 0), tl.load(ROOT + i_b), b_tok)
    b_sc = tl.load(CS + base + b_sel, mask=cand, other=0.0)
    b_sc = tl.where(live & (o_n == 0), 1.0, b_sc)
    b_pc = tl.load(CP + base + b_sel, mask=cand, other=-1)
    b_par = tl.where(b_pc >= 0, tl.load(POS + base + b_pc, mask=cand & (b_pc >= 0), other=0), 0)
    b_par = tl.where(cand, b_par, -1)  # [NP]

    # ancestor-or-self matrix by repeated squaring of (I + parent), 2^LOG_D >= D covers every
    # path; 0/1 values are exact in fp16 and counts in the fp32 accumulator
    o_c = tl.arange(0, NP)
    b_am = ((o_n[:, None] == o_c[None, :]) | (b_par[:, None] == o_c[None, :])) & live[:, None]
    b_af = b_am.to(DOT_T)  # [NP, NP]
    for _ in tl.static_range(LOG_D):
        b_af = tl.where(tl.dot(b_af, b_af) > 0, 1.0, 0.0).to(DOT_T)
    b_ai = (b_af > 0).to(tl.int32)
    b_dep = tl.where(live, tl.sum(b_ai, axis=1) - 1, 0)
    b_bits = tl.where(b_ai != 0, (1 << (o_c % 32))[None, :], 0)  # distinct bits: sum == or
    b_anc = tl.sum(tl.reshape(b_bits, [NP, NP // 32, 32]), axis=2)  # [NP, NP // 32]
    o_w = tl.arange(0, NP // 32)

    # links: first child = smallest child index; next sibling = next larger index, same parent
    big = NP + 1
    kid = (b_par[None, :] == o_n[:, None]) & live[:, None]  # [NP(parent i), NP(child j)]
    b_fc = tl.min(tl.where(kid, o_n[None, :], big), axis=1)
    sib = (
        (b_par[None, :] == b_par[:, None]) & (b_par[:, None] >= 0) & (o_n[None, :] > o_n[:, None])
    )  # [NP(i), NP(j)]: j a later sibling of i
    b_ns = tl.min(tl.where(sib, o_n[None, :], big), axis=1)

    o_out = i_b * N + o_n
    tl.store(TOK + o_out, b_tok, mask=m_n)
    tl.store(PAR + o_out, b_par, mask=m_n)
    tl.store(DEP + o_out, b_dep, mask=m_n)
    tl.store(SC + o_out, tl.where(live, b_sc, 0.0), mask=m_n)
    tl.store(FC + o_out, tl.where(b_fc < big, b_fc, -1), mask=m_n)
    tl.store(NS + o_out, tl.where(b_ns < big, b_ns, -1), mask=m_n)
    tl.store(
        ANC + o_out[:, None] * AW + o_w[None, :],
        b_anc.to(tl.int32),
        mask=m_n[:, None] & (o_w[None, :] < AW),
    )
    tl.store(NUM + i_b, m)


# --------------------------------------------------------------------------------- launchers
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _tables(state, policy):
    if policy.is_cast:
        t, d = policy.cost_table.device_tables(state.active.shape[0], state.cand_scores.device)
        return t, d, policy.cost_table.L, policy.cost_table.M, policy.cost_table.n_max
    dummy = state.u_hist  # never read (CAST=False)
    return dummy, dummy, 1, 1, 1


_SM_COUNT: dict[int, int] = {}


def _sm_count(dev: torch.device) -> int:
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    if i not in _SM_COUNT:
        _SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SM_COUNT[i]


_RETIRED: list[torch.Tensor] = []  # split workspaces replaced by larger ones (see expand)


def _default_split(rows: int, V: int, block_v: int, device: torch.device) -> int:
    """Programs per frontier row: enough rows x chunks for two programs per SM, at most 32, from
    the SM count and V only (fixed for a CUDA graph); 1 off the GPU."""
    if device.type != "cuda":
        return 1
    return max(1, min(_cdiv(2 * _sm_count(device), rows), _cdiv(V, block_v), 32))


def expand(
    logits: torch.Tensor,
    state,
    policy,
    *,
    block_v: int | None = None,
    num_warps: int | None = None,
    split: int | None = None,
) -> None:
    """Expand draft layer ``state.layer`` (does not advance it; the public op does).

    ``block_v`` (vocabulary tile, a power of two), ``num_warps`` and ``split`` (programs per row,
    each streaming one chunk of V; default: enough rows x chunks for two programs per SM, from
    the SM count and V only) override the defaults. A split > 1 allocates its small workspace on
    the first call (do that call before capturing a CUDA graph)."""
    B, W, V = logits.shape
    K, D = policy.topk, policy.max_depth
    C = W * K
    if block_v is None:
        # small CTAs, many per SM: a row's top-K merges are chains of block reductions (latency),
        # which other resident rows' streaming hides; few rows get wider tiles
        block_v = min(_pow2(V), 256 if _INTERPRET else (2048 if B * W >= 256 else 4096))
    if split is None:
        split = _default_split(B * W, V, block_v, logits.device)
    chunk = _cdiv(_cdiv(V, split), block_v) * block_v  # ceil(V / split) in whole tiles
    split = _cdiv(V, chunk)
    ws = state.workspace
    KP = _pow2(K)
    if split > 1:
        need = B * W * split
        if (
            "part_m" not in ws
            or ws["part_m"].numel() < need
            or ws["part_k"].shape[1] != KP
            or ws["row_counters"].numel() < B * W
        ):
            refuse_in_capture("build_tree_expand's split workspace (per draft state and V)")
            # replaced buffers stay alive: a graph captured with them keeps replaying into them
            _RETIRED.extend(
                ws[k] for k in ("row_counters", "part_m", "part_s", "part_k") if k in ws
            )
            dev = logits.device
            ws["row_counters"] = torch.zeros(B * W, dtype=torch.int32, device=dev)
            ws["part_m"] = torch.zeros(need, dtype=torch.float32, device=dev)
            ws["part_s"] = torch.zeros(need, dtype=torch.float32, device=dev)
            ws["part_k"] = torch.zeros(need, KP, dtype=torch.int64, device=dev)
        rctr, pm, ps, pk = ws["row_counters"], ws["part_m"], ws["part_s"], ws["part_k"]
    else:
        rctr = pm = ps = pk = ws["counters"]  # never read (SPLIT = 1)
    tab_t, tab_d, L, M, nmax = _tables(state, policy)
    cast = policy.is_cast
    warps = num_warps or (1 if _INTERPRET else (8 if block_v >= 4096 else 4))
    _expand_kernel[(B * W * split,)](
        logits,
        state.frontier_scores,
        state.frontier,
        state.frontier_tokens,
        state.active.view(torch.uint8),
        state.seq_lens,
        state.cand_tokens,
        state.cand_scores,
        state.cand_parents,
        state.decisions,
        state.u_hist,
        ws["counters"],
        ws["cum"],
        tab_t,
        tab_d,
        rctr,
        pm,
        ps,
        pk,
        B,
        V,
        state.layer,
        logits.stride(0),
        logits.stride(1),
        float(policy.C1) if cast else 0.0,
        float(policy.C2) if cast else 0.0,
        L,
        M,
        W=W,
        K=K,
        D=D,
        R=policy.R if cast else 1,
        NMAX=nmax,
        CUMW=ws["cum"].shape[1],
        KP=KP,
        CPAD=_pow2(C),
        WP=_pow2(W),
        BP=_pow2(B),
        DP=_pow2(D),
        BLOCK_V=block_v,
        SPLIT=split,
        SP=_pow2(split),
        CHUNK=chunk,
        JB=min(16, _pow2(C)),
        LANES=32 * warps,
        FENCE=not _INTERPRET,
        CAST=cast,
        num_warps=warps,
    )


def emit(state, policy, *, out: Tree | None = None) -> Tree:
    """Rerank and emit the tree (two launches); writes ``state.verify``."""
    B = state.active.shape[0]
    D, W, K, N = policy.max_depth, policy.max_width, policy.topk, policy.capacity
    C = W * K
    dev = state.cand_scores.device
    if out is None:
        out = Tree(
            tokens=torch.empty(B, N, dtype=torch.int64, device=dev),
            parents=torch.empty(B, N, dtype=torch.int32, device=dev),
            num_nodes=torch.empty(B, dtype=torch.int32, device=dev),
            depth=torch.empty(B, N, dtype=torch.int32, device=dev),
            anc=torch.empty(B, N, anc_words(N), dtype=torch.int32, device=dev),
            first_child=torch.empty(B, N, dtype=torch.int32, device=dev),
            next_sibling=torch.empty(B, N, dtype=torch.int32, device=dev),
            scores=torch.empty(B, N, dtype=torch.float32, device=dev),
        )
    for f in (
        "tokens",
        "parents",
        "num_nodes",
        "depth",
        "anc",
        "first_child",
        "next_sibling",
        "scores",
    ):
        if not getattr(out, f).is_contiguous():
            raise ValueError(f"Invalid layout of out.{f}: expected a contiguous tensor")
    ws = state.workspace
    tab_t, _, L, M, nmax = _tables(state, policy)
    NP = max(_pow2(N), 32)  # >= 32: whole anc words, and tl.dot's minimum
    TP = max(_pow2(D * C), NP)
    # [NP, NP] tiles, on sm_90 (bench/compile_check.py): 198-216 registers at NP = 64 with 4 warps;
    # at NP = 128 with 8 warps 255 registers and 208-468 B of spills per thread (not yet timed)
    warps = 1 if _INTERPRET else (4 if NP <= 64 else 8)
    _select_kernel[(B,)](
        state.cand_scores,
        ws["sel"],
        ws["pos"],
        ws["cum"],
        state.layer,
        D=D,
        C=C,
        N=N,
        CUMW=ws["cum"].shape[1],
        TP=TP,
        NP=NP,
        num_warps=warps,
    )
    _emit_kernel[(B,)](
        state.cand_tokens,
        state.cand_scores,
        state.cand_parents,
        ws["sel"],
        ws["pos"],
        ws["cum"],
        state.active.view(torch.uint8),
        state.seq_lens,
        state.root_tokens,
        state.decisions,
        tab_t,
        out.tokens,
        out.parents,
        out.num_nodes,
        out.depth,
        out.anc,
        out.first_child,
        out.next_sibling,
        out.scores,
        B,
        state.layer,
        float(policy.C3) if policy.is_cast else 0.0,
        L,
        M,
        D=D,
        C=C,
        N=N,
        AW=anc_words(N),
        CUMW=ws["cum"].shape[1],
        NMAX=nmax,
        NP=NP,
        BP=_pow2(B),
        LOG_D=max(0, (D - 1).bit_length()),
        DOT_T=tl.float32 if _INTERPRET else tl.float16,
        CAST=policy.is_cast,
        num_warps=warps,
    )
    return out
