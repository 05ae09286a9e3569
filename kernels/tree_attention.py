"""Tree-masked paged attention: Triton kernels and their launcher.

One program owns one tile of ``BLOCK_M = G_PAD · BLOCK_Q`` query rows — ``BLOCK_Q`` tree nodes ×
the ``G`` query heads that share one KV head, packed into the M dimension of the tile, so each K/V
tile is loaded once for the whole group — of one (request, KV head), and one of ``NUM_SPLITS``
chunks of that request's keys. Keys are the prefix (slots ``< seq_lens[b]``: full tiles without any
mask, then one tail tile with a length mask) followed by the tree nodes (the only tiles that read
``anc``). With ``NUM_SPLITS > 1`` the chunks write normalised partial outputs and their LSE to a
workspace and ``_merge_splits`` combines them. ``NUM_SPLITS`` comes from (B, H_kv, node capacity,
block-table capacity, SM count) only, so the grid never depends on tensor values and both launches
can be captured in a CUDA graph. How many of those chunks a request uses is decided on the device
from its own key count (``_splits_used``): chunks are whole key tiles, so a short request uses
fewer; with a ``split_min_len`` bound (off by default, ``MIN_SPLIT_LEN``) a request under it is not
split at all — its first chunk's program writes the output and the merge skips it. With
``fused_merge`` (``FUSED_MERGE``, off: slower where many long chunks finish together) there is no
merge launch: the last of a tile's chunk programs to finish (an arrival counter per tile) merges
the tile's partials itself.

Query tiles are counted from ``q_start[b]`` (tile t holds nodes ``q_start + t·BLOCK_Q ...``), so a
drafting step that queries a handful of frontier nodes runs one tile, not ``N / BLOCK_Q``; rows
outside the query range are zero-filled by the program whose absolute tile holds them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from treeops._runtime import interpreted

from . import tree_attention_gluon as _gluon
from ._counters import arrival_counters, arrive
from ._launch import direct
from ._pdl import first_launch_pdl, pdl_enter, use_pdl

# the launch configuration, re-exported for readers of this module; its module globals
# (SMALL_TREE, FUSED_MERGE, TUNED, ...) are read where they live: rebind them on
# tree_attention_config
from .tree_attention_config import (  # noqa: F401
    CANDIDATES,
    D256_WIDE_SHARED,
    MAX_SPLITS,
    MIN_CHUNK,
    MIN_SPLIT_CAPACITY,
    MIN_SPLIT_LEN,
    PROGRAMS_PER_SM,
    SMALL_TREE_MAX_CAPACITY,
    SMALL_TREE_MAX_N,
    TUNED,
    AttnConfig,
    config_for,
    head_dim_class,
    pick_config,
    small_tree_applies,
    workspace_numel,
)

_LN2 = 0.6931471805599453
_LOG2E = 1.4426950408889634


@triton.jit
def _attend(q, k, v, acc, m_i, l_i, qk_scale, vis, MASKED: tl.constexpr, UPCAST: tl.constexpr):
    """One online-softmax step over a [BLOCK_N, D] tile of keys (log2 domain)."""
    if UPCAST:
        # fp32 inputs, and every input under the interpreter (its bf16 dot is wrong)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_M, BLOCK_N]
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * qk_scale
    if MASKED:
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row that has seen no key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if UPCAST:
        acc = tl.dot(p, v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def _kv_page(p_bt, pos, m_k, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """int64 page id of each logical slot ``pos`` [BLOCK_N] from the request's block-table row
    (masked-off slots read page 0)."""
    if MASKED:
        page = tl.load(p_bt + pos // PAGE_SIZE, mask=m_k, other=0)
    else:
        page = tl.load(p_bt + pos // PAGE_SIZE)
    return page.to(tl.int64)


@triton.jit
def _load_paged(X, page, slot, m_k, off_h, o_d, s_p, s_s, s_d, MASKED: tl.constexpr):
    """One [BLOCK_N, D] tile of the paged cache ``X`` at (page, slot) rows of head offset
    ``off_h``."""
    p_x = (
        X
        + (page * s_p + slot.to(tl.int64) * s_s + off_h)[:, None]
        + o_d.to(tl.int64)[None, :] * s_d
    )
    if MASKED:
        b_x = tl.load(p_x, mask=m_k[:, None], other=0.0)
    else:
        b_x = tl.load(p_x)
    return b_x


@triton.jit
def _load_kv(kv, page, pos, m_k, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """The [BLOCK_N, D] K and V tiles of logical slots ``pos`` on pages ``page`` (int64, so that
    pages past 2**31 bytes address right); masked-off rows read 0. ``kv``: the caches, their KV
    head's offsets, the head-dim offsets and the caches' strides (see ``_tree_attn_fwd``)."""
    K, V, off_kh, off_vh, o_d, s_kp, s_ks, s_kd, s_vp, s_vs, s_vd = kv
    slot = pos % PAGE_SIZE
    b_k = _load_paged(K, page, slot, m_k, off_kh, o_d, s_kp, s_ks, s_kd, MASKED)
    b_v = _load_paged(V, page, slot, m_k, off_vh, o_d, s_vp, s_vs, s_vd, MASKED)
    return b_k, b_v


@triton.jit
def _tree_visible(p_anc, j0, o_n, m_row, m_k, N, BLOCK_N: tl.constexpr):
    """[BLOCK_M, BLOCK_N] visibility of tree keys ``j0 + o_n`` to the tile's rows: bit j of the
    row's ancestor words (``p_anc`` [BLOCK_M] points at word 0), where ``m_row`` and ``m_k``.
    ``j0`` is a multiple of BLOCK_N, so the keys lie in one word (BLOCK_N <= 32) or in
    BLOCK_N / 32 whole words: [BLOCK_M] loads of the words, not a [BLOCK_M, BLOCK_N] gather of
    the same word 32 times (its 64-bit pointers alone held 32 registers a thread at 128 x 32)."""
    if BLOCK_N <= 32:
        word = tl.load(p_anc + j0 // 32, mask=m_row, other=0)  # [BLOCK_M]
        bits = word[:, None] >> ((j0 % 32) + o_n)[None, :]
    else:
        bits = tl.zeros([p_anc.shape[0], BLOCK_N], tl.int32)
        for i in tl.static_range(BLOCK_N // 32):
            word = tl.load(p_anc + j0 // 32 + i, mask=m_row & (j0 + 32 * i < N), other=0)
            bits = tl.where((o_n // 32 == i)[None, :], word[:, None] >> (o_n % 32)[None, :], bits)
    return ((bits & 1) != 0) & m_k[None, :]


@triton.jit
def _splits_used(
    kv_len, NUM_SPLITS: tl.constexpr, SPLIT_MIN_LEN: tl.constexpr, SPLIT_CHUNK: tl.constexpr
):
    """Chunks a request of ``kv_len`` keys is split into: 1 below ``SPLIT_MIN_LEN`` keys, else as
    many chunks of at least ``SPLIT_CHUNK`` keys as fit, at most ``NUM_SPLITS``."""
    used = tl.minimum(tl.maximum(kv_len // SPLIT_CHUNK, 1), NUM_SPLITS)
    return tl.where(kv_len < SPLIT_MIN_LEN, 1, used)


@triton.jit
def _partials(WO, O, HALF: tl.constexpr):
    """The split workspace's partial outputs: fp32, or with ``HALF`` the same elements in O's
    16-bit dtype (the first half of the fp32 region's bytes)."""
    p_wo = WO
    if HALF:
        p_wo = WO.to(tl.pointer_type(O.dtype.element_ty))
    return p_wo


@triton.jit
def _merge_tile(WO, WL, O, L, w_row, o_q, o_h, m_row, used, s_ob, s_on, s_oh, s_od, s_lb, s_ln,
                s_lh, i_b, BLOCK_M: tl.constexpr, D: tl.constexpr,
                WRITE_LSE: tl.constexpr):  # fmt: skip
    """One query tile's output from its ``used`` partials (rows ``w_row + s`` of the workspace),
    weighted by exp(lse_s - max lse) as ``_merge_splits`` does, accumulated online; in column
    blocks of at most 128 (a [128, 256] fp32 accumulator and partial would not fit the
    registers)."""
    DM: tl.constexpr = D if D <= 128 else 128
    for c in tl.static_range(D // DM):
        o_d = (c * DM + tl.arange(0, DM)).to(tl.int64)
        b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        b_l = tl.zeros([BLOCK_M], tl.float32)
        b_acc = tl.zeros([BLOCK_M, DM], tl.float32)
        for s in range(0, used):
            lse = tl.load(WL + w_row + s, mask=m_row, other=float("-inf"))
            part = tl.load(
                WO + (w_row + s)[:, None] * D + o_d[None, :], mask=m_row[:, None], other=0.0
            ).to(tl.float32)
            m_new = tl.maximum(b_m, lse)
            base = tl.where(m_new == float("-inf"), 0.0, m_new)
            keep = tl.exp(b_m - base)
            w = tl.exp(lse - base)
            b_acc = b_acc * keep[:, None] + w[:, None] * part
            b_l = b_l * keep + w
            b_m = m_new
        seen = b_l > 0.0
        b_o = b_acc / tl.where(seen, b_l, 1.0)[:, None]
        p_o = O + i_b * s_ob + o_q[:, None] * s_on + o_h[:, None] * s_oh + o_d[None, :] * s_od
        tl.store(p_o, b_o.to(O.dtype.element_ty), mask=m_row[:, None])
        if WRITE_LSE and c == 0:
            b_lse = tl.where(seen, b_m + tl.log(tl.where(seen, b_l, 1.0)), float("-inf"))
            tl.store(L + i_b * s_lb + o_q * s_ln + o_h * s_lh, b_lse, mask=m_row)


@triton.jit(do_not_specialize=["N", "H_KV", "qk_scale"])
def _tree_attn_fwd(
    Q,
    K,
    V,
    BT,
    SEQ,
    NN,
    ANC,
    QS,
    QL,
    O,
    L,
    WO,
    WL,
    CNT,
    qk_scale,
    N,
    H_KV,
    s_qb,
    s_qn,
    s_qh,
    s_qd,
    s_kp,
    s_ks,
    s_kh,
    s_kd,
    s_vp,
    s_vs,
    s_vh,
    s_vd,
    s_btb,
    s_ab,
    s_an,
    s_ob,
    s_on,
    s_oh,
    s_od,
    s_lb,
    s_ln,
    s_lh,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLIT_MIN_LEN: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    HAS_QS: tl.constexpr,
    HAS_QL: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    UPCAST: tl.constexpr,
    PREFETCH: tl.constexpr,
    PIPE: tl.constexpr = 0,
    WARP_SPEC: tl.constexpr = False,
    FUSED_MERGE: tl.constexpr = False,
    FENCE: tl.constexpr = False,
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (``_pdl``)
    PARTIAL_HALF: tl.constexpr = False,  # partial outputs in O's 16-bit dtype (``partial_half``)
):
    pdl_enter(PDL)
    BLOCK_M: tl.constexpr = G_PAD * BLOCK_Q
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_s = tl.program_id(2)
    i_b = i_bh // H_KV
    i_kvh = i_bh % H_KV
    H_Q = H_KV * G

    seq = tl.load(SEQ + i_b)
    nn = tl.minimum(tl.load(NN + i_b), N)
    if HAS_QS:
        qs = tl.load(QS + i_b)
    else:
        qs = 0
    if HAS_QL:
        ql = tl.load(QL + i_b)
    else:
        ql = N
    q_end = tl.minimum(tl.minimum(qs + ql, nn), N)  # query nodes are [qs, q_end)
    qs = tl.maximum(qs, 0)  # rows [max(qs, 0), q_end) as the reference; relative rows stay < N

    o_m = tl.arange(0, BLOCK_M)
    o_g = o_m % G_PAD  # query head within the group
    o_r = o_m // G_PAD  # query node within the tile
    o_d = tl.arange(0, D).to(tl.int64)
    o_n = tl.arange(0, BLOCK_N)
    o_h = (i_kvh * G + o_g).to(tl.int64)  # [BLOCK_M] query head
    m_g = o_g < G

    kv_len = seq + nn
    if NUM_SPLITS == 1:
        used = 1
    else:
        used = _splits_used(kv_len, NUM_SPLITS, SPLIT_MIN_LEN, SPLIT_CHUNK)
    if (used == 1 or FUSED_MERGE) and i_s == 0:
        # rows of the absolute tile i_t outside the query range are 0 and LSE = -inf (split
        # requests: the merge kernel writes them, unless the merge is fused here)
        r_abs = (i_t * BLOCK_Q + o_r).to(tl.int64)
        m_zero = (r_abs < N) & m_g & ((r_abs < qs) | (r_abs >= q_end))
        p_o = O + i_b * s_ob + r_abs[:, None] * s_on + o_h[:, None] * s_oh + o_d[None, :] * s_od
        tl.store(p_o, tl.zeros([BLOCK_M, D], dtype=O.dtype.element_ty), mask=m_zero[:, None])
        if WRITE_LSE:
            p_l = L + i_b * s_lb + r_abs * s_ln + o_h * s_lh
            tl.store(p_l, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=m_zero)

    if (qs + i_t * BLOCK_Q < q_end) and (i_s < used):
        o_t = i_t * BLOCK_Q + o_r  # [BLOCK_M] query row relative to q_start
        o_q = (qs + o_t).to(tl.int64)  # [BLOCK_M] query node
        m_row = (o_q < q_end) & (o_q >= 0) & m_g
        p_q = Q + i_b * s_qb + o_q[:, None] * s_qn + o_h[:, None] * s_qh + o_d[None, :] * s_qd
        b_q = tl.load(p_q, mask=m_row[:, None], other=0.0)  # [BLOCK_M, D]
        if UPCAST:
            b_q = b_q.to(tl.float32)

        chunk = tl.cdiv(tl.cdiv(kv_len, used), BLOCK_N) * BLOCK_N
        start = i_s * chunk
        end = tl.minimum(start + chunk, kv_len)
        p_bt = BT + i_b * s_btb
        off_kh = i_kvh * s_kh
        off_vh = i_kvh * s_vh
        kv = (K, V, off_kh, off_vh, o_d, s_kp, s_ks, s_kd, s_vp, s_vs, s_vd)

        b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        b_l = tl.zeros([BLOCK_M], tl.float32)
        b_acc = tl.zeros([BLOCK_M, D], tl.float32)

        # prefix: every key visible; full tiles carry no mask at all
        p_end = tl.minimum(end, seq)
        n_full = tl.maximum(p_end - start, 0) // BLOCK_N
        if PIPE > 0:
            # Compiler pipeline: the loop body issues block table -> K/V -> dots and Triton's
            # pipeliner issues the loads PIPE - 1 tiles ahead (cp.async into a ring of shared
            # buffers on sm_80+, the block-table load one level of indirection earlier), so the
            # K/V copies overlap the MMAs and softmax of earlier tiles without holding the next
            # tile in registers as PREFETCH does.
            for it in tl.range(0, n_full, num_stages=PIPE, warp_specialize=WARP_SPEC):
                pos = start + it * BLOCK_N + o_n
                page = _kv_page(p_bt, pos, None, PAGE_SIZE, False)
                b_k, b_v = _load_kv(kv, page, pos, None, PAGE_SIZE, False)
                b_acc, b_m, b_l = _attend(
                    b_q, b_k, b_v, b_acc, b_m, b_l, qk_scale, None, False, UPCAST
                )
        elif PREFETCH:
            # Software pipeline by hand: the page ids of tile it+2 and the K/V of tile it+1 are
            # in flight while tile it is computed. Without it every tile waits on a serial chain
            # block table -> K/V -> dot (bench/attention_notes.md).
            full_end = start + n_full * BLOCK_N
            pos = start + o_n
            m_k = pos < full_end
            page = _kv_page(p_bt, pos, m_k, PAGE_SIZE, True)
            k_nxt, v_nxt = _load_kv(kv, page, pos, m_k, PAGE_SIZE, True)
            pos_nxt = pos + BLOCK_N
            page_nxt = _kv_page(p_bt, pos_nxt, pos_nxt < full_end, PAGE_SIZE, True)
            for _ in range(n_full):
                b_k = k_nxt
                b_v = v_nxt
                m_k = pos_nxt < full_end
                k_nxt, v_nxt = _load_kv(kv, page_nxt, pos_nxt, m_k, PAGE_SIZE, True)
                pos_nxt = pos_nxt + BLOCK_N
                page_nxt = _kv_page(p_bt, pos_nxt, pos_nxt < full_end, PAGE_SIZE, True)
                b_acc, b_m, b_l = _attend(
                    b_q, b_k, b_v, b_acc, b_m, b_l, qk_scale, None, False, UPCAST
                )
        else:
            for it in range(n_full):
                pos = start + it * BLOCK_N + o_n  # [BLOCK_N] logical slot
                page = _kv_page(p_bt, pos, None, PAGE_SIZE, False)
                b_k, b_v = _load_kv(kv, page, pos, None, PAGE_SIZE, False)
                b_acc, b_m, b_l = _attend(
                    b_q, b_k, b_v, b_acc, b_m, b_l, qk_scale, None, False, UPCAST
                )
        tail = start + n_full * BLOCK_N
        if tail < p_end:
            pos = tail + o_n
            m_k = pos < p_end
            page = _kv_page(p_bt, pos, m_k, PAGE_SIZE, True)
            b_k, b_v = _load_kv(kv, page, pos, m_k, PAGE_SIZE, True)
            b_acc, b_m, b_l = _attend(
                b_q, b_k, b_v, b_acc, b_m, b_l, qk_scale, m_k[None, :], True, UPCAST
            )
        # tree nodes: key j visible iff bit j of anc[b, row] (ancestor-or-self). The tiles start
        # at whole multiples of BLOCK_N from the first node, so each spans whole anc words (or
        # part of one) and a row's visibility is one word load per 32 keys (``_tree_visible``);
        # a chunk boundary inside a tile masks the keys before ``start``
        p_anc = ANC + i_b * s_ab + o_q * s_an  # [BLOCK_M]
        t_first = seq + (tl.maximum(start - seq, 0) // BLOCK_N) * BLOCK_N
        for t0 in range(t_first, end, BLOCK_N):
            pos = t0 + o_n
            m_k = (pos >= start) & (pos < end)
            page = _kv_page(p_bt, pos, m_k, PAGE_SIZE, True)
            b_k, b_v = _load_kv(kv, page, pos, m_k, PAGE_SIZE, True)
            vis = _tree_visible(p_anc, t0 - seq, o_n, m_row, m_k, N, BLOCK_N)
            b_acc, b_m, b_l = _attend(b_q, b_k, b_v, b_acc, b_m, b_l, qk_scale, vis, True, UPCAST)

        seen = b_l > 0.0
        b_o = b_acc / tl.where(seen, b_l, 1.0)[:, None]
        b_lse = tl.where(
            seen, (b_m + tl.math.log2(tl.where(seen, b_l, 1.0))) * 0.6931471805599453, float("-inf")
        )
        if used == 1:
            p_o = O + i_b * s_ob + o_q[:, None] * s_on + o_h[:, None] * s_oh + o_d[None, :] * s_od
            tl.store(p_o, b_o.to(O.dtype.element_ty), mask=m_row[:, None])
            if WRITE_LSE:
                tl.store(L + i_b * s_lb + o_q * s_ln + o_h * s_lh, b_lse, mask=m_row)
        else:
            # workspace [B, N, H_q, NUM_SPLITS, D] (+ [B, N, H_q, NUM_SPLITS] LSE), by relative row
            w_row = ((i_b * N + o_t.to(tl.int64)) * H_Q + o_h) * NUM_SPLITS  # [BLOCK_M]
            p_wo = _partials(WO, O, PARTIAL_HALF) + (w_row + i_s)[:, None] * D + o_d[None, :]
            tl.store(p_wo, b_o.to(p_wo.dtype.element_ty), mask=m_row[:, None])
            tl.store(WL + w_row + i_s, b_lse, mask=m_row)
            if FUSED_MERGE:
                # the last of the tile's chunks to finish merges them (its loads after the
                # count's acquire see every chunk's partial stores)
                p_cnt = CNT + i_bh * tl.num_programs(0) + i_t
                done = arrive(p_cnt, FENCE)
                if done == used - 1:
                    _merge_tile(
                        _partials(WO, O, PARTIAL_HALF), WL, O, L, w_row, o_q, o_h, m_row, used,
                        s_ob, s_on, s_oh, s_od, s_lb, s_ln, s_lh, i_b, BLOCK_M, D, WRITE_LSE,
                    )  # fmt: skip
                    tl.atomic_xchg(p_cnt, 0, sem="relaxed", scope="gpu")  # ready for the next call


@triton.jit(do_not_specialize=["N", "H_Q"])
def _merge_splits(
    WO,
    WL,
    SEQ,
    NN,
    QS,
    QL,
    O,
    L,
    N,
    H_Q,
    s_ob,
    s_on,
    s_oh,
    s_od,
    s_lb,
    s_ln,
    s_lh,
    NUM_SPLITS: tl.constexpr,
    SPLIT_MIN_LEN: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    S_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    D: tl.constexpr,
    HAS_QS: tl.constexpr,
    HAS_QL: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    PDL: tl.constexpr = False,
    PARTIAL_HALF: tl.constexpr = False,
):
    """out[b, row, heads] = Σ_s w_s o_s / Σ_s w_s, w_s = exp(lse_s - max lse) over the request's
    used chunks; inactive rows 0. Requests the forward kernel did not split are left as written."""
    pdl_enter(PDL)
    i_bn = tl.program_id(0).to(tl.int64)
    i_b = i_bn // N
    row = i_bn % N
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H).to(tl.int64)  # [BLOCK_H]
    o_s = tl.arange(0, S_PAD)
    o_d = tl.arange(0, D).to(tl.int64)
    nn = tl.minimum(tl.load(NN + i_b), N)
    used = _splits_used(tl.load(SEQ + i_b) + nn, NUM_SPLITS, SPLIT_MIN_LEN, SPLIT_CHUNK)
    if HAS_QS:
        qs = tl.load(QS + i_b)
    else:
        qs = 0
    if HAS_QL:
        ql = tl.load(QL + i_b)
    else:
        ql = N
    active = (row >= qs) & (row < qs + ql) & (row < nn)
    qs = tl.maximum(qs, 0)  # relative row = row - max(qs, 0), as the forward kernel writes it
    m_h = o_h < H_Q
    m_hs = (m_h[:, None] & (o_s[None, :] < used)) & (active & (used > 1))  # [BLOCK_H, S_PAD]
    w_row = ((i_b * N + (row - qs)) * H_Q + o_h[:, None]) * NUM_SPLITS + o_s[None, :]
    b_lse = tl.load(WL + w_row, mask=m_hs, other=float("-inf"))  # [BLOCK_H, S_PAD]
    b_max = tl.max(b_lse, 1)
    b_max = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_w = tl.exp(b_lse - b_max[:, None])
    b_tot = tl.sum(b_w, 1)  # [BLOCK_H]
    b_part = tl.load(
        _partials(WO, O, PARTIAL_HALF) + w_row[:, :, None] * D + o_d[None, None, :],
        mask=m_hs[:, :, None],
        other=0.0,
    ).to(tl.float32)  # [BLOCK_H, S_PAD, D]
    b_o = tl.sum(b_w[:, :, None] * b_part, 1) / tl.where(b_tot > 0.0, b_tot, 1.0)[:, None]
    m_out = m_h & (used > 1)
    p_o = O + i_b * s_ob + row * s_on + o_h[:, None] * s_oh + o_d[None, :] * s_od
    tl.store(p_o, b_o.to(O.dtype.element_ty), mask=m_out[:, None])
    if WRITE_LSE:
        b_out = tl.where(
            b_tot > 0.0, b_max + tl.log(tl.where(b_tot > 0.0, b_tot, 1.0)), float("-inf")
        )
        tl.store(L + i_b * s_lb + row * s_ln + o_h * s_lh, b_out, mask=m_out)


@dataclass(frozen=True)
class _Plan:
    """What a launch of given shapes, device and optional arguments needs besides the tensors."""

    cfg: AttnConfig
    need: int  # workspace elements (0: no split)
    wo_numel: int  # the partial outputs' share of the workspace
    grid: tuple[int, int, int]
    consts: dict  # the forward kernel's constexprs and launch options
    gluon_consts: dict | None  # tree_attention_gluon's, where the configuration takes it
    merge_grid: tuple[int, int]
    merge_consts: dict


_PLANS: dict[tuple, _Plan] = {}
_MAX_PLANS = 256


def _plan(q, k_cache, block_table, has_qs, has_ql, has_lse, num_splits, override) -> _Plan:
    B, N, H_q, D = q.shape
    page_size, H_kv = k_cache.shape[1], k_cache.shape[2]
    cfg = config_for(q, k_cache, block_table, num_splits, override)
    S = cfg.num_splits
    s_pad = triton.next_power_of_2(S)
    block_h = min(triton.next_power_of_2(H_q), max(1, 4096 // (s_pad * D)))
    # plain launches unless TREEOPS_PDL asks for PDL (then the merge follows the forward, which
    # releases it after its key loops). On an H100 in session 48 (docs/benchmarks.md) both
    # launches with PDL made chains of attention calls 3-6 % faster at small split shapes (B 1
    # ctx 1,024 n 64 on cold caches 14.65 -> 13.82 us), but the merge alone with PDL made whole
    # decoding steps no faster (chain B 16 1,499 -> 1,509 us), so it is not the default
    pdl = use_pdl(q.device)
    return _Plan(
        cfg=cfg,
        need=workspace_numel(B, N, H_q, D, cfg),
        wo_numel=B * N * H_q * S * D,
        grid=(triton.cdiv(N, cfg.block_q), B * H_kv, S),
        consts=dict(
            G=H_q // H_kv,
            G_PAD=cfg.g_pad,
            BLOCK_Q=cfg.block_q,
            BLOCK_N=cfg.block_n,
            D=D,
            PAGE_SIZE=page_size,
            NUM_SPLITS=S, SPLIT_MIN_LEN=cfg.split_min_len, SPLIT_CHUNK=cfg.split_chunk,
            HAS_QS=has_qs, HAS_QL=has_ql, WRITE_LSE=has_lse,
            UPCAST=interpreted() or q.dtype == torch.float32,
            PREFETCH=cfg.prefetch,
            PIPE=cfg.pipe,
            WARP_SPEC=cfg.warp_spec,
            FUSED_MERGE=cfg.fused_merge,
            FENCE=cfg.fused_merge and not interpreted(),
            PDL=pdl, launch_pdl=first_launch_pdl(pdl),  # the op's first launch (_pdl)
            PARTIAL_HALF=cfg.partial_half,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        ),
        gluon_consts=dict(
            G=H_q // H_kv, G_PAD=cfg.g_pad, BLOCK_Q=cfg.block_q, BLOCK_N=cfg.block_n, D=D,
            PAGE_SIZE=page_size, NUM_SPLITS=S, SPLIT_MIN_LEN=cfg.split_min_len,
            SPLIT_CHUNK=cfg.split_chunk, HAS_QS=has_qs, HAS_QL=has_ql, WRITE_LSE=has_lse,
            LA=cfg.pipe, P_IN_SMEM=cfg.p_smem, num_warps=cfg.num_warps,
            PDL=pdl, launch_pdl=first_launch_pdl(pdl),
        ) if cfg.gluon else None,
        merge_grid=(B * N, triton.cdiv(H_q, block_h)),
        merge_consts=dict(
            NUM_SPLITS=S, SPLIT_MIN_LEN=cfg.split_min_len, SPLIT_CHUNK=cfg.split_chunk,
            S_PAD=s_pad,
            BLOCK_H=block_h,
            D=D,
            HAS_QS=has_qs, HAS_QL=has_ql, WRITE_LSE=has_lse,
            PDL=pdl, launch_pdl=pdl > 0,
            PARTIAL_HALF=cfg.partial_half,
            num_warps=4,
        ),
    )  # fmt: skip


def tree_attention_fwd(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_nodes: torch.Tensor,
    anc: torch.Tensor,
    q_start: torch.Tensor | None,
    q_len: torch.Tensor | None,
    sm_scale: float,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    workspace: torch.Tensor | None = None,
    num_splits: int | None = None,
    override: dict | None = None,
) -> None:
    """Launch (no checks): writes ``out`` [B, N, H_q, D] and, if given, ``lse`` [B, N, H_q].

    The launch plan (tiles, splits, grids) depends on shapes, dtype, device and which optional
    tensors are given only; it is computed once per such key (``override`` calls: every time)."""
    has_qs, has_ql, has_lse = q_start is not None, q_len is not None, lse is not None
    if override is None:
        key = (
            q.shape, q.dtype, q.device, k_cache.shape[1], k_cache.shape[2], block_table.shape[1],
            has_qs, has_ql, has_lse, num_splits,
        )  # fmt: skip
        plan = _PLANS.get(key)
        if plan is None:
            plan = _plan(q, k_cache, block_table, has_qs, has_ql, has_lse, num_splits, None)
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan
    else:
        plan = _plan(q, k_cache, block_table, has_qs, has_ql, has_lse, num_splits, override)
    need, split = plan.need, plan.cfg.num_splits > 1
    if split:  # partial outputs, then partial LSEs
        if workspace is None or workspace.numel() < need:
            workspace = torch.empty(need, dtype=torch.float32, device=q.device)
        wo = workspace[: plan.wo_numel]
        wl = workspace[plan.wo_numel : need]
    else:
        wo = wl = out  # never touched
    # one slot per (request, KV head, query tile) of a fused merge; else never touched
    cnt = arrival_counters(q.device, plan.grid[0] * plan.grid[1]) if plan.cfg.fused_merge else wo
    lse_t = lse if has_lse else out
    lse_strides = lse.stride() if has_lse else (0, 0, 0)
    qs = q_start if has_qs else seq_lens
    ql = q_len if has_ql else seq_lens
    if plan.gluon_consts is not None and _gluon.launchable(q, k_cache, v_cache, out):
        direct(_gluon._tree_attn_fwd_gluon).launch(
            plan.grid,
            q, k_cache, v_cache, block_table, seq_lens, num_nodes, anc, qs, ql, out, lse_t, wo,
            wl, sm_scale * _LOG2E, q.shape[1], k_cache.shape[2], *q.stride()[:3],
            *k_cache.stride()[:3], *v_cache.stride()[:3], block_table.stride(0), anc.stride(0),
            anc.stride(1), *out.stride()[:3], *lse_strides, **plan.gluon_consts,
        )  # fmt: skip
    else:
        direct(_tree_attn_fwd).launch(
            plan.grid,
            q, k_cache, v_cache, block_table, seq_lens, num_nodes, anc, qs, ql, out, lse_t, wo,
            wl, cnt, sm_scale * _LOG2E, q.shape[1], k_cache.shape[2], *q.stride(),
            *k_cache.stride(), *v_cache.stride(), block_table.stride(0), anc.stride(0),
            anc.stride(1), *out.stride(), *lse_strides, **plan.consts,
        )  # fmt: skip
    if split and not plan.cfg.fused_merge:
        direct(_merge_splits).launch(
            plan.merge_grid,
            wo, wl, seq_lens, num_nodes, qs, ql, out, lse_t, q.shape[1], q.shape[2], *out.stride(),
            *lse_strides, **plan.merge_consts,
        )  # fmt: skip


def default_scale(d: int) -> float:
    return 1.0 / math.sqrt(d)
