"""Fused dense parts of the example decoder's forwards: Triton kernels and their launchers,
private to ``treeops.decoder`` (``model``'s forwards, ``graphs``' draft glue).

What an inference engine fuses around the treeops ops, written by hand (deterministic: one
program per row, a fixed reduction order, tile sizes from shapes only):

* ``add_rmsnorm``: the residual add and the next RMSNorm in one pass (``x + delta`` rounded to
  x's dtype as PyTorch's add rounds it, written back, then normalised), also with no delta (the
  draft's fc output) or gathering x from an embedding table (the target's first layer);
* ``swiglu``: ``silu(gate) * up`` reading the one [.., 2I] output of the concatenated gate/up
  GEMM;
* ``embed_cat``: the draft's fc input ``[embed(token), feature]`` in one pass;
* ``tree_index``: a forward's per-row index math, once per forward (RoPE positions; for a draft
  frontier also the rows' node index, K/V base and relative depths);
* ``frontier_inputs``: the draft's per-layer glue before a frontier forward (each frontier row's
  parent node, its depth and ancestor bits, its feature row, the layer's [B] metadata).

Every arithmetic kernel upcasts after each load and computes in fp32, rounding where the unfused
PyTorch code rounds (RMSNorm: ``x.float()`` -> normalise -> x's dtype -> times the weight;
SwiGLU: ``silu(gate)`` rounded to the dtype before the product), so results match the unfused
forward up to the reduction order of the norm and the approximate ``rsqrt``/``exp`` of the GPU
(``frontier_inputs`` only does integer math and copies features bit for bit: exact). None of
them syncs with the host or sizes its launch from tensor values: they run inside the decoder's
CUDA graphs.

The decoder calls these only where ``use_kernels`` says so (CUDA tensors; ``on_cpu()`` forces
them onto CPU tensors, which the Triton interpreter runs: tests). Otherwise it runs the same
math as PyTorch ops (``*_torch`` here and in ``model.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import triton
import triton.language as tl

__all__ = [
    "use_kernels",
    "on_cpu",
    "add_rmsnorm",
    "add_rmsnorm_torch",
    "swiglu",
    "swiglu_torch",
    "embed_cat",
    "embed_cat_torch",
    "tree_index",
    "tree_index_torch",
    "frontier_inputs",
    "frontier_inputs_torch",
]

_FORCE = [False]


def use_kernels(t: torch.Tensor) -> bool:
    """Whether forwards over ``t``'s device run the fused kernels: CUDA, or forced (``on_cpu``)."""
    return t.is_cuda or _FORCE[0]


