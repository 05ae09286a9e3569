"""Tree build (docs/design.md op 3) and CAST selection (op 5): Triton kernels and their launchers.

``expand`` — per draft layer, on the GPU two launches: ``_stream_kernel`` streams the logits over
(row, chunk of V) one-warp programs, about 32 per SM, writing each chunk's partial max and sum and
each tile's max; ``_expand_kernel``, one program per (request, frontier row), merges its row's
partials and runs steps 1b-4. With one chunk per row (the interpreter's default) ``_expand_kernel``
streams the row itself:
  1. stream the row's logits once (``BLOCK_V`` at a time): online max/sum for the softmax. The
     row's top-K is kept as packed int64 keys ``(order-preserving bits of the logit) << 32 |
     (2^31 - 1 - token)``: one max-reduction picks the larger logit and, on ties, the lower id.
     Unsplit, a running top-K merges a block only when its max beats the current K-th key.
     Split, the streaming programs do no top-K work at all: (1b) the K tiles with the largest
     maxima hold every top-K element (a tile holding one has its max at or above the K-th key,
     and at most K tiles do), so only those are read again, best first, each skipped once its
     max cannot beat the K-th key found: about K tiles of reads instead of rounds over every
     tile. No [B, W, V] probability is stored;
  2. write the row's K candidates (path score = parent score x probability);
  3. the last row of a request to finish (an arrival counter) ranks the request's W*K
     candidates and writes the next frontier and the prefix sums of its best scores;
  4. the batch-level decision: EAGLE's fixed width and flag (request 0 writes them), or, by the
     last request to finish, CAST's width (Algorithm 1 with C1 on the device view of the cost
     table, k capped at the most valid next-frontier rows of an active request, at least 1) and
     depth flag, every request's frontier trimmed to that width.
  The vocabulary size and the logits' strides are specialised (a model's vocabulary is fixed),
  so that the masked row loads vectorise. Counters are returned to 0 by the program that
  consumed them, so the launch can be replayed
  in a CUDA graph. Every writer releases at GPU scope before a barrier and the arrival atomic;
  readers of other programs' data load with ``.cg`` (L2, not a stale L1).

``emit`` — one program per request; under CAST two launches:
  1. top ``N - 1`` of the step's candidates by packed key (score bits << 32 | (2^31 - 1 - index)),
     a bitonic ``tl.topk``; writes the selection, each selected candidate's node position, and
     the prefix sums CAST's rerank needs;
  2. every program recomputes the batch-level verify count (Algorithm 1 with C3 over the
     [B, N] prefix sums — a few KB, cheaper than a third launch — k capped at 1 + the most
     selected candidates of an active request), then emits its request's tree:
     tokens, parents, depth, ``anc`` (walking candidate parents, at most D steps), links.
  EAGLE's count is N, which no request's selection changes, so its emit is launch 2 alone, each
  program ranking its own request's candidates first (``SELECT``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from treeops import _runtime
from treeops._runtime import cdiv, interpreted, pow2
from treeops.tree import Tree, anc_words

from ._launch import direct
from ._pdl import PDL_LATE, pdl_enter, pdl_release, use_pdl
from .build_tree_tiling import (
    BLOCKS_TOPK_MAX,
    STREAM_LANES_MIN_BLOCK,
    early_tile_loads,
    expand_max_block,
    expand_tiling,
    split_workspace,
    stream_warps,
)
from .build_tree_vocab import (
    _combine_softmax,
    _stream_kernel,
    _stream_row,
    _top_of_tiles,
    _unordered,
)


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
def _release_then_arrive(p_ctr, LANES: tl.constexpr, FENCE: tl.constexpr):
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
    return tl.atomic_add(p_ctr, 1, sem="acq_rel")


@triton.jit(do_not_specialize=["B", "layer", "C1", "C2", "L", "M", "D"])
def _expand_kernel(
    p_logits,  # [B, RW, V] draft logits (strides s_lb, s_lw; the vocabulary contiguous)
    p_fscore,  # [B, W] f32 frontier: path score (-1 = unused row); rewritten as the next frontier
    p_fcand,  # [B, W] i32 frontier: candidate index (layer * C + slot), -1 = root or unused
    p_ftok,  # [B, W] i64 frontier: token
    p_active,  # [B] u8 active requests
    p_seq,  # [B] i64 tokens in the cache (CAST prices the context)
    p_ctok,  # [B, D, C] i64 candidates: token
    p_cscore,  # [B, D, C] f32 candidates: path score, -1 = none
    p_cpar,  # [B, D, C] i32 candidates: parent's candidate index, -1 = the root
    p_dec,  # [2D + 1] i32 decisions: widths [D], depth flags [D], verify count
    p_uhist,  # [D] f32 CAST: utility of the width chosen at each layer
    p_ctr,  # [B + 1] i32 arrival counters: per request, then the batch (0 between launches)
    p_cum,  # [B, CUMW] f32 per request: score sum of the candidates ranked at or above each
    p_tab_t,  # [M, NMAX] f32 CAST: target times per context bucket and node count
    p_tab_d,  # [M, NMAX] f32 CAST: draft times per context bucket and width
    p_part_m,  # [B * RW * SPLIT] f32 split > 1: each chunk's running max
    p_part_s,  # [B * RW * SPLIT] f32 split > 1: each chunk's sum of exp(x - max)
    p_part_t,  # [>= B * RW * NT] i32 split > 1: each block's max (``_ordered``), then scratch
    B,  # requests
    V,  # vocabulary
    layer,  # the draft layer being expanded
    s_lb,
    s_lw,
    C1,  # CAST width threshold
    C2,  # CAST depth threshold
    L,  # CAST: context tokens per cost-table bucket
    M,  # CAST: cost-table buckets
    W: tl.constexpr,  # frontier rows per request (the policy's max width)
    RW: tl.constexpr,  # logits rows per request: W, or 1 at layer 0 (the root's row alone)
    K: tl.constexpr,  # children kept per row (top-K)
    D,  # draft layers (max depth): a runtime int, not a variant per depth
    R: tl.constexpr,  # CAST: length of the FIFO of utility ratios
    NMAX: tl.constexpr,  # cost-table columns
    CUMW: tl.constexpr,  # columns of p_cum
    KP: tl.constexpr,  # K, CPAD = W * K, WP = W, BP = B, DP = D: padded to powers of two
    CPAD: tl.constexpr,
    WP: tl.constexpr,
    BP: tl.constexpr,
    DP: tl.constexpr,
    BLOCK_V: tl.constexpr,  # vocabulary tile
    SPLIT: tl.constexpr,  # split > 1: chunks per row streamed by _stream_kernel (SP: padded)
    SP: tl.constexpr,
    MB: tl.constexpr,  # split > 1: tokens per recorded maximum (a block; divides BLOCK_V)
    NT: tl.constexpr,  # split > 1: such blocks per row (NTP: padded)
    NTP: tl.constexpr,
    GT: tl.constexpr,  # split > 1: tiles read at once for the top-K's candidates
    CAP: tl.constexpr,  # split > 1: most candidates ranked at once (else the tile-by-tile merge)
    BLOCKS_TOPK: tl.constexpr,  # split > 1: the K best blocks by one tl.topk (else K reductions)
    RANK_TOPK: tl.constexpr,  # split > 1: the ranked candidates by one tl.topk (else compares)
    CAND_AHEAD: tl.constexpr,  # split > 1: each read of the candidates' tiles issued one ahead
    LANES: tl.constexpr,  # threads per program (one fence each)
    FENCE: tl.constexpr,  # GPU-scope fences before arrivals (off in the interpreter)
    CAST: tl.constexpr,  # CAST's width/depth decision; else EAGLE's fixed width
    PDL: tl.constexpr,  # launched with programmatic dependent launch (``_pdl``)
):
    pdl_enter(PDL)
    C: tl.constexpr = W * K
    i_row = tl.program_id(0)  # a logits row: (request, frontier row < RW)
    i_b = i_row // RW
    i_r = i_row % RW
    i_b64 = i_b.to(tl.int64)

    # ---- 1. the row's softmax and top-K: streamed here, or merged from _stream_kernel's parts
    b_fs = tl.load(p_fscore + i_b64 * W + i_r)
    b_act = tl.load(p_active + i_b64) != 0
    row_ok = (b_fs >= 0) & b_act
    p_row = p_logits + i_b64 * s_lb + i_r.to(tl.int64) * s_lw
    if SPLIT > 1:
        m_run, s_run = _combine_softmax(p_part_m, p_part_s, i_row.to(tl.int64), SPLIT, SP)
        p_part = p_part_t + i_row.to(tl.int64) * NT
        b_top = _top_of_tiles(
            p_row, p_part, V, row_ok, K, KP, MB, NT, NTP, GT, CAP, BLOCKS_TOPK, RANK_TOPK,
            CAND_AHEAD
        )  # fmt: skip
    else:
        m_run, s_run, b_top = _stream_row(p_row, 0, V, V, row_ok, K, KP, BLOCK_V)
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
    b_par = tl.load(p_fcand + i_b64 * W + i_r)
    o_slot = i_b64 * (D * C) + layer * C + i_r * K
    m_k = o_k < K
    o_dst = o_slot + tl.where(row_ok, b_rank, o_k)
    tl.store(p_cscore + o_dst, tl.where(row_ok, b_score, -1.0), mask=m_k)
    tl.store(p_ctok + o_dst, tl.where(row_ok, b_tok, 0), mask=m_k)
    tl.store(p_cpar + o_dst, tl.where(row_ok, tl.zeros([KP], tl.int32) + b_par, -1), mask=m_k)
    if RW < W:
        # the root's row alone (layer 0): the request's other rows have no logits and no
        # candidates
        o_e = tl.arange(0, CPAD)
        m_e = (o_e >= RW * K) & (o_e < C)
        o_ed = i_b64 * (D * C) + layer * C + o_e
        tl.store(p_cscore + o_ed, tl.full([CPAD], -1.0, tl.float32), mask=m_e)
        tl.store(p_ctok + o_ed, tl.zeros([CPAD], tl.int64), mask=m_e)
        tl.store(p_cpar + o_ed, tl.full([CPAD], -1, tl.int32), mask=m_e)

    pdl_release(PDL)  # what is left is the request's last row: the next launch may be placed
    # ---- 3. last row of the request: rank its W*K candidates, write the next frontier
    if _release_then_arrive(p_ctr + i_b64, LANES, FENCE) == RW - 1:
        tl.store(p_ctr + i_b64, 0)
        o_c = tl.arange(0, CPAD)
        m_c = o_c < C
        p_cs = p_cscore + i_b64 * (D * C) + layer * C
        b_s = tl.load(p_cs + o_c, mask=m_c, other=-1.0, cache_modifier=".cg")
        # the candidates in rank order: their keys sorted in registers (distinct, the valid ones
        # >= 0 and carrying score bits and slot). Ranking by pairwise compares instead took
        # chunks of the scores re-read from L2, one round trip after another: 3 (B 1) to 7 (B 64)
        # us more per layer on the H200. Position r < W is the next frontier's row r; its
        # ``cum`` the score sum of the candidates at or above it. The tokens are loaded with
        # the scores and the frontier's picked from registers after the sort: a load after it
        # is one L2 round trip more (0.1-0.3 us a layer on the H200)
        b_ct = tl.load(
            p_ctok + i_b64 * (D * C) + layer * C + o_c, mask=m_c, other=0, cache_modifier=".cg"
        )
        s_key = tl.sort(_cand_key(b_s, o_c, C, CPAD), descending=True)
        ok_r = s_key >= 0
        r_slot = tl.where(ok_r, 0x7FFFFFFF - (s_key & 0xFFFFFFFF), 0).to(tl.int32)
        r_score = tl.where(ok_r, (s_key >> 32).to(tl.int32).to(tl.float32, bitcast=True), -1.0)
        r_cum = tl.cumsum(tl.maximum(r_score, 0.0), 0)
        sel = o_c < W
        r_tok = tl.gather(b_ct, r_slot, 0)  # row r of the frontier: candidate r_slot[r]
        o_f = i_b64 * W + o_c
        tl.store(p_fscore + o_f, r_score, mask=sel)
        tl.store(p_fcand + o_f, tl.where(ok_r, layer * C + r_slot, -1), mask=sel)
        tl.store(p_ftok + o_f, tl.where(ok_r, r_tok, 0), mask=sel)
        tl.store(p_cum + i_b64 * CUMW + o_c, r_cum, mask=sel)

        # ---- 4. the batch-level decision: CAST's reads every request's frontier, so the last
        # request to arrive takes it; EAGLE's is its sizes, written by request 0 without a
        # batch arrival (no fence and atomic per request)
        if not CAST:
            if i_b64 == 0:
                tl.store(p_dec + layer, W)
                tl.store(p_dec + D + layer, (layer + 1 < D).to(tl.int32))
        else:
            # what the decision reads that no program of this launch writes (the requests, the
            # earlier layers' widths and utilities, the cost table), loaded before the arrival:
            # its round trips overlap the fence and the atomic
            o_w = tl.arange(0, WP)
            m_w = o_w < W
            o_b = tl.arange(0, BP)
            m_b = o_b < B
            b_a = tl.load(p_active + o_b, mask=m_b, other=0) != 0
            b_seq = tl.load(p_seq + o_b, mask=m_b & b_a, other=0)
            o_d = tl.arange(0, DP)
            b_wid = tl.load(p_dec + o_d, mask=o_d < layer, other=0)
            ctx = tl.maximum(tl.max(b_seq) + tl.sum(b_wid).to(tl.int64), 0)  # bucket >= 0
            bucket = tl.minimum(ctx // L, M - 1)
            t1 = tl.load(p_tab_t + bucket * NMAX)
            b_c = tl.load(p_tab_d + bucket * NMAX + o_w, mask=m_w, other=0.0) / t1
            u_prev = tl.load(p_uhist + o_d, mask=o_d < layer, other=0.0)
            u_jm1 = tl.load(p_uhist + o_d - 1, mask=(o_d >= 1) & (o_d <= layer), other=0.0)
            if _release_then_arrive(p_ctr + B, LANES, FENCE) == B - 1:
                tl.store(p_ctr + B, 0)
                b_cum = tl.load(
                    p_cum + o_b[:, None] * CUMW + o_w[None, :],
                    mask=(m_b & b_a)[:, None] & m_w[None, :],
                    other=0.0,
                    cache_modifier=".cg",
                )  # [BP, WP]
                # Algorithm 1 on the sums U_k with threshold C1 * n_act: the batch mean's
                # maximisers without its rounding (U / 3 breaks dyadic ties; the reference
                # agrees)
                n_act = tl.maximum(tl.sum(b_a.to(tl.int32)), 1).to(tl.float32)
                b_U = tl.sum(b_cum, axis=0)  # [WP]
                # k capped at the most valid next-frontier rows of an active request (written
                # above by each request's last program, before its arrival): past it U is flat,
                # and on a plateau of costs the largest k would name rows no request has
                b_fv = tl.load(
                    p_fscore + o_b.to(tl.int64)[:, None] * W + o_w[None, :],
                    mask=(m_b & b_a)[:, None] & m_w[None, :],
                    other=-1.0,
                    cache_modifier=".cg",
                )  # [BP, WP]
                cap = tl.maximum(tl.max(tl.sum((b_fv >= 0).to(tl.int32), axis=1)), 1)
                b_obj = tl.where(m_w & (o_w < cap), b_U - (C1 * n_act) * b_c, -float("inf"))
                n = tl.max(tl.where(b_obj == tl.max(b_obj), o_w + 1, 0))
                u_n = tl.sum(tl.where(o_w + 1 == n, b_U, 0.0)) / n_act
                c_n = tl.sum(tl.where(o_w + 1 == n, b_c, 0.0))
                tl.store(p_uhist + layer, u_n)
                # FIFO [1, phi_0, .., phi_{i-1}], phi_j = u_{j+1} / u_j; its last R entries
                u_j = tl.where(o_d == layer, u_n, u_prev)
                phi = tl.where(u_jm1 > 0, u_j / tl.where(u_jm1 > 0, u_jm1, 1.0), 0.0)
                e = tl.where(o_d == 0, 1.0, phi)
                in_fifo = (o_d <= layer) & (o_d >= layer + 1 - R)
                alpha = tl.sum(tl.where(in_fifo, e, 0.0)) / tl.minimum(layer + 1, R).to(tl.float32)
                flag = (alpha * u_n / c_n >= C2) & (layer + 1 < D)
                # trim every request's frontier to the batch width
                o_b64 = o_b.to(tl.int64)
                cut = m_b[:, None] & m_w[None, :] & (o_w[None, :] >= n)
                o_fw = o_b64[:, None] * W + o_w[None, :]
                tl.store(p_fscore + o_fw, tl.full([BP, WP], -1.0, tl.float32), mask=cut)
                tl.store(p_fcand + o_fw, tl.full([BP, WP], -1, tl.int32), mask=cut)
                tl.store(p_ftok + o_fw, tl.zeros([BP, WP], tl.int64), mask=cut)
                tl.store(p_dec + layer, n)
                tl.store(p_dec + D + layer, flag.to(tl.int32))


@triton.jit(do_not_specialize=["n_layers", "D"])
def _select_kernel(
    p_cscore,
    p_sel,
    p_pos,
    p_cum,
    n_layers,
    D,  # layers of p_cscore: a runtime int (TP, its tile, is a power of two)
    C: tl.constexpr,
    N: tl.constexpr,
    CUMW: tl.constexpr,
    TP: tl.constexpr,
    NP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    i_b = tl.program_id(0).to(tl.int64)
    o_t = tl.arange(0, TP)
    m_t = o_t < n_layers * C
    b_s = tl.load(p_cscore + i_b * (D * C) + o_t, mask=m_t, other=-1.0)
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
    pdl_release(PDL)
    tl.store(p_sel + i_b * N + o_j, tl.where(ok_j, c_idx, -1), mask=o_j < N - 1)
    tl.store(p_pos + i_b * (D * C) + c_idx, o_j + 1, mask=ok_j)
    # utilities of the rerank: 1 (root) + the j best scores, at column j
    tl.store(p_cum + i_b * CUMW + o_j + 1, 1.0 + tl.cumsum(c_s, axis=0), mask=o_j + 1 < N)
    tl.store(p_cum + i_b * CUMW, 1.0)


@triton.jit(do_not_specialize=["B", "n_layers", "C3", "L", "M", "D"])
def _emit_kernel(
    p_ctok,
    p_cscore,
    p_cpar,
    p_sel,
    p_pos,
    p_cum,
    p_active,
    p_seq,
    p_root,
    p_dec,
    p_tab_t,
    p_tok,
    p_par,
    p_num,
    p_dep,
    p_anc,
    p_fc,
    p_ns,
    p_sc,
    B,
    n_layers,
    C3,
    L,
    M,
    D,  # layers of the candidate arrays: a runtime int (LOG_D covers it)
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
    SELECT: tl.constexpr,  # rank the request's candidates here (TP: their padded count + 1)
    TP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    i_b = tl.program_id(0).to(tl.int64)
    o_n = tl.arange(0, NP)
    m_n = o_n < N
    base = i_b * (D * C)
    if CAST:
        o_b = tl.arange(0, BP)
        m_b = o_b < B
        b_a = tl.load(p_active + o_b, mask=m_b, other=0) != 0
        ctx = tl.maximum(tl.max(tl.load(p_seq + o_b, mask=m_b & b_a, other=0)), 0)  # bucket >= 0
        bucket = tl.minimum(ctx // L, M - 1)
        b_cum = tl.load(
            p_cum + o_b[:, None] * CUMW + o_n[None, :],
            mask=(m_b & b_a)[:, None] & m_n[None, :],
            other=0.0,
        )  # [BP, NP]
        n_act = tl.maximum(tl.sum(b_a.to(tl.int32)), 1).to(tl.float32)
        b_U = tl.sum(b_cum, axis=0)  # Algorithm 1 on the sums, threshold C3 * n_act
        t1 = tl.load(p_tab_t + bucket * NMAX)
        b_c = tl.load(p_tab_t + bucket * NMAX + o_n, mask=m_n, other=0.0) / t1
        # k capped at 1 + the most selected candidates of an active request (p_sel, written by
        # the select launch): the count never exceeds max_b num_nodes[b]
        b_sa = tl.load(
            p_sel + o_b.to(tl.int64)[:, None] * N + o_n[None, :],
            mask=(m_b & b_a)[:, None] & (o_n < N - 1)[None, :],
            other=-1,
        )  # [BP, NP]
        cap = 1 + tl.max(tl.sum((b_sa >= 0).to(tl.int32), axis=1))
        b_obj = tl.where(m_n & (o_n < cap), b_U - (C3 * n_act) * b_c, -float("inf"))
        n = tl.max(tl.where(b_obj == tl.max(b_obj), o_n + 1, 0))
    else:
        n = N
    if i_b == 0:
        tl.store(p_dec + 2 * D, n)

    act = tl.load(p_active + i_b) != 0
    if SELECT:
        # the select launch's ranking, with the root as a key above every candidate's (slot
        # TP - 1, past the candidates), so that node j is the j-th key
        o_t = tl.arange(0, TP)
        b_s = tl.load(p_cscore + base + o_t, mask=o_t < n_layers * C, other=-1.0)
        b_key = tl.where(
            b_s >= 0,
            (b_s.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (0x7FFFFFFF - o_t).to(tl.int64),
            -9223372036854775807 - 1,
        )
        b_top = tl.topk(tl.where(o_t == TP - 1, 9223372036854775807, b_key), NP)
        c_idx = (0x7FFFFFFF - (b_top & 0xFFFFFFFF)).to(tl.int32)
        b_sel = tl.where((b_top >= 0) & (o_n >= 1) & m_n, c_idx, -1)
    else:
        b_sel = tl.load(
            p_sel + i_b * N + o_n - 1, mask=(o_n >= 1) & m_n, other=-1
        )  # node j <- sel[j-1]
    have = tl.sum(((b_sel >= 0) & (o_n >= 1) & m_n).to(tl.int32))
    m = tl.where(act, tl.minimum(n, 1 + have), 0)
    live = o_n < m
    cand = live & (o_n >= 1)
    b_tok = tl.load(p_ctok + base + b_sel, mask=cand, other=0)
    b_tok = tl.where(live & (o_n == 0), tl.load(p_root + i_b), b_tok)
    b_sc = tl.load(p_cscore + base + b_sel, mask=cand, other=0.0)
    b_sc = tl.where(live & (o_n == 0), 1.0, b_sc)
    b_pc = tl.load(p_cpar + base + b_sel, mask=cand, other=-1)
    if SELECT:
        # a selected candidate's parent is selected too, ranked above it (its path score is at
        # least the child's and its index lower): the node whose candidate it is, found by
        # compares (the positions through memory: an L2 round trip, 1 us more on an H100)
        hit = (b_pc[:, None] == b_sel[None, :]) & (b_sel[None, :] >= 0)  # [NP(child), NP]
        b_par = tl.max(tl.where(hit, o_n[None, :], 0), axis=1)
    else:
        b_par = tl.where(
            b_pc >= 0, tl.load(p_pos + base + b_pc, mask=cand & (b_pc >= 0), other=0), 0
        )
    b_par = tl.where(cand, b_par, -1)  # [NP]

    # links (before the ancestor matrix, so their [NP, NP] tiles are dead by then): first child
    # = smallest child index; next sibling = next larger index, same parent
    big = NP + 1
    kid = (b_par[None, :] == o_n[:, None]) & live[:, None]  # [NP(parent i), NP(child j)]
    b_fc = tl.min(tl.where(kid, o_n[None, :], big), axis=1)
    sib = (
        (b_par[None, :] == b_par[:, None]) & (b_par[:, None] >= 0) & (o_n[None, :] > o_n[:, None])
    )  # [NP(i), NP(j)]: j a later sibling of i
    b_ns = tl.min(tl.where(sib, o_n[None, :], big), axis=1)

    # ancestor-or-self matrix by repeated squaring of (I + parent), 2^LOG_D >= D covers every
    # path; 0/1 values are exact in fp16 and counts in the fp32 accumulator
    o_c = tl.arange(0, NP)
    b_am = ((o_n[:, None] == o_c[None, :]) | (b_par[:, None] == o_c[None, :])) & live[:, None]
    b_af = b_am.to(DOT_T)  # [NP, NP]
    for _ in tl.static_range(LOG_D):
        b_af = tl.where(tl.dot(b_af, b_af) > 0, 1.0, 0.0).to(DOT_T)
    b_ai = (b_af > 0).to(tl.int32)
    b_dep = tl.where(live, tl.sum(b_ai, axis=1) - 1, 0)
    # the ancestor words: node c's bit of word c // 32 (distinct bits: their sum is their or).
    # Not as products by place values ([NP, NP] x [NP, NP // 32]): that tl.dot read shared memory
    # out of range on an H100 (compute-sanitizer, Triton 3.6) where the interpreter was exact.
    b_bits = tl.where(b_ai != 0, (1 << (o_c % 32))[None, :], 0)
    b_anc = tl.sum(tl.reshape(b_bits, [NP, NP // 32, 32]), axis=2)  # [NP, NP // 32]
    o_w = tl.arange(0, NP // 32)

    o_out = i_b * N + o_n
    tl.store(p_tok + o_out, b_tok, mask=m_n)
    tl.store(p_par + o_out, b_par, mask=m_n)
    tl.store(p_dep + o_out, b_dep, mask=m_n)
    tl.store(p_sc + o_out, tl.where(live, b_sc, 0.0), mask=m_n)
    tl.store(p_fc + o_out, tl.where(b_fc < big, b_fc, -1), mask=m_n)
    tl.store(p_ns + o_out, tl.where(b_ns < big, b_ns, -1), mask=m_n)
    tl.store(
        p_anc + o_out[:, None] * AW + o_w[None, :],
        b_anc.to(tl.int32),
        mask=m_n[:, None] & (o_w[None, :] < AW),
    )
    tl.store(p_num + i_b, m)


# --------------------------------------------------------------------------------- launchers
class CastInputs(NamedTuple):
    """What CAST's decisions read (the launchers take ``None`` for EAGLE's fixed width): the
    policy's thresholds and FIFO length, and its cost table's device rows for the batch."""

    c1: float  # width threshold
    c2: float  # depth threshold
    c3: float  # verification threshold of the rerank
    fifo: int  # R, length of the FIFO of utility ratios
    target_times: torch.Tensor  # [buckets, n_max] float32
    draft_times: torch.Tensor  # [buckets, n_max] float32
    bucket_len: int  # context tokens per bucket (L)
    buckets: int  # M
    n_max: int


def _no_cast(dummy: torch.Tensor) -> CastInputs:
    """EAGLE's stand-in: the CAST arguments are never read (CAST=False)."""
    return CastInputs(0.0, 0.0, 0.0, 1, dummy, dummy, 1, 1, 1)


