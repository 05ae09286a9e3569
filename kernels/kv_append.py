"""KV append with RoPE: one launch writes every request's new K/V into its pages.

Program (request b, block of BLOCK_T tokens, KV head) loads K as its two halves (Llama's
``rotate_half`` pairs element k with element k + D/2), rotates them at position
``seq_lens[b] + depth[b, i]`` and stores K and V at logical slot ``seq_lens[b] + i`` through the
block table. With queries (``HAS_Q``) the same program then rotates, in place, the KV head's group
of ``H_q / H_kv`` query heads at the same positions with the same cos/sin, so a decoder layer needs
no separate RoPE launch for q. ``inv_freq`` comes in as a tensor computed exactly like the
reference's, so kernel and reference share every fp32 angle ``position · inv_freq``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeops._runtime import cdiv, interpreted, pow2, refuse_in_capture
from treeops.reference.kv_append import rope_inv_freq

from ._launch import direct, kept
from ._pdl import pdl_enter, pdl_options


@triton.jit(do_not_specialize=["N", "H_KV"])
def _kv_append(
    K,
    V,
    Q,
    KC,
    VC,
    BT,
    SEQ,
    NT,
    DEP,
    INV_FREQ,
    N,
    H_KV,
    GROUP: tl.constexpr,
    s_kb,
    s_kn,
    s_kh,
    s_kd,
    s_vb,
    s_vn,
    s_vh,
    s_vd,
    s_qb,
    s_qn,
    s_qh,
    s_qd,
    s_kcp,
    s_kcs,
    s_kch,
    s_kcd,
    s_vcp,
    s_vcs,
    s_vch,
    s_vcd,
    s_btb,
    s_db,
    s_dn,
    BLOCK_T: tl.constexpr,
    HALF: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_DEPTH: tl.constexpr,
    HAS_Q: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    pdl_enter(PDL)
    i_bt = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    n_tiles = tl.cdiv(N, BLOCK_T)
    i_b = i_bt // n_tiles
    i_t = i_bt % n_tiles
    seq = tl.load(SEQ + i_b)
    nt = tl.minimum(tl.load(NT + i_b), N)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] token
    o_c = tl.arange(0, HALF).to(tl.int64)  # int64: o_c * stride must not wrap
    half = tl.full([], HALF, tl.int64)  # the second half's offset, HALF * stride, in int64
    m_t = o_t < nt
    if HAS_DEPTH:
        dep = tl.load(DEP + i_b * s_db + o_t * s_dn, mask=m_t, other=0)
    else:
        dep = o_t
    ang = (seq + dep).to(tl.float32)[:, None] * tl.load(INV_FREQ + o_c)[None, :]  # [BLOCK_T, HALF]
    cos = tl.cos(ang)
    sin = tl.sin(ang)
    p_k = K + i_b * s_kb + o_t[:, None] * s_kn + i_h * s_kh + o_c[None, :] * s_kd
    b_k1 = tl.load(p_k, mask=m_t[:, None], other=0.0).to(tl.float32)
    b_k2 = tl.load(p_k + half * s_kd, mask=m_t[:, None], other=0.0).to(tl.float32)
    p_v = V + i_b * s_vb + o_t[:, None] * s_vn + i_h * s_vh + o_c[None, :] * s_vd
    b_v1 = tl.load(p_v, mask=m_t[:, None], other=0.0)
    b_v2 = tl.load(p_v + half * s_vd, mask=m_t[:, None], other=0.0)

    slot = seq + o_t  # [BLOCK_T] logical slot
    page = tl.load(BT + i_b * s_btb + slot // PAGE_SIZE, mask=m_t, other=0).to(tl.int64)
    row = (slot % PAGE_SIZE).to(tl.int64)
    p_kc = KC + (page * s_kcp + row * s_kcs + i_h * s_kch)[:, None] + o_c[None, :] * s_kcd
    p_vc = VC + (page * s_vcp + row * s_vcs + i_h * s_vch)[:, None] + o_c[None, :] * s_vcd
    dt = KC.dtype.element_ty
    tl.store(p_kc, (b_k1 * cos - b_k2 * sin).to(dt), mask=m_t[:, None])
    tl.store(p_kc + half * s_kcd, (b_k2 * cos + b_k1 * sin).to(dt), mask=m_t[:, None])
    tl.store(p_vc, b_v1.to(VC.dtype.element_ty), mask=m_t[:, None])
    tl.store(p_vc + half * s_vcd, b_v2.to(VC.dtype.element_ty), mask=m_t[:, None])
    if HAS_Q:
        # query heads i_h * GROUP .. (i_h + 1) * GROUP - 1 read KV head i_h: their positions are
        # K's, so the cos/sin above serve them. Unrolled (GROUP is constexpr, one compile per
        # GQA ratio): the group's loads can be in flight together (a runtime loop spilled on sm_90)
        dq = Q.dtype.element_ty
        p_q0 = Q + i_b * s_qb + o_t[:, None] * s_qn + o_c[None, :] * s_qd
        for g in tl.static_range(GROUP):
            p_q = p_q0 + (i_h * GROUP + g) * s_qh
            b_q1 = tl.load(p_q, mask=m_t[:, None], other=0.0).to(tl.float32)
            b_q2 = tl.load(p_q + half * s_qd, mask=m_t[:, None], other=0.0).to(tl.float32)
            tl.store(p_q, (b_q1 * cos - b_q2 * sin).to(dq), mask=m_t[:, None])
            tl.store(p_q + half * s_qd, (b_q2 * cos + b_q1 * sin).to(dq), mask=m_t[:, None])


_INV_FREQ: dict[tuple[int, float, torch.device], torch.Tensor] = {}


def inv_freq(d: int, theta: float, device: torch.device) -> torch.Tensor:
    """Cached [D/2] fp32 inverse frequencies (allocated once per (D, theta, device))."""
    key = (d, float(theta), device)
    t = _INV_FREQ.get(key)
    if t is None:
        refuse_in_capture("kv_append's RoPE frequency table (per head dim, theta and device)")
        t = _INV_FREQ[key] = kept(rope_inv_freq(d, theta, device))
    return t


def kv_append_fwd(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_tokens: torch.Tensor,
    depth: torch.Tensor | None,
    rope_theta: float,
    q: torch.Tensor | None = None,
) -> None:
    """Launch (no checks). ``q`` [B, N, H_q, D] (H_q a multiple of H_kv, any strides), if given,
    is rotated in place at K's positions for tokens i < ``num_tokens[b]``."""
    B, N, H_kv, D = k.shape
    block_t = min(pow2(N), 16 if interpreted() else 32)
    grid = (B * cdiv(N, block_t), H_kv)
    direct(_kv_append).launch(
        grid,
        k,
        v,
        q if q is not None else k,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        num_tokens,
        depth if depth is not None else seq_lens,
        inv_freq(D, rope_theta, k.device),
        N,
        H_kv,
        q.shape[2] // H_kv if q is not None else 1,
        *k.stride(),
        *v.stride(),
        *(q.stride() if q is not None else (0, 0, 0, 0)),
        *k_cache.stride(),
        *v_cache.stride(),
        block_table.stride(0),
        *(depth.stride() if depth is not None else (0, 0)),
        BLOCK_T=block_t,
        HALF=D // 2,
        PAGE_SIZE=k_cache.shape[1],
        HAS_DEPTH=depth is not None,
        HAS_Q=q is not None,
        **pdl_options(k.device),
        num_warps=4,
    )