@contextmanager
def on_cpu() -> Iterator[None]:
    """Run the fused forward (concatenated weights, these kernels) on CPU tensors too, in the
    Triton interpreter (``TRITON_INTERPRET=1`` set before triton is imported): tests."""
    prev = _FORCE[0]
    _FORCE[0] = True
    try:
        yield
    finally:
        _FORCE[0] = prev


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., H] as [M, H] with unit stride on H (a view for every tensor the model passes;
    a copy otherwise)."""
    r = x.reshape(-1, x.shape[-1])
    return r if r.stride(1) == 1 or r.shape[1] == 1 else r.contiguous()


# ------------------------------------------------------------------------------ add + RMSNorm
@triton.jit(do_not_specialize=["R"])
def _add_rmsnorm(
    X,
    DELTA,
    TOK,
    W,
    XO,
    Y,
    R,
    eps,
    s_x,
    s_d,
    s_tb,
    s_tr,
    s_xo,
    s_y,
    H: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    GATHER: tl.constexpr,
    WRITE_X: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Row m: x = X[m] (or X[TOK[m // R, m % R]] with GATHER), plus DELTA[m] rounded to x's dtype
    (HAS_DELTA); XO[m] = x (WRITE_X); Y[m] = W * dtype(x * rsqrt(mean(x^2) + eps))."""
    m = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK_H)
    mask = o < H
    if GATHER:
        tok = tl.load(TOK + (m // R) * s_tb + (m % R) * s_tr).to(tl.int64)
        x = tl.load(X + tok * s_x + o, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(X + m * s_x + o, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        d = tl.load(DELTA + m * s_d + o, mask=mask, other=0.0).to(tl.float32)
        x = (x + d).to(X.dtype.element_ty).to(tl.float32)  # PyTorch's add rounds here
    if WRITE_X:
        tl.store(XO + m * s_xo + o, x.to(XO.dtype.element_ty), mask=mask)
    var = tl.sum(x * x, axis=0) / H
    xn = (x * tl.math.rsqrt(var + eps)).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + o, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + m * s_y + o, (w * xn).to(Y.dtype.element_ty), mask=mask)


def add_rmsnorm_torch(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rmsnorm`` in PyTorch ops (the unfused model's ``x + delta`` and ``RMSNorm``)."""
    if delta is not None:
        x = x + delta
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return x, weight * xf.to(x.dtype)


def add_rmsnorm(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x', y): ``x' = x + delta`` (``x`` itself without delta), ``y = RMSNorm(x') * weight``,
    one launch. With ``tokens`` [B, R] (int), ``x`` is an embedding table [V, H] and row
    (b, r) reads ``x[tokens[b, r]]``; x' [B, R, H] is then the gathered rows (written)."""
    H = x.shape[-1]
    lead: tuple[int, ...]
    if tokens is not None:
        B, R = tokens.shape
        lead = (B, R)
        x2 = x
        assert x.dim() == 2 and x.stride(1) == 1
    else:
        lead = tuple(x.shape[:-1])
        R = 1
        x2 = _rows(x)
    M = 1
    for s in lead:
        M *= s
    d2 = _rows(delta) if delta is not None else x2
    if delta is not None:
        assert tuple(delta.shape) == (*lead, H) and delta.dtype == x.dtype
    assert weight.shape == (H,) and weight.stride(0) == 1
    write_x = delta is not None or tokens is not None
    xo = torch.empty(*lead, H, dtype=x.dtype, device=x.device) if write_x else x
    y = torch.empty(*lead, H, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if M == 0:
        return xo, y
    xo2, y2 = _rows(xo), _rows(y)
    tok = tokens if tokens is not None else x2
    s_t = tokens.stride() if tokens is not None else (0, 0)
    block = triton.next_power_of_2(H)
    _add_rmsnorm[(M,)](
        x2, d2, tok, weight, xo2, y2, R, float(eps),
        x2.stride(0), d2.stride(0), s_t[0], s_t[1], xo2.stride(0), y2.stride(0),
        H=H, HAS_DELTA=delta is not None, GATHER=tokens is not None, WRITE_X=write_x,
        BLOCK_H=block, num_warps=_warps(block),
    )  # fmt: skip
    return xo, y


# -------------------------------------------------------------------------------------- SwiGLU
@triton.jit
def _swiglu(GU, OUT, s_gu, s_o, I: tl.constexpr, BLOCK: tl.constexpr):
    """OUT[m, c] = dtype(silu(GU[m, c])) * GU[m, I + c], for c in this program's block."""
    m = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = o < I
    g = tl.load(GU + m * s_gu + o, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + m * s_gu + I + o, mask=mask, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32)  # silu, rounded
    tl.store(OUT + m * s_o + o, (a * u).to(OUT.dtype.element_ty), mask=mask)


def swiglu_torch(gu: torch.Tensor) -> torch.Tensor:
    """``swiglu`` in PyTorch ops."""
    g, u = gu.chunk(2, -1)
    return torch.nn.functional.silu(g) * u


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gu[..., :I]) * gu[..., I:]`` for gu [..., 2I] (the concatenated gate/up GEMM's
    output), one launch."""
    I2 = gu.shape[-1]
    assert I2 % 2 == 0
    I = I2 // 2
    out = torch.empty(*gu.shape[:-1], I, dtype=gu.dtype, device=gu.device)
    g2, o2 = _rows(gu), _rows(out)
    M = g2.shape[0]
    if M == 0:
        return out
    block = min(triton.next_power_of_2(I), 1024)
    _swiglu[(M, triton.cdiv(I, block))](
        g2, o2, g2.stride(0), o2.stride(0), I=I, BLOCK=block, num_warps=_warps(block)
    )
    return out


# ------------------------------------------------------------------- the draft's fc input
@triton.jit(do_not_specialize=["R"])
def _embed_cat(
    TOK,
    E,
    F,
    OUT,
    R,
    s_tb,
    s_tr,
    s_e,
    s_fb,
    s_fr,
    s_fh,
    s_o,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Row m = (b, r): OUT[m, :H] = E[TOK[b, r]], OUT[m, H:] = F[b, r] (in OUT's dtype)."""
    m = tl.program_id(0).to(tl.int64)
    b = m // R
    r = m % R
    o = tl.arange(0, BLOCK_H)
    mask = o < H
    tok = tl.load(TOK + b * s_tb + r * s_tr).to(tl.int64)
    e = tl.load(E + tok * s_e + o, mask=mask, other=0.0).to(tl.float32)
    f = tl.load(F + b * s_fb + r * s_fr + o * s_fh, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + m * s_o + o, e.to(OUT.dtype.element_ty), mask=mask)
    tl.store(OUT + m * s_o + H + o, f.to(OUT.dtype.element_ty), mask=mask)


def embed_cat_torch(tokens: torch.Tensor, feats: torch.Tensor, table: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """``embed_cat`` in PyTorch ops."""
    return torch.cat([torch.nn.functional.embedding(tokens, table), feats.to(dtype)], -1)


def embed_cat(
    tokens: torch.Tensor, feats: torch.Tensor, table: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """[B, R, 2H] ``cat([table[tokens], feats], -1)`` in ``dtype`` (tokens [B, R] int, feats
    [B, R, H] any strides, table [V, H] unit stride along H), one launch."""
    B, R = tokens.shape
    H = table.shape[1]
    assert feats.shape == (B, R, H) and table.stride(1) == 1
    out = torch.empty(B, R, 2 * H, dtype=dtype, device=tokens.device)
    if B * R == 0:
        return out
    block = triton.next_power_of_2(H)
    _embed_cat[(B * R,)](
        tokens, table, feats, out, R, *tokens.stride(), table.stride(0), *feats.stride(),
        out.stride(1), H=H, BLOCK_H=block, num_warps=_warps(block),
    )  # fmt: skip
    return out


# ------------------------------------------------------------------- per-forward index math
@triton.jit(do_not_specialize=["R", "N"])
def _tree_index(
    SEQ,
    QS,
    DEP,
    POS,
    IDX,
    BASE,
    REL,
    R,
    N,
    s_db,
    s_dn,
    FRONTIER: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Request b. Without FRONTIER: POS[b, j] = SEQ[b] + DEP[b, j] (j < N = R). With it, rows
    j < R are nodes IDX[b, j] = min(QS[b] + j, N - 1): POS = SEQ + DEP[IDX], BASE[b] = SEQ + QS,
    REL[b, j] = DEP[IDX] - QS."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_R)
    mj = j < R
    seq = tl.load(SEQ + b).to(tl.int64)
    if FRONTIER:
        qs = tl.load(QS + b).to(tl.int64)
        idx = tl.minimum(qs + j, N - 1)
    else:
        idx = j.to(tl.int64)
    dep = tl.load(DEP + b * s_db + idx * s_dn, mask=mj, other=0).to(tl.int64)
    tl.store(POS + b * R + j, seq + dep, mask=mj)
    if FRONTIER:
        tl.store(IDX + b * R + j, idx, mask=mj)
        tl.store(REL + b * R + j, (dep - qs).to(tl.int32), mask=mj)
        tl.store(BASE + b, (seq + qs).to(tl.int32))


def tree_index_torch(seq_lens, depth, q_start=None, R=None):
    """``tree_index`` in PyTorch ops (the unfused model's index math)."""
    if q_start is None:
        return seq_lens.to(torch.int64)[:, None] + depth.to(torch.int64), None, None, None
    N = depth.shape[1]
    q_start = q_start.to(torch.int32)
    idx = q_start.long()[:, None] + torch.arange(R, device=depth.device)[None, :]  # [B, R]
    idx = idx.clamp(max=N - 1)
    dep = depth.gather(1, idx)
    base = seq_lens.to(torch.int32) + q_start
    rel = (dep - q_start[:, None]).to(torch.int32)
    pos = seq_lens.long()[:, None] + dep.long()
    return pos, idx, base, rel


def tree_index(
    seq_lens: torch.Tensor,
    depth: torch.Tensor,
    q_start: torch.Tensor | None = None,
    R: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """A forward's index math, one launch: ``(pos, idx, base, rel)``.

    Every node (``q_start`` None): ``pos`` [B, N] int64 = ``seq_lens[:, None] + depth`` (RoPE
    positions, as ``Tree.positions``); the rest None. A frontier of ``R`` rows from node
    ``q_start[b]`` (int32): ``idx`` [B, R] int64 = ``min(q_start + j, N - 1)`` (the rows' nodes),
    ``pos`` [B, R] int64 = ``seq_lens + depth[idx]``, ``base`` [B] int32 = ``seq_lens +
    q_start`` and ``rel`` [B, R] int32 = ``depth[idx] - q_start`` (kv_append's shifted base
    and relative depths)."""
    B, N = depth.shape
    dev = depth.device
    frontier = q_start is not None
    rows = int(R) if frontier and R is not None else N
    pos = torch.empty(B, rows, dtype=torch.int64, device=dev)
    idx = base = rel = None
    if frontier:
        idx = torch.empty(B, rows, dtype=torch.int64, device=dev)
        base = torch.empty(B, dtype=torch.int32, device=dev)
        rel = torch.empty(B, rows, dtype=torch.int32, device=dev)
    if B * rows == 0:
        return pos, idx, base, rel
    _tree_index[(B,)](
        seq_lens, q_start if frontier else seq_lens, depth, pos,
        pos if idx is None else idx, pos if base is None else base, pos if rel is None else rel,
        rows, N, *depth.stride(), FRONTIER=frontier, BLOCK_R=triton.next_power_of_2(rows),
        num_warps=1,
    )  # fmt: skip
    return pos, idx, base, rel


# ----------------------------------------------------------- the draft's frontier inputs
@triton.jit(do_not_specialize=["qs"])
def _frontier_inputs(
    FR,
    CAND,
    DEP,
    ANC,
    BITS,
    HID,
    FEAT,
    META,
    META_OUT,
    qs,
    last,
    s_fb,
    s_fj,
    s_c,
    s_db,
    s_dn,
    s_ab,
    s_an,
    s_ak,
    s_bn,
    s_bk,
    s_hb,
    s_hn,
    s_hh,
    s_eb,
    s_ej,
    s_eh,
    s_mr,
    s_mb,
    s_or,
    s_ob,
    WD: tl.constexpr,
    H: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_WD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    """Frontier row (b, j), node n = qs + j, parent p = CAND[FR[b, j]] (CAND[last] where FR < 0):
    DEP[b, n] = DEP[b, p] + 1, ANC[b, n, :WD] = ANC[b, p, :WD] | BITS[n, :WD], FEAT[b, j] =
    HID[b, p] (as bits); j == 0 also copies META[:, b] to META_OUT[:, b]."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    f = tl.load(FR + b * s_fb + j * s_fj).to(tl.int64)
    c = tl.where(f >= 0, f, last)
    p = tl.load(CAND + c * s_c).to(tl.int64)
    n = qs + j
    dep = tl.load(DEP + b * s_db + p * s_dn)
    tl.store(DEP + b * s_db + n * s_dn, dep + 1)
    k = tl.arange(0, BLOCK_WD)
    mk = k < WD
    a = tl.load(ANC + b * s_ab + p * s_an + k * s_ak, mask=mk, other=0)
    bits = tl.load(BITS + n * s_bn + k * s_bk, mask=mk, other=0)
    tl.store(ANC + b * s_ab + n * s_an + k * s_ak, a | bits, mask=mk)
    for h0 in range(0, H, BLOCK_H):
        o = h0 + tl.arange(0, BLOCK_H)
        mh = o < H
        x = tl.load(HID + b * s_hb + p * s_hn + o * s_hh, mask=mh, other=0)
        tl.store(FEAT + b * s_eb + j * s_ej + o * s_eh, x, mask=mh)
    if j == 0:
        r = tl.arange(0, BLOCK_ROWS)
        mr = r < ROWS
        m = tl.load(META + r * s_mr + b * s_mb, mask=mr, other=0)
        tl.store(META_OUT + r * s_or + b * s_ob, m, mask=mr)


def frontier_inputs_torch(
    frontier: torch.Tensor, cand_node: torch.Tensor, q_start: int, depth: torch.Tensor,
    anc: torch.Tensor, self_bits: torch.Tensor, hid: torch.Tensor, feat: torch.Tensor,
    meta: torch.Tensor, meta_out: torch.Tensor,
) -> None:  # fmt: skip
    """``frontier_inputs`` in PyTorch ops."""
    B, w = frontier.shape
    Wd, H = anc.shape[2], hid.shape[2]
    # -1 (an unused row) indexes the table's last entry: the root
    pnode = cand_node[frontier]
    new = slice(q_start, q_start + w)
    torch.add(depth.gather(1, pnode), 1, out=depth[:, new])
    pa = anc.gather(1, pnode[:, :, None].expand(B, w, Wd))
    torch.bitwise_or(pa, self_bits[new, :Wd], out=anc[:, new])
    torch.gather(hid, 1, pnode[:, :, None].expand(B, w, H), out=feat)
    meta_out.copy_(meta)


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def frontier_inputs(
    frontier: torch.Tensor, cand_node: torch.Tensor, q_start: int, depth: torch.Tensor,
    anc: torch.Tensor, self_bits: torch.Tensor, hid: torch.Tensor, feat: torch.Tensor,
    meta: torch.Tensor, meta_out: torch.Tensor,
) -> None:  # fmt: skip
    """The draft's inputs for a frontier of w rows at working-tree nodes ``q_start .. q_start +
    w - 1``, in place, one launch.

    ``frontier`` [B, w] (int): each row's candidate index, -1 for an unused row; ``cand_node``
    [C + 1] (int): a candidate's working-tree node, the last entry (the root) read for -1. Row j's
    parent p = ``cand_node[frontier[b, j]]`` must be a node before ``q_start``. Writes, at node
    n = ``q_start + j``: ``depth`` [B, Nd] int32 ``depth[b, n] = depth[b, p] + 1``; ``anc`` [B, Nd,
    Wd] int32 ``anc[b, n] = anc[b, p] | self_bits[n, :Wd]`` (``self_bits`` [>= Nd, >= Wd] int32:
    a node's own bit); ``feat`` [B, w, H] ``= hid[b, p]`` (``hid`` [B, Nd, H] of feat's dtype,
    copied bit for bit); and ``meta_out`` [R, B] ``= meta`` [R, B] (int32). Any strides; other rows
    untouched. ``q_start`` is a runtime argument: one compiled kernel serves every layer."""
    B, w = frontier.shape
    Wd, H = anc.shape[2], hid.shape[2]
    assert depth.shape == anc.shape[:2] and depth.shape[0] == B and q_start + w <= depth.shape[1]
    assert self_bits.shape[0] >= q_start + w and self_bits.shape[1] >= Wd
    assert hid.shape[0] == B and feat.shape == (B, w, H) and feat.dtype == hid.dtype
    assert meta.shape == meta_out.shape and meta.shape[1] == B
    if B * w == 0:
        return
    bits = _BITS[hid.element_size()]  # the copy moves bits: any float dtype, NaNs kept
    hb, fb = hid.view(bits), feat.view(bits)
    rows = meta.shape[0]
    block = min(triton.next_power_of_2(H), 2048)
    _frontier_inputs[(B, w)](
        frontier, cand_node, depth, anc, self_bits, hb, fb, meta, meta_out,
        q_start, cand_node.shape[0] - 1, *frontier.stride(), cand_node.stride(0),
        *depth.stride(), *anc.stride(), *self_bits.stride(), *hb.stride(), *fb.stride(),
        *meta.stride(), *meta_out.stride(),
        WD=Wd, H=H, ROWS=rows, BLOCK_WD=triton.next_power_of_2(Wd), BLOCK_H=block,
        BLOCK_ROWS=triton.next_power_of_2(rows), num_warps=_warps(block),
    )  # fmt: skip