def expand(
    logits: torch.Tensor,
    *,
    layer: int,
    topk: int,
    active: torch.Tensor,  # [B] bool
    seq_lens: torch.Tensor,  # [B] int64
    frontier: torch.Tensor,  # [B, W] int32 candidate index of each row, rewritten
    frontier_tokens: torch.Tensor,  # [B, W] int64, rewritten
    frontier_scores: torch.Tensor,  # [B, W] float32, rewritten
    cand_tokens: torch.Tensor,  # [B, D, W * K] int64, layer ``layer`` written
    cand_scores: torch.Tensor,  # [B, D, W * K] float32, likewise
    cand_parents: torch.Tensor,  # [B, D, W * K] int32, likewise
    decisions: torch.Tensor,  # [2D + 1] int32: width and depth flag of ``layer`` written
    u_hist: torch.Tensor,  # [D] float32 (CAST)
    workspace: dict[str, torch.Tensor],
    cast: CastInputs | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
    split: int | None = None,
    cand_cap: int = 32,
    cand_tiles: int | None = None,
    max_block: int | None = None,
    row_warps: int | None = None,
    blocks_topk: bool | None = None,
    rank_topk: bool = True,
    stream_ahead: int = 2,
    cand_ahead: bool = True,
    stream_lanes: bool | None = None,
    stream_early: bool | None = None,
) -> None:
    """Expand draft layer ``layer`` over ``logits`` [B, W, V], or [B, 1, V] (the root's row alone,
    at layer 0: the launch covers B rows, and the request's other candidate slots of the layer
    are written empty): with a split > 1, ``_stream_kernel`` over (row, chunk) programs then
    ``_expand_kernel`` per row; else ``_expand_kernel`` alone.

    The tensors are a ``DraftState``'s fields of the same names (shapes in its docstring; D is
    ``cand_scores.shape[1]``), ``workspace`` its workspace dict (``counters``, ``cum``; a split > 1
    adds its buffers there on the first call: make that call before capturing a CUDA graph).
    ``topk`` is K, ``cast`` CAST's inputs or None for EAGLE's fixed width.

    ``block_v`` (vocabulary tile, a power of two), ``num_warps`` (of the streaming programs when
    split > 1, else of the one program per row) and ``split`` (streaming programs per row, each
    one chunk of V; default ``expand_tiling``'s, from the SM count and V only) override the
    defaults. With a split, ``cand_cap`` (0, or a power of two >= 16) is the most top-K
    candidates of a row ranked at once (a row with more, many equal logits, takes the
    block-by-block merge, with the same result; 0: always the merge), ``max_block`` (a power of
    two <= ``block_v``; default ``expand_max_block``'s) the tokens per maximum the stream
    records, i.e. per block the top-K pass may re-read, and ``cand_tiles`` (a power of two) how
    many such blocks are read at once (more: fewer block-wide steps, more registers, so fewer
    resident programs at large B). By default 4 when every logits row's program has an SM to
    itself or blocks are 128 tokens or fewer, else 1 (``bench_build_tree.py --ops sweep_topk``'s
    sweeps, docs/benchmarks.md). ``row_warps``: warps of the per-row programs when split > 1
    (default 4).
    ``blocks_topk`` finds the K best blocks with one ``tl.topk`` (where K > 1 and a row has at
    least pow2(K) blocks) instead of K max-reductions over the row's block maxima; by default
    (None) where pow2(blocks a row) <= ``BLOCKS_TOPK_MAX``. ``rank_topk`` (default on) ranks the
    K best candidates with one (where K > 1 and ``cand_cap`` >= pow2(K)) instead of pairwise
    compares against re-read chunks. The same result either way; a ``tl.topk`` over 2,048 keys
    costs more than K reductions over them (the H200's sweep, docs/benchmarks.md session 30).
    ``stream_ahead``: tiles each streaming
    program loads ahead of the one it reduces (2, the default, or 3: more bytes in flight per
    warp, where the one-warp programs' SM limit of 32 caps the warps; untimed). ``cand_ahead``
    (default on): the top-K's reads of ``cand_tiles`` blocks at a time each issued before the one
    before is compacted (two in flight; 1.5-4.5 % faster on every swept row). ``stream_lanes``: the
    streaming programs keep the softmax's max and sum per 16-byte vector of logits and reduce
    them across the warp once per chunk, not per tile (``_stream_tiles_lanes``; two tiles ahead,
    ``stream_ahead`` ignored); by default (None) where blocks are ``STREAM_LANES_MIN_BLOCK``
    tokens or more and smaller than a tile. ``stream_early``: the streaming programs load their
    first tiles before their row's state is known (where blocks are smaller than a tile); by
    default (None) ``early_tile_loads``' rule, launches of at most ``STREAM_EARLY_MAX_BYTES``."""
    if stream_ahead not in (2, 3):
        raise ValueError(f"stream_ahead must be 2 or 3, got {stream_ahead}")
    if cand_cap != 0 and (cand_cap < 16 or cand_cap & (cand_cap - 1)):
        raise ValueError(f"cand_cap must be 0 or a power of two >= 16, got {cand_cap}")
    if cand_tiles is not None and (cand_tiles < 1 or cand_tiles & (cand_tiles - 1)):
        raise ValueError(f"cand_tiles must be a power of two, got {cand_tiles}")
    if row_warps is not None and (row_warps not in (1, 2, 4, 8, 16)):
        raise ValueError(f"row_warps must be 1, 2, 4, 8 or 16, got {row_warps}")
    B, RW, V = logits.shape
    W = frontier.shape[1]
    if RW not in (1, W):
        raise ValueError(
            f"Invalid shape of logits: expected {W} rows a request, or 1 (the root's), got {RW}"
        )
    rows = B * RW  # the launch's logits rows: one program each, or SPLIT
    K, D = topk, cand_scores.shape[1]
    C = W * K
    block_v, split = expand_tiling(rows, V, logits.device, block_v, split)
    chunk = cdiv(cdiv(V, split), block_v) * block_v
    if max_block is None:
        max_block = expand_max_block(rows, V, block_v, logits.device)
    if max_block < 1 or max_block > block_v or max_block & (max_block - 1):
        raise ValueError(f"max_block must be a power of two <= block_v ({block_v}): {max_block}")
    if cand_tiles is None:
        cand_tiles = 4 if rows <= _runtime.sm_count(logits.device) or max_block <= 128 else 1
    if stream_lanes is None:
        stream_lanes = STREAM_LANES_MIN_BLOCK <= max_block < block_v
    n_blocks = cdiv(V, max_block)
    KP = pow2(K)
    if blocks_topk is None:
        blocks_topk = pow2(n_blocks) <= BLOCKS_TOPK_MAX
    ws = workspace
    pdl = use_pdl(logits.device, PDL_LATE.value)
    if split > 1:
        pm, ps, pt = split_workspace(workspace, rows, split, n_blocks, logits.device)
        # step 1 in one-warp programs of its own launch, the rest one program per row
        direct(_stream_kernel).launch(
            (rows * split,),
            logits,
            frontier_scores,
            active.view(torch.uint8),
            pm,
            ps,
            pt,
            V,
            logits.stride(0),
            logits.stride(1),
            W=W,
            RW=RW,
            BLOCK_V=block_v,
            MB=max_block,
            SPLIT=split,
            CHUNK=chunk,
            NT=n_blocks,
            PDL=pdl,
            AHEAD=stream_ahead,
            VEC=min(16 // logits.element_size(), max_block) if stream_lanes else 0,
            WARPS=num_warps or stream_warps(block_v),
            EARLY=early_tile_loads(rows, V, logits.element_size())
            if stream_early is None
            else stream_early,
            num_warps=num_warps or stream_warps(block_v),
            launch_pdl=pdl > 0,
        )
        warps = row_warps or (1 if interpreted() else 4)
    else:
        pm = ps = pt = workspace["counters"]  # never read (SPLIT = 1)
        warps = num_warps or (1 if interpreted() else (8 if block_v >= 4096 else 4))
    costs = cast if cast is not None else _no_cast(u_hist)
    direct(_expand_kernel).launch(
        (rows,),
        logits,
        frontier_scores,
        frontier,
        frontier_tokens,
        active.view(torch.uint8),
        seq_lens,
        cand_tokens,
        cand_scores,
        cand_parents,
        decisions,
        u_hist,
        ws["counters"],
        ws["cum"],
        costs.target_times,
        costs.draft_times,
        pm,
        ps,
        pt,
        B,
        V,
        layer,
        logits.stride(0),
        logits.stride(1),
        float(costs.c1),
        float(costs.c2),
        costs.bucket_len,
        costs.buckets,
        W=W,
        RW=RW,
        K=K,
        D=D,
        R=costs.fifo,
        NMAX=costs.n_max,
        CUMW=ws["cum"].shape[1],
        KP=KP,
        CPAD=pow2(C),
        WP=pow2(W),
        BP=pow2(B),
        DP=pow2(D),
        BLOCK_V=block_v,
        SPLIT=split,
        SP=pow2(split),
        MB=max_block if split > 1 else 1,
        NT=n_blocks if split > 1 else 1,
        NTP=pow2(n_blocks) if split > 1 else 1,
        GT=min(cand_tiles, KP),
        CAP=cand_cap,
        # K = 1: one max is the whole ranking (and tl.topk of 1 fails to build)
        BLOCKS_TOPK=split > 1 and blocks_topk and KP > 1 and pow2(n_blocks) >= KP,
        RANK_TOPK=split > 1 and rank_topk and KP > 1 and cand_cap >= KP,
        CAND_AHEAD=split > 1 and cand_ahead,
        LANES=32 * warps,
        FENCE=not interpreted(),
        CAST=cast is not None,
        PDL=pdl,
        num_warps=warps,
        launch_pdl=pdl > 0,
    )


def emit(
    *,
    layer: int,
    capacity: int,
    active: torch.Tensor,
    seq_lens: torch.Tensor,
    root_tokens: torch.Tensor,
    cand_tokens: torch.Tensor,
    cand_scores: torch.Tensor,
    cand_parents: torch.Tensor,
    decisions: torch.Tensor,
    workspace: dict[str, torch.Tensor],
    cast: CastInputs | None = None,
    out: Tree | None = None,
) -> Tree:
    """Rerank the candidates of ``layer`` expanded layers and emit the tree of ``capacity`` nodes
    (two launches); writes the verify count into ``decisions``. Tensors and ``workspace`` as for
    ``expand`` (``workspace`` also holds ``sel`` and ``pos``)."""
    B = active.shape[0]
    D, C, N = cand_scores.shape[1], cand_scores.shape[2], capacity
    dev = cand_scores.device
    if out is None:
        out = Tree.uninitialized(B, N, dev)  # contiguous
    else:
        for f in Tree.FIELDS:
            if not getattr(out, f).is_contiguous():
                raise ValueError(f"Invalid layout of out.{f}: expected a contiguous tensor")
    ws = workspace
    costs = cast if cast is not None else _no_cast(decisions)
    NP = max(pow2(N), 32)  # >= 32: whole anc words, and tl.dot's minimum
    # EAGLE's verify count is N: no request's tree waits for the others' selections, so each
    # emit program ranks its own candidates (one launch); CAST's count reads every request's
    # prefix sums, which the select launch writes first
    select = cast is None
    TP = max(pow2(D * C + select), NP)  # the ranked keys: the candidates (and the root's, EAGLE)
    # [NP, NP] tiles: past 64 nodes 8 warps keep the per-thread registers in bounds
    # (bench/compile_check.py reports them)
    warps = 1 if interpreted() else (4 if NP <= 64 else 8)
    pdl = use_pdl(dev, PDL_LATE.value)
    if not select:
        direct(_select_kernel).launch(
            (B,),
            cand_scores,
            ws["sel"],
            ws["pos"],
            ws["cum"],
            layer,
            D=D,
            C=C,
            N=N,
            CUMW=ws["cum"].shape[1],
            TP=TP,
            NP=NP,
            PDL=pdl,
            num_warps=warps,
            launch_pdl=pdl > 0,
        )
    direct(_emit_kernel).launch(
        (B,),
        cand_tokens,
        cand_scores,
        cand_parents,
        ws["sel"],
        ws["pos"],
        ws["cum"],
        active.view(torch.uint8),
        seq_lens,
        root_tokens,
        decisions,
        costs.target_times,
        out.tokens,
        out.parents,
        out.num_nodes,
        out.depth,
        out.anc,
        out.first_child,
        out.next_sibling,
        out.scores,
        B,
        layer,
        float(costs.c3),
        costs.bucket_len,
        costs.buckets,
        D=D,
        C=C,
        N=N,
        AW=anc_words(N),
        CUMW=ws["cum"].shape[1],
        NMAX=costs.n_max,
        NP=NP,
        BP=pow2(B),
        LOG_D=max(0, (D - 1).bit_length()),
        DOT_T=tl.float32 if interpreted() else tl.float16,
        CAST=not select,
        SELECT=select,
        TP=TP,
        PDL=pdl,
        num_warps=warps,
        launch_pdl=pdl > 0,
    )
    return out
