"""CAST's standalone rules (docs/design.md op 5): Triton kernels and their launchers.

The CUDA backends of ``treeops::cast_select``, ``cast_width``, ``cast_depth`` and
``cast_rerank``: one launch of one program each, no host sync, tiles from shapes only, so each
can be captured in a CUDA graph. They follow ``treeops.reference.cast`` rule for rule:

``cast_select`` — Algorithm 1: the largest ``k`` in ``[1, K]`` maximising ``u_k - C * c_k``,
  streamed over ``K`` in tiles (a running best and its largest ``k``).

``cast_width`` / ``cast_rerank`` — one program walks the batch ``BB`` rows at a time. Each row's
  scores are clamped at 0 (a negative score is "no candidate" and counts as 0) and ranked by their
  float bits (an order-preserving int32 key for values >= 0); the rerank puts the root first (a
  key above every score's, value 1). A running top-``KP`` per row is merged with each column tile
  by ``tl.topk`` (bitonic), then its cumulative sums are the row's utilities ``1..KP`` and the
  active rows' sums are added into ``U``. The cap of ``k`` (``cast_available``) is the most
  candidates (scores >= 0) of an active row, + 1 for the root, at least 1. Algorithm 1 then runs
  on ``U`` with the threshold scaled by the number of active rows (``C * n_act``, at least 1), so
  no division rounds before the comparison — the reference's form.

``cast_depth`` — the FIFO ``[1, phi_0, .., phi_{i-1}]``, ``phi_j = u^(j+1) / u^(j)`` (0 where
  ``u^(j) = 0``): only its last ``min(R, i + 1)`` entries are loaded, ``alpha`` is their mean
  and the flag is ``alpha * u^(i) / c >= C2``.

Precision: the kernels compute in float32 (16-bit and float64 inputs are converted after each
load), the reference in float64. Both agree exactly when the values, their sums and the scaled
thresholds are exact in float32 (dyadic values with few bits: the tests' choice), and can
otherwise differ only at near-ties of ``u_k - C c_k`` (or of ``alpha u / c`` with ``C2``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from treeops._runtime import interpreted, pow2

from ._launch import direct
from ._pdl import pdl_enter, pdl_options

__all__ = [
    "MAX_TILE",
    "cast_depth_launch",
    "cast_rerank_launch",
    "cast_select_launch",
    "cast_tiling",
    "cast_width_launch",
]

MAX_TILE = 2048
"""The widest per-row top-k tile (``pow2(min(K, M + root))``) the width/rerank kernel holds in
registers; ``treeops.cast`` runs the reference above it (no such table in practice: K is a cost
table's ``n_max``)."""


@triton.jit(do_not_specialize=["K", "C"])
def _cast_select_kernel(
    p_u, p_c, p_out, K, stride_u, stride_c, C, BK: tl.constexpr, PDL: tl.constexpr = 0
):
    pdl_enter(PDL)
    o = tl.arange(0, BK)
    best = tl.sum(tl.zeros([BK], tl.float32), axis=0) - float("inf")  # fp32 scalars
    arg = tl.sum(tl.zeros([BK], tl.int32), axis=0)
    for k0 in range(0, K, BK):
        o_k = k0 + o
        m = o_k < K
        b_u = tl.load(p_u + o_k.to(tl.int64) * stride_u, mask=m, other=0.0).to(tl.float32)
        b_c = tl.load(p_c + o_k.to(tl.int64) * stride_c, mask=m, other=0.0).to(tl.float32)
        b_obj = tl.where(m, b_u - C * b_c, -float("inf"))
        t_max = tl.max(b_obj, axis=0)
        t_arg = tl.max(tl.where(m & (b_obj == t_max), o_k + 1, 0), axis=0)
        take = t_max >= best  # later tiles hold larger k: ties go to them
        arg = tl.where(take, t_arg, arg)
        best = tl.where(take, t_max, best)
    tl.store(p_out, arg)


@triton.jit(do_not_specialize=["B", "M", "K", "C", "L", "MC"])
def _cast_utility_kernel(
    p_s,  # [B, M] scores (any float dtype, any strides)
    p_c,  # [K] costs
    p_act,  # [B] uint8 active flags (HAS_ACT)
    p_out,  # [] int32 the chosen k
    p_seq,  # TABLE: [B] context lengths (int32/int64)
    p_unit,  # TABLE: [MC] each row's divisor
    B,
    M,
    K,
    stride_sb,
    stride_sm,
    stride_c,
    stride_a,
    C,  # threshold (fp32)
    stride_q,  # TABLE: seq_lens' stride
    stride_cm,  # TABLE: costs' row stride
    stride_un,  # TABLE: unit's stride
    L,  # TABLE: context tokens per row
    MC,  # TABLE: rows
    ROOT: tl.constexpr,  # rerank: the root (score 1) is every row's first node
    HAS_ACT: tl.constexpr,
    TABLE: tl.constexpr,  # costs [MC, K] per context: the row of the longest active context
    SRC64: tl.constexpr,  # float64 scores: "is a candidate" is decided before rounding
    BB: tl.constexpr,  # rows per tile
    KP: tl.constexpr,  # utilities held: pow2(min(K, M + ROOT)), at least 2
    CW: tl.constexpr,  # columns per tile (>= KP)
    PDL: tl.constexpr = 0,
):
    pdl_enter(PDL)
    o_r = tl.arange(0, BB)
    o_k = tl.arange(0, KP)
    o_w = tl.arange(0, CW)
    b_U = tl.zeros([KP], tl.float32)  # sum over active rows of their k best, at k - 1
    ctx = tl.sum(tl.zeros([BB], tl.int64), axis=0)  # TABLE: the longest active context
    n_act = tl.sum(tl.zeros([BB], tl.int32), axis=0)
    have = tl.sum(tl.zeros([BB], tl.int32), axis=0)  # most candidates of an active row
    for b0 in range(0, B, BB):
        o_b = b0 + o_r
        m_b = o_b < B
        if HAS_ACT:
            act = m_b & (tl.load(p_act + o_b.to(tl.int64) * stride_a, mask=m_b, other=0) != 0)
        else:
            act = m_b
        if TABLE:
            q = tl.load(p_seq + o_b.to(tl.int64) * stride_q, mask=act, other=0).to(tl.int64)
            ctx = tl.maximum(ctx, tl.max(q, axis=0))
        p_row = p_s + o_b.to(tl.int64)[:, None] * stride_sb
        b_run = tl.zeros([BB, KP], tl.int32)  # running top-KP keys, descending
        cnt = tl.zeros([BB], tl.int32)
        for v0 in range(0, M + ROOT, CW):
            o_v = v0 + o_w  # column of the row with the root in front (ROOT)
            o_m = o_v - ROOT  # column of scores
            m = act[:, None] & ((o_m >= 0) & (o_m < M))[None, :]
            x = tl.load(p_row + o_m.to(tl.int64)[None, :] * stride_sm, mask=m, other=-1.0)
            xf = x.to(tl.float32)
            if SRC64:
                ok = m & (x >= 0)
            else:
                ok = m & (xf >= 0)
            cnt += tl.sum(ok.to(tl.int32), axis=1)
            # values >= 0 (-0.0 and "none" as +0.0) rank by their bits; the root above them all
            key = tl.where(xf > 0, xf, 0.0).to(tl.int32, bitcast=True)
            if ROOT:
                key = tl.where(act[:, None] & (o_v == 0)[None, :], 0x7FFFFFFF, key)
            top = tl.topk(key, KP)  # [BB, KP] descending
            if v0 == 0:
                b_run = top
            else:
                both = tl.reshape(tl.join(b_run, top), [BB, 2 * KP])
                b_run = tl.topk(both, KP)
        val = tl.where(b_run == 0x7FFFFFFF, 1.0, b_run.to(tl.float32, bitcast=True))
        cum = tl.cumsum(val, axis=1)  # [BB, KP]: the row's k best, at k - 1
        b_U += tl.sum(tl.where(act[:, None], cum, 0.0), axis=0)
        n_act += tl.sum(act.to(tl.int32), axis=0)
        have = tl.maximum(have, tl.max(tl.where(act, cnt, 0), axis=0))
    cap = tl.maximum(have + ROOT, 1)
    thr = C * tl.maximum(n_act, 1).to(tl.float32)
    m_k = (o_k < K) & (o_k < cap)
    if TABLE:  # the row of the batch's context, divided by its unit
        r = tl.minimum(tl.maximum(ctx, 0) // L, MC - 1)
        p_c = p_c + r * stride_cm
        unit = tl.load(p_unit + r * stride_un).to(tl.float32)
        b_c = tl.load(p_c + o_k.to(tl.int64) * stride_c, mask=m_k, other=0.0).to(tl.float32)
        b_c = b_c / unit
    else:
        b_c = tl.load(p_c + o_k.to(tl.int64) * stride_c, mask=m_k, other=0.0).to(tl.float32)
    b_obj = tl.where(m_k, b_U - thr * b_c, -float("inf"))
    n = tl.max(tl.where(m_k & (b_obj == tl.max(b_obj, axis=0)), o_k + 1, 0), axis=0)
    tl.store(p_out, n)


@triton.jit(do_not_specialize=["n", "R", "C2", "B", "L", "MC"])
def _cast_depth_kernel(
    p_u, p_c, p_out, n, R, stride_u, C2,
    p_seq, p_unit, p_w, B, stride_q, stride_cm, stride_c, stride_un, L, MC,
    RP: tl.constexpr, TABLE: tl.constexpr, BQ: tl.constexpr,
    PDL: tl.constexpr = 0,
):  # fmt: skip
    pdl_enter(PDL)
    cnt = tl.minimum(R, n)  # FIFO entries that count: the last min(R, i + 1)
    o = tl.arange(0, RP)
    i = (n - cnt + o).to(tl.int64)  # FIFO entry i: 1 for i = 0, else u[i] / u[i - 1]
    m = (o < cnt) & (i >= 1)
    b_u = tl.load(p_u + i * stride_u, mask=m, other=0.0).to(tl.float32)
    b_p = tl.load(p_u + (i - 1) * stride_u, mask=m, other=0.0).to(tl.float32)
    phi = tl.where(b_p > 0, b_u / tl.where(b_p > 0, b_p, 1.0), 0.0)
    e = tl.where(o < cnt, tl.where(i == 0, 1.0, phi), 0.0)
    alpha = tl.sum(e, axis=0) / cnt.to(tl.float32)
    u_i = tl.load(p_u + (n - 1).to(tl.int64) * stride_u).to(tl.float32)
    if TABLE:  # entry width - 1 of the row of the longest context, divided by its unit
        o_q = tl.arange(0, BQ)
        ctx = tl.sum(tl.zeros([BQ], tl.int64), axis=0)
        for b0 in range(0, B, BQ):
            q = tl.load(p_seq + (b0 + o_q).to(tl.int64) * stride_q, mask=b0 + o_q < B, other=0)
            ctx = tl.maximum(ctx, tl.max(q.to(tl.int64), axis=0))
        r = tl.minimum(tl.maximum(ctx, 0) // L, MC - 1)
        w = tl.load(p_w).to(tl.int64) - 1
        c = tl.load(p_c + r * stride_cm + w * stride_c).to(tl.float32)
        c = c / tl.load(p_unit + r * stride_un).to(tl.float32)
    else:
        c = tl.load(p_c).to(tl.float32)
    tl.store(p_out, (alpha * u_i / c) >= C2)


# --------------------------------------------------------------------------------- launchers
@functools.lru_cache(maxsize=1024)  # a pure function of shapes, asked on every launch
def cast_tiling(B: int, M: int, K: int, root: bool) -> tuple[int, int, int, int]:
    """(BB, KP, CW, num_warps) of the width/rerank launch over scores [B, M] and K costs, from
    shapes only: ``KP`` the utilities held (past ``M + root`` they are flat and the cap stops
    there), ``CW`` the columns per tile, ``BB`` the rows per tile. The interpreter gets small
    tiles, so that the tests run the column merges and several row tiles."""
    KP = max(2, pow2(min(K, M + int(root))))  # tl.topk needs k >= 2
    cw_max, elems = (8, 64) if interpreted() else (256, 1024)
    CW = max(KP, min(pow2(M + int(root)), cw_max))
    BB = max(1, min(pow2(B), elems // CW))
    warps = 1 if interpreted() else (4 if BB * CW <= 512 else 8)
    return BB, KP, CW, warps


def cast_select_launch(u: torch.Tensor, c: torch.Tensor, C: float, out: torch.Tensor) -> None:
    """Algorithm 1 on ``u`` [K] and ``c`` [K] (float32 or float64, any stride) with threshold
    ``C``: writes the largest maximising ``k`` into ``out`` (0-d int32)."""
    K = u.shape[0]
    BK = min(pow2(K), 8 if interpreted() else 1024)  # the interpreter runs several tiles
    direct(_cast_select_kernel).launch(
        (1,),
        u, c, out, K, u.stride(0), c.stride(0), float(C), BK=BK,
        **pdl_options(u.device), num_warps=1 if interpreted() else 4,
    )  # fmt: skip


def _utility_launch(scores, costs, C, active, out, root: bool, seq_lens=None, context_len=0,
                    unit=None) -> None:  # fmt: skip
    B, M = scores.shape
    K = costs.shape[-1]
    BB, KP, CW, warps = cast_tiling(B, M, K, root)
    act = active.view(torch.uint8) if active is not None else out
    table = costs.dim() == 2
    if table and unit is None:
        unit = costs[:, 0]
    direct(_cast_utility_kernel).launch(
        (1,),
        scores,
        costs,
        act,
        out,
        seq_lens if table else out,
        unit if table else out,
        B,
        M,
        K,
        scores.stride(0),
        scores.stride(1),
        costs.stride(-1),
        active.stride(0) if active is not None else 0,
        float(C),
        seq_lens.stride(0) if table else 0,
        costs.stride(0) if table else 0,
        unit.stride(0) if table else 0,
        int(context_len) if table else 1,
        costs.shape[0] if table else 1,
        ROOT=int(root),
        HAS_ACT=active is not None,
        TABLE=table,
        SRC64=scores.dtype == torch.float64,
        BB=BB,
        KP=KP,
        CW=CW,
        **pdl_options(scores.device),
        num_warps=warps,
    )


def cast_width_launch(
    scores: torch.Tensor,
    costs: torch.Tensor,
    C1: float,
    active: torch.Tensor | None,
    out: torch.Tensor,
    seq_lens: torch.Tensor | None = None,
    context_len: int = 0,
    unit: torch.Tensor | None = None,
) -> None:
    """CAST's width: ``scores`` [B, M] (float32/64, bfloat16 or float16; < 0 = no candidate),
    ``costs`` [K] (float32/64) or [MC, K] per context (with ``seq_lens`` [B], ``context_len``
    and ``unit`` [MC] or None: ``reference.cast.cast_context_costs``), threshold ``C1``,
    ``active`` [B] bool or None (all); writes the width into ``out`` (0-d int32). Needs
    ``pow2(min(K, M)) <= MAX_TILE``."""
    _utility_launch(scores, costs, C1, active, out, False, seq_lens, context_len, unit)


def cast_rerank_launch(
    scores: torch.Tensor,
    costs: torch.Tensor,
    C3: float,
    active: torch.Tensor | None,
    out: torch.Tensor,
    seq_lens: torch.Tensor | None = None,
    context_len: int = 0,
    unit: torch.Tensor | None = None,
) -> None:
    """CAST's verification count (root included): as ``cast_width_launch`` with the root's score
    1 first in every active row and the cap + 1. Needs ``pow2(min(K, M + 1)) <= MAX_TILE``."""
    _utility_launch(scores, costs, C3, active, out, True, seq_lens, context_len, unit)


def cast_depth_launch(
    u_hist: torch.Tensor,
    c: torch.Tensor,
    C2: float,
    R: int,
    out: torch.Tensor,
    seq_lens: torch.Tensor | None = None,
    context_len: int = 0,
    unit: torch.Tensor | None = None,
    width: torch.Tensor | None = None,
) -> None:
    """CAST's depth flag: ``u_hist`` [i + 1] (float32/64, any stride), ``c`` 0-d or [MC, K] per
    context (with ``seq_lens``, ``context_len``, ``unit`` as ``cast_width_launch`` and
    ``width`` 0-d int: the entry ``width - 1`` of the batch's row), threshold ``C2``, FIFO
    length ``R`` >= 1; writes ``alpha * u^(i) / c >= C2`` into ``out`` (0-d bool)."""
    n = u_hist.shape[0]
    table = c.dim() == 2
    if table and unit is None:
        unit = c[:, 0]
    B = seq_lens.shape[0] if table else 1
    direct(_cast_depth_kernel).launch(
        (1,),
        u_hist, c, out, n, int(R), u_hist.stride(0), float(C2),
        seq_lens if table else out, unit if table else out, width if table else out, B,
        seq_lens.stride(0) if table else 0, c.stride(0) if table else 0,
        c.stride(1) if table else 0, unit.stride(0) if table else 0,
        int(context_len) if table else 1, c.shape[0] if table else 1,
        RP=pow2(min(int(R), n)), TABLE=table, BQ=min(pow2(B), 8 if interpreted() else 1024),
        **pdl_options(u_hist.device), num_warps=1,
    )  # fmt: skip