@triton.jit(do_not_specialize=["N"])
def _rope(
    X, POS, INV_FREQ, Y,  # x [B, N, H, D], positions [B, N], [D/2] fp32, out [B, N, H, D]
    N, H,
    s_xb, s_xn, s_xh, s_xd,
    s_pb, s_pn,
    s_yb, s_yn, s_yh,  # out's last stride is 1
    H_PAD: tl.constexpr,
    HALF: tl.constexpr,
    PDL: tl.constexpr = 0,
):  # fmt: skip
    pdl_enter(PDL)
    # one program per (b, n) row: every head of that row shares one position's cos/sin
    i_row = tl.program_id(0).to(tl.int64)
    i_b = i_row // N
    i_n = i_row % N
    o_h = tl.arange(0, H_PAD).to(tl.int64)
    o_c = tl.arange(0, HALF).to(tl.int64)
    half = tl.full([], HALF, tl.int64)
    m_h = (o_h < H)[:, None]
    pos = tl.load(POS + i_b * s_pb + i_n * s_pn).to(tl.float32)
    ang = pos * tl.load(INV_FREQ + o_c)  # [HALF], the fp32 angles the reference computes
    cos = tl.cos(ang)[None, :]
    sin = tl.sin(ang)[None, :]
    p_x = X + i_b * s_xb + i_n * s_xn + o_h[:, None] * s_xh + o_c[None, :] * s_xd  # [H_PAD, HALF]
    b_x1 = tl.load(p_x, mask=m_h, other=0.0).to(tl.float32)
    b_x2 = tl.load(p_x + half * s_xd, mask=m_h, other=0.0).to(tl.float32)
    p_y = Y + i_b * s_yb + i_n * s_yn + o_h[:, None] * s_yh + o_c[None, :]
    dt = Y.dtype.element_ty
    tl.store(p_y, (b_x1 * cos - b_x2 * sin).to(dt), mask=m_h)
    tl.store(p_y + half, (b_x2 * cos + b_x1 * sin).to(dt), mask=m_h)


def rope_fwd(x: torch.Tensor, positions: torch.Tensor, theta: float, out: torch.Tensor) -> None:
    """Launch (no checks): ``out`` [B, N, H, D] (contiguous last dim) = x [B, N, H, D] rotated at
    ``positions`` [B, N]; any strides for x and positions."""
    B, N, H, D = x.shape
    if B * N == 0:
        return
    direct(_rope).launch(
        (B * N,),
        x,
        positions,
        inv_freq(D, theta, x.device),
        out,
        N,
        H,
        *x.stride(),
        *positions.stride(),
        *out.stride()[:3],
        H_PAD=pow2(H),
        HALF=D // 2,
        **pdl_options(x.device),
        num_warps=1 if interpreted() else (4 if H * D >= 4096 else 2),
    )
