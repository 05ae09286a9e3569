"""KV compaction kernel (DESIGN.md op 8): one program per (request, layer, KV head).

Each program walks the accepted path in increasing depth d and copies the [D] row of slot
``s + accepted[d]`` to slot ``s + d`` in K and in V. In place is safe in that order: a source
``s + i_d`` (``i_d >= d``) is never an earlier destination (``< s + d``), and a destination
``s + d`` that is a later source has already been read. A load and the store that later
overwrites the same element are issued by the same thread (same [D] layout); a CTA barrier per
step makes that independent of the layout the compiler picks. Layers come either from one
stacked tensor (a layer stride) or from a device table of per-layer base pointers, so all layers
move in one launch. Addresses are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _slot_offset(p_bt_row, slot, PS: tl.constexpr, s_page, s_slot):
    page = tl.load(p_bt_row + slot // PS).to(tl.int64)
    return page * s_page + (slot % PS).to(tl.int64) * s_slot


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
    STACKED: tl.constexpr,
):
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
    s = tl.load(p_seq + i_b).to(tl.int64)
    n_acc = tl.load(p_len + i_b)
    o_d = tl.arange(0, D_PAD)
    m_d = o_d < D
    o_kd = o_d.to(tl.int64) * s_kd + i_h * s_kh
    o_vd = o_d.to(tl.int64) * s_vd + i_h * s_vh
    p_bt_row = p_bt + i_b * s_btb
    for d in range(1, n_acc):
        i = tl.load(p_acc + i_b * s_ab + d)
        if i != d:
            src = _slot_offset(p_bt_row, s + i, PS, s_kp, s_ks)
            dst = _slot_offset(p_bt_row, s + d, PS, s_kp, s_ks)
            b_k = tl.load(p_kl + src + o_kd, mask=m_d)
            tl.store(p_kl + dst + o_kd, b_k, mask=m_d)
            src = _slot_offset(p_bt_row, s + i, PS, s_vp, s_vs)
            dst = _slot_offset(p_bt_row, s + d, PS, s_vp, s_vs)
            b_v = tl.load(p_vl + src + o_vd, mask=m_d)
            tl.store(p_vl + dst + o_vd, b_v, mask=m_d)
        tl.debug_barrier()
    if (i_l == 0) & (i_h == 0):
        tl.store(p_out + i_b, (s + n_acc.to(tl.int64)).to(tl.int32))


_TABLES: dict[tuple, torch.Tensor] = {}


def _pointer_table(layers) -> torch.Tensor:
    """Device int64 table of the layers' base addresses, cached by (device, addresses): built
    (one small host-to-device copy) on the first call only."""
    key = (layers[0].device, tuple(t.data_ptr() for t in layers))
    tab = _TABLES.get(key)
    if tab is None:
        if len(_TABLES) > 64:
            _TABLES.clear()
        tab = torch.tensor(key[1], dtype=torch.int64).to(layers[0].device)
        _TABLES[key] = tab
    return tab


def compact_kv_launch(
    k_caches, v_caches, block_table, seq_lens, accepted, accept_len, *, out=None
) -> torch.Tensor:
    """Launch the compaction (inputs validated by ``treeops.compact``); returns the new lengths."""
    B, N = accepted.shape
    stacked = isinstance(k_caches, torch.Tensor)
    if stacked:
        k0, v0 = k_caches, v_caches
        L = k0.shape[0]
        s_kl, s_vl = k0.stride(0), v0.stride(0)
        k_str, v_str = k0.stride()[1:], v0.stride()[1:]
        ktab = vtab = accept_len  # unused
        shape = k0.shape[1:]
    else:
        k0, v0 = k_caches[0], v_caches[0]
        L = len(k_caches)
        s_kl = s_vl = 0
        k_str, v_str = k0.stride(), v0.stride()
        ktab, vtab = _pointer_table(k_caches), _pointer_table(v_caches)
        shape = k0.shape
    _, PS, H, D = shape
    if out is None:
        out = torch.empty(B, dtype=torch.int32, device=accepted.device)
    grid = (B * L * H,)
    _compact_kernel[grid](
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
        D_PAD=triton.next_power_of_2(D),
        STACKED=stacked,
        num_warps=1 if D <= 128 else 2,
    )
    return out
