"""A draft step's start (``treeops.DraftState.reset``) in one launch.

The state's reset is nine small writes (the inputs copied in, the frontier set to the root, the
decisions and CAST's utilities zeroed); as separate torch ops each is a launch and ~5 µs of
host time, and in a captured decoding step each is a kernel node. ``_reset_kernel`` does them in
one program per request (program 0 also zeroes the batch-level ``decisions`` and ``u_hist``).
Every input is read before anything is written, so an input that is the state's own buffer
(``reset(state.root_tokens, ...)``) is safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeops._runtime import pow2

from ._launch import direct
from ._pdl import pdl_enter, pdl_options


@triton.jit(do_not_specialize=["B", "s_root", "s_seq", "s_act"])
def _reset_kernel(
    p_root_in,  # [B] int64 root tokens (stride s_root)
    p_seq_in,  # [B] int32/int64 cached lengths (stride s_seq)
    p_act_in,  # [B] bool active requests (stride s_act; unread without HAS_ACTIVE)
    p_root,  # [B] int64 out: the state's root tokens
    p_seq,  # [B] int64 out: the state's lengths
    p_act,  # [B] bool out: the state's active requests
    p_front,  # [B, W] int32 out: -1 (the root)
    p_ftok,  # [B, W] int64 out: the root token in row 0, else 0
    p_fscore,  # [B, W] f32 out: 1 in row 0 of an active request, else -1 (unused)
    p_dec,  # [ND] int32 out: 0
    p_uhist,  # [D] f32 out: 0
    B,
    s_root,
    s_seq,
    s_act,
    W: tl.constexpr,
    WP: tl.constexpr,
    ND: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    pdl_enter(PDL)
    i = tl.program_id(0)
    i64 = i.to(tl.int64)
    root = tl.load(p_root_in + i64 * s_root)
    seq = tl.load(p_seq_in + i64 * s_seq).to(tl.int64)
    if HAS_ACTIVE:
        act = tl.load(p_act_in + i64 * s_act).to(tl.int32) != 0
    else:
        act = i >= 0  # every request (a scalar True of the program's type)
    tl.store(p_root + i64, root)
    tl.store(p_seq + i64, seq)
    tl.store(p_act + i64, act.to(tl.int1))
    o_w = tl.arange(0, WP)
    m_w = o_w < W
    first = o_w == 0
    tl.store(p_front + i64 * W + o_w, tl.full([WP], -1, tl.int32), mask=m_w)
    tl.store(p_ftok + i64 * W + o_w, tl.where(first, root, 0), mask=m_w)
    score = tl.where(first & act, 1.0, -1.0).to(tl.float32)
    tl.store(p_fscore + i64 * W + o_w, score, mask=m_w)
    if i == 0:
        o_d = tl.arange(0, DP)
        tl.store(p_dec + o_d, tl.zeros([DP], tl.int32), mask=o_d < ND)
        tl.store(p_uhist + o_d, tl.zeros([DP], tl.float32), mask=o_d < D)


def reset(state, root_tokens: torch.Tensor, seq_lens: torch.Tensor, active) -> None:
    """Launch the reset of ``state`` (a ``DraftState``; inputs checked by its ``reset``: [B]
    tensors on its device, the state's buffers contiguous)."""
    B, W = state.frontier.shape
    if B == 0:
        return
    ND, D = state.decisions.shape[0], state.u_hist.shape[0]
    has_active = active is not None
    act_in = active if has_active else state.active  # unread without HAS_ACTIVE
    direct(_reset_kernel).launch(
        (B,),
        root_tokens,
        seq_lens,
        act_in,
        state.root_tokens,
        state.seq_lens,
        state.active,
        state.frontier,
        state.frontier_tokens,
        state.frontier_scores,
        state.decisions,
        state.u_hist,
        B,
        root_tokens.stride(0),
        seq_lens.stride(0),
        act_in.stride(0),
        W=W,
        WP=pow2(W),
        ND=ND,
        D=D,
        DP=pow2(max(ND, D)),
        HAS_ACTIVE=has_active,
        **pdl_options(root_tokens.device),
        num_warps=1,
    )
