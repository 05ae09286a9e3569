"""KV compaction kernel (docs/design.md op 8): one program per (request, layer, KV head).

Each program walks the accepted path in increasing depth, DB nodes at a time, and copies the
[D] row of slot ``s + accepted[d]`` to slot ``s + d`` in K and in V, in place. Within a chunk all
sources are loaded (block-table lookups vectorised) before any destination is stored, with a CTA
barrier between, so the chunk's copies are in flight together. That is safe in place: a source
``s + i_d`` (``i_d >= d``) is never an earlier destination (``< s + d``), and a chunk's
destinations are below every later chunk's sources. Layers come either from one stacked tensor
(a layer stride) or from a device table of per-layer base pointers, so all layers move in one
launch. Addresses are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeops._runtime import pow2, refuse_in_capture

from ._launch import direct
from ._pdl import pdl_enter, pdl_options


@triton.jit(do_not_specialize=["N", "L", "H"])
def _compact_kernel(
    p_k,
    p_v,
    p_ktab,
    p_vtab,
    s_kl,
    s_kp,
    s_ks,
    s_kh,
    s_kd,
    s_vl,
    s_vp,
    s_vs,
    s_vh,
    s_vd,
    p_bt,
    s_btb,
    p_seq,
    p_acc,
    s_ab,
    p_len,
    p_out,
    N,
    L,
    H,
    D,
    PS: tl.constexpr,
    D_PAD: tl.constexpr,
    DB: tl.constexpr,
    STACKED: tl.constexpr,
    TABLE_ALIGNED: tl.constexpr,  # every layer's base address in the tables 16-byte aligned
    PDL: tl.constexpr = 0,
):
    pdl_enter(PDL)
    pid = tl.program_id(0).to(tl.int64)
    i_h = pid % H
    i_l = (pid // H) % L
    i_b = pid // (H * L)
    if STACKED:
        p_kl = p_k + i_l * s_kl
        p_vl = p_v + i_l * s_vl
    else:
        p_kl = tl.load(p_ktab + i_l).to(tl.pointer_type(p_k.dtype.element_ty))
        p_vl = tl.load(p_vtab + i_l).to(tl.pointer_type(p_v.dtype.element_ty))
        if TABLE_ALIGNED:
            # a loaded address has no known alignment: said (the host checked it), the rows'
            # copies are 16-byte vectors as on the stacked path, not one element each
            p_kl = tl.multiple_of(p_kl, 16)
            p_vl = tl.multiple_of(p_vl, 16)
    s = tl.load(p_seq + i_b).to(tl.int64)
    n_acc = tl.load(p_len + i_b)
    o_d = tl.arange(0, D_PAD)
    m_d = o_d < D
    o_kd = o_d.to(tl.int64) * s_kd + i_h * s_kh
    o_vd = o_d.to(tl.int64) * s_vd + i_h * s_vh
    p_bt_row = p_bt + i_b * s_btb
    o_r = tl.arange(0, DB)
    # DB path nodes at a time, in increasing depth: every source of the chunk is read before
    # any of its destinations is written (a barrier between), so the copies of one chunk are
    # all in flight together; a chunk's destinations (< s + d0 + DB) are never a later
    # chunk's sources (>= s + d0 + DB), and its sources are never an earlier destination
    for d0 in range(0, n_acc, DB):
        d = d0 + o_r
        i = tl.load(p_acc + i_b * s_ab + d, mask=d < n_acc, other=0)
        mv = (d < n_acc) & (d > 0) & (i != d)  # [DB]
        src = s + i.to(tl.int64)
        dst = s + d.to(tl.int64)
        src_page = tl.load(p_bt_row + src // PS, mask=mv, other=0).to(tl.int64)
        dst_page = tl.load(p_bt_row + dst // PS, mask=mv, other=0).to(tl.int64)
        m2 = mv[:, None] & m_d[None, :]  # [DB, D_PAD]
        o_ks = src_page * s_kp + (src % PS) * s_ks
        o_kt = dst_page * s_kp + (dst % PS) * s_ks
        o_vs = src_page * s_vp + (src % PS) * s_vs
        o_vt = dst_page * s_vp + (dst % PS) * s_vs
        b_k = tl.load(p_kl + o_ks[:, None] + o_kd[None, :], mask=m2)
        b_v = tl.load(p_vl + o_vs[:, None] + o_vd[None, :], mask=m2)
        tl.debug_barrier()
        tl.store(p_kl + o_kt[:, None] + o_kd[None, :], b_k, mask=m2)
        tl.store(p_vl + o_vt[:, None] + o_vd[None, :], b_v, mask=m2)
        tl.debug_barrier()
    if (i_l == 0) & (i_h == 0):
        tl.store(p_out + i_b, (s + n_acc.to(tl.int64)).to(tl.int32))


_TABLES: dict[tuple, tuple[torch.Tensor, bool]] = {}


def _pointer_table(layers) -> tuple[torch.Tensor, bool]:
    """Device int64 table of the layers' base addresses, and whether every one is 16-byte
    aligned (what the kernel may be told of them), cached by (device, addresses): built (one
    small host-to-device copy) on the first call only."""
    key = (layers[0].device, tuple(t.data_ptr() for t in layers))
    hit = _TABLES.get(key)
    if hit is None:
        refuse_in_capture("compact_kv's table of layer addresses (per list of caches)")
        # never evicted: a CUDA graph captured with a table keeps reading it (a few bytes each)
        tab = torch.tensor(key[1], dtype=torch.int64).to(layers[0].device)
        hit = _TABLES[key] = (tab, all(p % 16 == 0 for p in key[1]))
    return hit


def compact_kv_launch(
    k_caches, v_caches, block_table, seq_lens, accepted, accept_len, *, out=None, rows_per_step=8
) -> torch.Tensor:
    """Launch the compaction (inputs validated by ``treeops.compact_kv``); returns the new lengths.
    ``rows_per_step``: path nodes copied per step (tests use small ones to exercise chunking)."""
    B, N = accepted.shape
    stacked = isinstance(k_caches, torch.Tensor)
    if stacked:
        k0, v0 = k_caches, v_caches
        L = k0.shape[0]
        s_kl, s_vl = k0.stride(0), v0.stride(0)
        k_str, v_str = k0.stride()[1:], v0.stride()[1:]
        ktab = vtab = accept_len  # unused
        aligned = False
        shape = k0.shape[1:]
    else:
        k0, v0 = k_caches[0], v_caches[0]
        L = len(k_caches)
        s_kl = s_vl = 0
        k_str, v_str = k0.stride(), v0.stride()
        (ktab, k_aligned), (vtab, v_aligned) = _pointer_table(k_caches), _pointer_table(v_caches)
        aligned = k_aligned and v_aligned
        shape = k0.shape
    _, PS, H, D = shape
    if out is None:
        out = torch.empty(B, dtype=torch.int32, device=accepted.device)
    grid = (B * L * H,)
    direct(_compact_kernel).launch(
        grid,
        k0,
        v0,
        ktab,
        vtab,
        s_kl,
        *k_str,
        s_vl,
        *v_str,
        block_table,
        block_table.stride(0),
        seq_lens,
        accepted,
        accepted.stride(0),
        accept_len,
        out,
        N,
        L,
        H,
        D,
        PS=PS,
        D_PAD=pow2(D) if D else 0,  # triton.next_power_of_2's value, without its host cost
        DB=rows_per_step,
        STACKED=stacked,
        TABLE_ALIGNED=aligned,
        **pdl_options(accepted.device),
        num_warps=4 if D <= 128 else 8,
    )
    return out
