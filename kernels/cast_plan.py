"""λ-CAST's per-step statistics (``treeops.cast_step_stats``) on the GPU: two launches instead
of the ~50 small PyTorch kernels of the reference path (``treeops.cast_plan``), inside every
λ-CAST step's CUDA graph.

``_stats_rows_kernel`` — one program per request: its candidates' calibrated probabilities
  (``rates[score_bin(s)]``, 0 for ``s < 0``), each drafted layer's sorted and summed (its
  ``W`` best, flat past its candidates), all of them sorted and summed into the verify curve
  (``1 +`` the ``k - 1`` best, flat past them), and the per-bin counts of its verified non-root
  nodes and of those on its accepted path; all zero for an inactive request. Written to a
  ``[B, S]`` float32 workspace.

  With Graft, two more columns: its grafted nodes (the tree's last ``grafted[b]``) and those on
  its accepted path; grafted nodes (score 0, no draft score) stay out of the per-bin counts.

``_stats_reduce_kernel`` — the batch sum of the workspace per column, in request order (so the
  result does not depend on scheduling), divided by the active requests (at least 1) for the
  curves; the counts as they are; the number of active requests after the bin counts (then the
  two graft counts).

Precision: float32 as the reference; the sums run in another order (sort-and-cumsum per request,
then requests in order), so results agree to float32 rounding. The score bin is
``floor(-2 log2 s)`` clamped to ``[0, SCORE_BINS - 1]`` as in ``treeops.cast_plan.score_bin``;
a score within an ulp of a half-octave boundary may fall in either bin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeops._runtime import pow2

from ._launch import direct
from ._pdl import pdl_enter, pdl_options

__all__ = ["step_stats_launch"]


@triton.jit
def _bin(s, NB: tl.constexpr):
    x = tl.floor(-2.0 * tl.log2(tl.maximum(s, 1e-30)))
    return tl.minimum(tl.maximum(x, 0.0), NB - 1).to(tl.int32)


@triton.jit(do_not_specialize=["n_acc", "d"])
def _stats_rows_kernel(
    p_cs,  # [B, d, C] f32 candidate path scores (< 0: none), contiguous
    p_ts,  # [B, n] tree scores
    p_td,  # [B, n] tree depths (int32)
    p_tn,  # [B] tree num_nodes (int32)
    p_acc,  # [B, n_acc] accepted path's nodes (int32)
    p_alen,  # [B] accepted path lengths (int32)
    p_act,  # [B] active (uint8)
    p_rates,  # [NB] f32 calibrated acceptance per score bin
    p_part,  # [B, S] f32 workspace
    p_graft,  # [B] grafted nodes per request (int32; HAS_GRAFT)
    n_acc,
    s_ts,
    s_td,
    s_acc,
    d,  # drafted layers: a runtime int, not a variant per depth
    C: tl.constexpr,  # candidates per layer
    DP: tl.constexpr,  # pow2(d)
    CP: tl.constexpr,  # pow2(max(C, W))
    D: tl.constexpr,  # the planner's maxima: layers, width, verify capacity
    W: tl.constexpr,
    N: tl.constexpr,
    F: tl.constexpr,  # DP * CP: the flattened candidates
    n: tl.constexpr,  # tree capacity
    NP: tl.constexpr,  # pow2(n)
    NB: tl.constexpr,  # score bins
    NBP: tl.constexpr,  # pow2(NB)
    S: tl.constexpr,  # workspace row: D * W + N + 2 * NB (+ 2 with HAS_GRAFT)
    ZP: tl.constexpr,  # pow2(D * W) >= the undrafted layers' columns, (D - d) * W
    HAS_GRAFT: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    act = tl.load(p_act + b) != 0
    # ---- calibrated probabilities [DP, CP]
    o_i = tl.arange(0, DP)
    o_c = tl.arange(0, CP)
    m = (o_i < d)[:, None] & (o_c < C)[None, :] & act
    s = tl.load(p_cs + b * (d * C) + o_i[:, None] * C + o_c[None, :], mask=m, other=-1.0)
    cal = tl.where(s >= 0, tl.load(p_rates + _bin(s, NB), mask=s >= 0, other=0.0), 0.0)
    # ---- per layer: its W best, summed (zeros sort last: flat past its candidates)
    cum = tl.cumsum(tl.sort(cal, descending=True), 1)  # [DP, CP]
    row = p_part + b * S
    tl.store(row + o_i[:, None] * W + o_c[None, :], cum, mask=(o_i < d)[:, None] & (o_c < W))
    if d < D:  # the layers not drafted: zero (the workspace is not cleared beforehand)
        o_z = tl.arange(0, ZP)
        tl.store(row + d * W + o_z, tl.zeros([ZP], tl.float32), mask=o_z < (D - d) * W)
    # ---- the verify curve: 1, then 1 + the k best of all (flat past them)
    flat = tl.cumsum(tl.sort(tl.reshape(cal, [F]), descending=True), 0)  # [F]
    o_f = tl.arange(0, F)
    v = row + D * W
    tl.store(v, tl.where(act, 1.0, 0.0))
    tl.store(v + 1 + o_f, tl.where(act, 1.0 + flat, 0.0), mask=1 + o_f < N)
    if 1 + F < N:  # more slots than candidates: the curve stays at its total
        total = tl.where(act, 1.0 + tl.sum(cal), 0.0)
        for k0 in tl.static_range(1 + F, N, F):
            o_k = k0 + o_f
            tl.store(v + o_k, tl.zeros([F], tl.float32) + total, mask=o_k < N)
    # ---- verified non-root nodes per score bin, and those on the accepted path
    o_j = tl.arange(0, NP)
    num = tl.load(p_tn + b)
    dep = tl.load(p_td + b * s_td + o_j, mask=o_j < n, other=0)
    ok = (o_j < num) & (o_j < n) & (dep >= 1) & act
    ts = tl.load(p_ts + b * s_ts + o_j, mask=o_j < n, other=0.0).to(tl.float32)
    bins = _bin(ts, NB)
    # on the accepted path: its alen (<= depth + 1) nodes, one scalar load each
    alen = tl.minimum(tl.load(p_alen + b), n_acc)
    on = o_j < 0
    for p in range(0, alen):
        on = on | (o_j == tl.load(p_acc + b * s_acc + p))
    o_k = tl.arange(0, NBP)
    if HAS_GRAFT:
        # the tree's last g nodes came from the successor table: no draft score, so no part of
        # the draft scores' calibration (counted apart)
        g = tl.where(act, tl.load(p_graft + b), 0)
        m_g = (o_j >= num - g) & (o_j < num)
        g_hits = tl.sum((on & m_g).to(tl.float32), 0)
        tl.store(v + N + 2 * NB, g.to(tl.float32))
        tl.store(v + N + 2 * NB + 1, tl.where(act, g_hits, 0.0))
        ok = ok & ~m_g
    is_bin = bins[:, None] == o_k[None, :]  # [NP, NBP]
    seen = tl.sum((is_bin & ok[:, None]).to(tl.float32), 0)
    hits = tl.sum((is_bin & (ok & on)[:, None]).to(tl.float32), 0)
    tl.store(v + N + o_k, seen, mask=o_k < NB)
    tl.store(v + N + NB + o_k, hits, mask=o_k < NB)


@triton.jit(do_not_specialize=["B"])
def _stats_reduce_kernel(
    p_part,  # [B, S] f32
    p_act,  # [B] uint8
    p_out,  # [S + 1] f32
    B,
    CURVES: tl.constexpr,  # the first D * W + N columns: means over the active requests
    SB: tl.constexpr,  # D * W + N + 2 * NB: the active count's slot; columns from it move one on
    S: tl.constexpr,
    BP: tl.constexpr,  # pow2 tile over the batch for the active count
    BS: tl.constexpr,  # columns per program
    PDL: tl.constexpr = 0,
):
    pdl_enter(PDL)
    o = tl.program_id(0) * BS + tl.arange(0, BS)
    m = o < S
    n_act = tl.sum(tl.zeros([BP], tl.int32), 0)
    for b0 in range(0, B, BP):
        o_b = b0 + tl.arange(0, BP)
        n_act += tl.sum((tl.load(p_act + o_b, mask=o_b < B, other=0) != 0).to(tl.int32), 0)
    acc = tl.zeros([BS], tl.float32)
    for b in range(0, B):
        acc += tl.load(p_part + b * S + o, mask=m, other=0.0)
    div = tl.maximum(n_act, 1).to(tl.float32)
    tl.store(p_out + tl.where(o < SB, o, o + 1), tl.where(o < CURVES, acc / div, acc), mask=m)
    if tl.program_id(0) == 0:
        tl.store(p_out + SB, n_act.to(tl.float32))


def step_stats_launch(
    cand_scores, tree, accepted, accept_len, active, rates, out, *, max_depth: int,
    max_width: int, capacity: int, bins: int, grafted: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Write ``treeops.cast_step_stats``'s output into ``out`` ([D * W + N + 2 * bins + 1]
    float32, 2 more with ``grafted``) with two launches; inputs as there (checked by the
    caller), ``cand_scores`` contiguous float32, ``active`` bool. No host sync: capturable."""
    B, d, C = cand_scores.shape
    D, W, N = max_depth, max_width, capacity
    n = tree.capacity
    SB = D * W + N + 2 * bins
    S = SB + (2 if grafted is not None else 0)
    part = torch.empty(B, S, dtype=torch.float32, device=out.device)  # every entry written
    DP, CP = pow2(d), max(2, pow2(max(C, W)))
    act = active.view(torch.uint8)
    # rows may be strided (a verify tree's column slice), elements must be adjacent
    ts, td = (x if x.stride(1) == 1 else x.contiguous() for x in (tree.scores, tree.depth))
    accepted = accepted if accepted.stride(1) == 1 else accepted.contiguous()
    direct(_stats_rows_kernel).launch(
        (B,), cand_scores, ts, td, tree.num_nodes, accepted, accept_len, act, rates, part,
        act if grafted is None else grafted, accepted.shape[1], ts.stride(0), td.stride(0),
        accepted.stride(0), d=d, C=C, DP=DP, CP=CP, D=D, W=W, N=N, F=DP * CP, n=n,
        NP=max(2, pow2(n)), NB=bins, NBP=pow2(bins), S=S, ZP=max(2, pow2(D * W)),
        HAS_GRAFT=grafted is not None, **pdl_options(out.device),
    )  # fmt: skip
    BS = 256
    direct(_stats_reduce_kernel).launch(
        (triton.cdiv(S, BS),), part, act, out, B,
        CURVES=D * W + N, SB=SB, S=S, BP=min(pow2(B), 1024), BS=BS, **pdl_options(out.device),
    )  # fmt: skip
