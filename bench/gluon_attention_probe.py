"""treeops' Gluon attention loop alone: does overlapping the softmax with the MMAs pay on Hopper?

    python bench/gluon_attention_probe.py --out DIR          # H200: correctness, then µs/TFLOP/s
    python bench/gluon_attention_probe.py --compile          # any machine: sm_90 registers etc.

Tree attention's Triton kernel runs its prefix loop at about 255 TFLOP/s on the H200 where
FlashInfer's causal prefill reaches about 516 (bench/attention_notes.md); compiled for sm_90,
Triton waits for each QK^T wgmma right after issuing it (docs/benchmarks.md, "Tree attention's
softmax and MMAs"). ``kernels/tree_attention_gluon.py`` places the waits by hand. This probe runs
its prefix loop (``_prefix``: every key visible, no tree tiles, no split) over ctx + n keys, so
that the loop's own speed is measured apart from the rest of the kernel: one program per
(request, KV head, tile of BLOCK_Q nodes) with the group's query heads packed into its rows, as
treeops packs them.

``--compile`` reports, per configuration, registers, spills, shared memory, how many exp2s ptxas
issues while a wgmma is pending, and whether ptxas serialised the wgmmas (its note C7514). The
GPU run checks each configuration against an fp32 reference (every key visible) and times it
against treeops' kernel on the same caches (which masks the tree's keys: the same tiles, flops
and bytes), each configuration in its own process. Writes ``DIR/gluon_attention_probe.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from treeops.kernels import tree_attention_gluon as KG

LOG2E = 1.4426950408889634

# (block_m, block_n, num_warps, la, p_in_smem, mode): M rows per program (64 per warpgroup), keys
# per tile, warps, tiles loaded ahead (``ws``/``pp``: the ring's stages), P through shared memory
# instead of registers, and the loop's form: "" as treeops runs it, "ws" warp-specialised
# (``_prefix_attn_ws``: one producer warp issues the copies), "pp" ping-pong
# (``_prefix_attn_pp``: two consumer warpgroups of 64 rows each, whose wgmmas take turns, and the
# producer warp; ``num_warps`` is one warpgroup's). Compiled for sm_90 (``--compile``), the ""
# forms issue the loop tile's exp2s while the PV wgmma is pending (about half of all their exp2s:
# the rest are the first tile's); in the warp-specialised forms ptxas waits for the PV first (at
# most 8 of 136 overlap at 64-key tiles, with or without the turns). The GPU run says what each
# overlap is worth, and which tile, depth of copies ahead and split of work is fastest.
CONFIGS = {
    "m128_n64_la1": (128, 64, 8, 1, False, ""),
    "m128_n64_la2": (128, 64, 8, 2, False, ""),
    "m128_n64_la2_ps": (128, 64, 8, 2, True, ""),
    "m64_n64_la2": (64, 64, 4, 2, False, ""),
    "m64_n128_la1": (64, 128, 4, 1, False, ""),
    "m128_n128_la1_ps": (128, 128, 8, 1, True, ""),
    "ws_m128_n64_s4": (128, 64, 8, 4, False, "ws"),
    "ws_m128_n64_s4_ps": (128, 64, 8, 4, True, "ws"),
    "ws_m64_n64_s4_ps": (64, 64, 4, 4, True, "ws"),
    "pp_m128_n64_s3": (128, 64, 4, 3, False, "pp"),
    "pp_m128_n64_s4": (128, 64, 4, 4, False, "pp"),
}
PP_REGS = int(os.environ.get("PROBE_PP_REGS", "0"))
PP_WORKER_REGS = int(os.environ.get("PROBE_PP_WORKER_REGS", "0"))
PP_PRODUCER_REGS = int(os.environ.get("PROBE_PP_PRODUCER_REGS", "64"))
"""Register caps for the "pp" configs (0: an even share); the environment sets them for a
register sweep of the compile (``--compile``) and the GPU run alike."""
# (B, ctx, n): the large shapes (32 query / 8 KV heads, D 128, page 16); ctx + n is a
# multiple of every config's BLOCK_N
SHAPES = [(8, 4032, 64), (32, 4032, 64), (64, 2016, 32), (16, 4096 - 128, 128), (4, 32640, 128)]


@gluon.jit
def _fresh_running(BLOCK_M: gl.constexpr, D: gl.constexpr, s_mma: gl.constexpr,
                   o_mma: gl.constexpr):  # fmt: skip
    """The online softmax's starting (row max -inf, row sum 0, accumulator 0) for BLOCK_M rows."""
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_mma))
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_mma))
    return m_i, l_i, gl.zeros([BLOCK_M, D], gl.float32, layout=o_mma)


@gluon.jit
def _copy_q(Q, q_s, i_b, i_kvh, i_t, n_nodes, s_qb, s_qn, s_qh, G: gl.constexpr,
            G_PAD: gl.constexpr, BLOCK_Q: gl.constexpr, D: gl.constexpr,
            num_warps: gl.constexpr):  # fmt: skip
    """cp.async of the program's Q tile into ``q_s`` (its own commit group): row r is node
    i_t * BLOCK_Q + r // G_PAD, query head i_kvh * G + r % G_PAD; rows past the nodes or the
    group are zero."""
    BLOCK_M: gl.constexpr = G_PAD * BLOCK_Q
    ld: gl.constexpr = KG._load_layout(D, num_warps)
    o_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
    o_d = gl.arange(0, D, layout=gl.SliceLayout(0, ld)).to(gl.int64)
    node = (i_t * BLOCK_Q + o_m // G_PAD).to(gl.int64)
    head = (i_kvh * G + o_m % G_PAD).to(gl.int64)
    ok = (node < n_nodes) & (o_m % G_PAD < G)
    p_q = Q + i_b * s_qb + (node * s_qn + head * s_qh)[:, None] + o_d[None, :]
    cp.async_copy_global_to_shared(q_s, p_q, mask=ok[:, None])
    cp.commit_group()


@gluon.jit
def _store_out(O, acc, l_i, i_b, i_kvh, i_t, n_nodes, s_ob, s_on, s_oh, o_mma: gl.constexpr,
               G: gl.constexpr, G_PAD: gl.constexpr, BLOCK_Q: gl.constexpr,
               D: gl.constexpr):  # fmt: skip
    """acc / l into the output rows of the program's tile (as ``_copy_q`` maps them)."""
    BLOCK_M: gl.constexpr = G_PAD * BLOCK_Q
    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_mma))[:, None]
    o_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_mma))
    o_d = gl.arange(0, D, layout=gl.SliceLayout(0, o_mma)).to(gl.int64)
    node = (i_t * BLOCK_Q + o_m // G_PAD).to(gl.int64)
    head = (i_kvh * G + o_m % G_PAD).to(gl.int64)
    ok = (node < n_nodes) & (o_m % G_PAD < G)
    p_o = O + i_b * s_ob + (node * s_on + head * s_oh)[:, None] + o_d[None, :]
    gl.store(p_o, out.to(gl.bfloat16), mask=ok[:, None])


@gluon.jit
def _prefix_attn(Q, K, V, O, BT, n_nodes, n_tiles, qk_scale,
                 s_qb, s_qn, s_qh, s_kp, s_ks, s_kh, s_vp, s_vs, s_vh, s_ob, s_on, s_oh, s_btb,
                 H_KV: gl.constexpr, G: gl.constexpr, G_PAD: gl.constexpr, BLOCK_Q: gl.constexpr,
                 BLOCK_N: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, LA: gl.constexpr,
                 P_IN_SMEM: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """treeops' Gluon prefix loop (``tree_attention_gluon._prefix``) over ``n_tiles`` full tiles
    from key 0, framed by a Q load and an output store."""
    BLOCK_M: gl.constexpr = G_PAD * BLOCK_Q
    SK: gl.constexpr = LA + 1
    SV: gl.constexpr = LA + 2
    ld: gl.constexpr = KG._load_layout(D, num_warps)
    s_mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, D, 16]
    )
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_mma, k_width=2)
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], gl.bfloat16)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.bfloat16)

    i_bh = gl.program_id(0)
    i_t = gl.program_id(1)
    i_b = (i_bh // H_KV).to(gl.int64)
    i_kvh = i_bh % H_KV
    q_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, D], q_sl)
    _copy_q(Q, q_s, i_b, i_kvh, i_t, n_nodes, s_qb, s_qn, s_qh, G, G_PAD, BLOCK_Q, D, num_warps)
    o_dl = gl.arange(0, D, layout=gl.SliceLayout(0, ld)).to(gl.int64)
    k_s = gl.allocate_shared_memory(gl.bfloat16, [SK, BLOCK_N, D], kv_sl)
    v_s = gl.allocate_shared_memory(gl.bfloat16, [SV, BLOCK_N, D], kv_sl)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_N], p_sl)
    o_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    m_i, l_i, acc = _fresh_running(BLOCK_M, D, s_mma, o_mma)
    acc, m_i, l_i = KG._prefix(
        K, V, q_s, k_s, v_s, p_s, BT + i_b * s_btb, 0, n_tiles, acc, m_i, l_i, qk_scale, o_n, o_dl,
        i_kvh.to(gl.int64) * s_kh, i_kvh.to(gl.int64) * s_vh, s_kp, s_ks, s_vp, s_vs, s_mma, o_mma,
        p_op, BLOCK_M, BLOCK_N, PAGE, LA, SK, SV, P_IN_SMEM,
    )  # fmt: skip

    _store_out(O, acc, l_i, i_b, i_kvh, i_t, n_nodes, s_ob, s_on, s_oh, o_mma, G, G_PAD, BLOCK_Q,
               D)  # fmt: skip


@gluon.jit
def _ws_producer(K, V, BT, k_s, v_s, ready, empty, i_b, i_kvh, n_tiles, s_kp, s_ks, s_kh, s_vp,
                 s_vs, s_vh, s_btb, BLOCK_N: gl.constexpr, D: gl.constexpr,
                 PAGE: gl.constexpr, S: gl.constexpr):  # fmt: skip
    """One warp: tile t's K and V into stage t % S once the consumers released it, then an
    arrival on ``ready[t % S]`` when this warp's copies have landed (32 arrivals a phase)."""
    ld: gl.constexpr = KG._load_layout(D, 1)
    o_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    o_d = gl.arange(0, D, layout=gl.SliceLayout(0, ld)).to(gl.int64)
    p_bt = BT + i_b * s_btb
    off_kh = i_kvh * s_kh
    off_vh = i_kvh * s_vh
    for t in range(n_tiles):
        st = t % S
        # stage st was last used by tile t - S; a fresh barrier passes the first round's wait
        mbarrier.wait(empty.index(st), ((t // S) & 1) ^ 1)
        pos = t * BLOCK_N + o_n
        page = gl.load(p_bt + pos // PAGE).to(gl.int64)
        slot = (pos % PAGE).to(gl.int64)
        p_k = K + (page * s_kp + slot * s_ks + off_kh)[:, None] + o_d[None, :]
        cp.async_copy_global_to_shared(k_s.index(st), p_k)
        p_v = V + (page * s_vp + slot * s_vs + off_vh)[:, None] + o_d[None, :]
        cp.async_copy_global_to_shared(v_s.index(st), p_v)
        cp.mbarrier_arrive(ready.index(st), increment_count=False)


@gluon.jit
def _ws_consumer(q_s, k_s, v_s, p_s, ready, empty, n_tiles, qk_scale, O, i_b, i_kvh, i_t,
                 n_nodes, s_ob, s_on, s_oh, G: gl.constexpr, G_PAD: gl.constexpr,
                 BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                 S: gl.constexpr, P_IN_SMEM: gl.constexpr,
                 num_warps: gl.constexpr):  # fmt: skip
    """The loop of ``tree_attention_gluon._prefix`` with the copies in the producer warp: tile
    j's K and V wait on ``ready``, and tile j - 1's stage goes back to the producer (``empty``)
    once its PV is done."""
    BLOCK_M: gl.constexpr = G_PAD * BLOCK_Q
    s_mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, D, 16]
    )
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_mma, k_width=2)
    zeros_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_mma)
    m_i, l_i, acc = _fresh_running(BLOCK_M, D, s_mma, o_mma)
    mbarrier.wait(ready.index(0), 0)
    fence_async_shared()
    s = warpgroup_mma(q_s, k_s.index(0).permute((1, 0)), zeros_s, use_acc=False)
    p, alpha, m_i, l_i = KG._softmax(s, m_i, l_i, qk_scale)
    for j in range(1, n_tiles):
        mbarrier.wait(ready.index(j % S), (j // S) & 1)
        fence_async_shared()
        s_tok = warpgroup_mma(q_s, k_s.index(j % S).permute((1, 0)), zeros_s, use_acc=False,
                              is_async=True)  # fmt: skip
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_mma))[:, None]
        acc_tok = KG._pv(p, p_s, v_s.index((j - 1) % S), acc, P_IN_SMEM, p_op)
        s = warpgroup_mma_wait(1, deps=(s_tok,))
        p, alpha, m_i, l_i = KG._softmax(s, m_i, l_i, qk_scale)
        acc = warpgroup_mma_wait(0, deps=(acc_tok,))
        mbarrier.arrive(empty.index((j - 1) % S), count=1)  # tile j - 1 done with
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_mma))[:, None]
    acc_tok = KG._pv(p, p_s, v_s.index((n_tiles - 1) % S), acc, P_IN_SMEM, p_op)
    acc = warpgroup_mma_wait(0, deps=(acc_tok,))

    _store_out(O, acc, l_i, i_b, i_kvh, i_t, n_nodes, s_ob, s_on, s_oh, o_mma, G, G_PAD, BLOCK_Q,
               D)  # fmt: skip


@gluon.jit
def _prefix_attn_ws(Q, K, V, O, BT, n_nodes, n_tiles, qk_scale,
                    s_qb, s_qn, s_qh, s_kp, s_ks, s_kh, s_vp, s_vs, s_vh, s_ob, s_on, s_oh, s_btb,
                    H_KV: gl.constexpr, G: gl.constexpr, G_PAD: gl.constexpr,
                    BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                    PAGE: gl.constexpr, S: gl.constexpr, P_IN_SMEM: gl.constexpr,
                    num_warps: gl.constexpr):  # fmt: skip
    """The probe's loop warp-specialised: ``num_warps`` consumer warps compute, one producer warp
    copies K/V through the block table into an S-stage ring (mbarriers ``ready``/``empty``)."""
    BLOCK_M: gl.constexpr = G_PAD * BLOCK_Q
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], gl.bfloat16)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16)
    i_bh = gl.program_id(0)
    i_t = gl.program_id(1)
    i_b = (i_bh // H_KV).to(gl.int64)
    i_kvh = (i_bh % H_KV).to(gl.int64)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, D], q_sl)
    _copy_q(Q, q_s, i_b, i_kvh, i_t, n_nodes, s_qb, s_qn, s_qh, G, G_PAD, BLOCK_Q, D, num_warps)
    k_s = gl.allocate_shared_memory(gl.bfloat16, [S, BLOCK_N, D], kv_sl)
    v_s = gl.allocate_shared_memory(gl.bfloat16, [S, BLOCK_N, D], kv_sl)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.bfloat16)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_N], p_sl)
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(S):
        mbarrier.init(ready.index(i), count=32)  # the producer warp's 32 threads
        mbarrier.init(empty.index(i), count=1)  # the consumers, once (a partition-wide arrive)
    cp.wait_group(0)
    fence_async_shared()
    gl.thread_barrier()
    gl.warp_specialize(
        [
            (_ws_consumer, (q_s, k_s, v_s, p_s, ready, empty, n_tiles, qk_scale, O, i_b, i_kvh,
                            i_t, n_nodes, s_ob, s_on, s_oh, G, G_PAD, BLOCK_Q, BLOCK_N, D, S,
                            P_IN_SMEM, num_warps)),
            (_ws_producer, (K, V, BT, k_s, v_s, ready, empty, i_b, i_kvh, n_tiles, s_kp, s_ks,
                            s_kh, s_vp, s_vs, s_vh, s_btb, BLOCK_N, D, PAGE, S)),
        ],
        [1],
        [64],
    )  # fmt: skip


@gluon.jit
def _pp_consumer(c: gl.constexpr, q_s, k_s, v_s, ready, empty, turn, n_tiles, qk_scale, O, i_b,
                 i_kvh, i_t, n_nodes, s_ob, s_on, s_oh, G: gl.constexpr, G_PAD: gl.constexpr,
                 BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                 S: gl.constexpr):  # fmt: skip
    """Warpgroup ``c`` of two, on its 64 rows (nodes of half-tile 2 * i_t + c): the loop of
    ``_ws_consumer`` (P in registers) with each iteration's two wgmmas issued only on this
    warpgroup's turn (``turn[c]``), the turn passed to the other right after, so that one
    warpgroup's softmax runs while the other's wgmmas hold the tensor cores. Warpgroup 0 starts
    (a fresh barrier passes the parity-1 wait); each ring stage is released by both (``empty``
    counts 2)."""
    BLOCK_M: gl.constexpr = 64
    s_mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16]
    )
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_mma, k_width=2)
    mine = turn.index(c)
    theirs = turn.index(1 - c)
    q_c = q_s.index(c)
    zeros_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_mma)
    m_i, l_i, acc = _fresh_running(BLOCK_M, D, s_mma, o_mma)
    mbarrier.wait(ready.index(0), 0)
    fence_async_shared()
    mbarrier.wait(mine, 1 - c)
    s_tok = warpgroup_mma(q_c, k_s.index(0).permute((1, 0)), zeros_s, use_acc=False,
                          is_async=True)  # fmt: skip
    mbarrier.arrive(theirs, count=1)
    s = warpgroup_mma_wait(0, deps=(s_tok,))
    p, alpha, m_i, l_i = KG._softmax(s, m_i, l_i, qk_scale)
    for j in range(1, n_tiles):
        if j >= 2:
            # tile j - 2's stage back to the producer (its PV was waited for last iteration;
            # released here, not there, so that no side effect follows that wait and ptxas
            # keeps the softmax's exp2s ahead of it)
            mbarrier.arrive(empty.index((j - 2) % S), count=1)
        mbarrier.wait(ready.index(j % S), (j // S) & 1)
        fence_async_shared()
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_mma))[:, None]
        # turn j of this warpgroup: the other arrived once per tile before it
        mbarrier.wait(mine, (j & 1) ^ (1 - c))
        s_tok = warpgroup_mma(q_c, k_s.index(j % S).permute((1, 0)), zeros_s, use_acc=False,
                              is_async=True)  # fmt: skip
        acc_tok = KG._pv(p, p, v_s.index((j - 1) % S), acc, False, p_op)
        mbarrier.arrive(theirs, count=1)
        s = warpgroup_mma_wait(1, deps=(s_tok,))
        p, alpha, m_i, l_i = KG._softmax(s, m_i, l_i, qk_scale)
        acc = warpgroup_mma_wait(0, deps=(acc_tok,))
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_mma))[:, None]
    acc_tok = KG._pv(p, p, v_s.index((n_tiles - 1) % S), acc, False, p_op)
    acc = warpgroup_mma_wait(0, deps=(acc_tok,))
    _store_out(O, acc, l_i, i_b, i_kvh, 2 * i_t + c, n_nodes, s_ob, s_on, s_oh, o_mma, G, G_PAD,
               BLOCK_Q // 2, D)  # fmt: skip


@gluon.jit
def _prefix_attn_pp(Q, K, V, O, BT, n_nodes, n_tiles, qk_scale,
                    s_qb, s_qn, s_qh, s_kp, s_ks, s_kh, s_vp, s_vs, s_vh, s_ob, s_on, s_oh, s_btb,
                    H_KV: gl.constexpr, G: gl.constexpr, G_PAD: gl.constexpr,
                    BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                    PAGE: gl.constexpr, S: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                    PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """FlashAttention-3's inter-warpgroup overlap on the probe's loop: two consumer warpgroups
    (the default partition and a worker, 64 rows each, ``num_warps`` = 4) whose wgmmas take
    turns (mbarriers ``turn``), and ``_ws_producer``'s warp filling an S-stage K/V ring."""
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, D], gl.bfloat16)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16)
    i_bh = gl.program_id(0)
    i_t = gl.program_id(1)
    i_b = (i_bh // H_KV).to(gl.int64)
    i_kvh = (i_bh % H_KV).to(gl.int64)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, D], q_sl)
    for c in gl.static_range(2):
        _copy_q(Q, q_s.index(c), i_b, i_kvh, 2 * i_t + c, n_nodes, s_qb, s_qn, s_qh, G, G_PAD,
                BLOCK_Q // 2, D, num_warps)  # fmt: skip
    k_s = gl.allocate_shared_memory(gl.bfloat16, [S, BLOCK_N, D], kv_sl)
    v_s = gl.allocate_shared_memory(gl.bfloat16, [S, BLOCK_N, D], kv_sl)
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(S):
        mbarrier.init(ready.index(i), count=32)  # the producer warp's 32 threads
        mbarrier.init(empty.index(i), count=2)  # each consumer warpgroup once
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    cp.wait_group(0)
    fence_async_shared()
    gl.thread_barrier()
    gl.warp_specialize(
        [
            (_pp_consumer, (0, q_s, k_s, v_s, ready, empty, turn, n_tiles, qk_scale, O, i_b,
                            i_kvh, i_t, n_nodes, s_ob, s_on, s_oh, G, G_PAD, BLOCK_Q, BLOCK_N, D,
                            S)),
            (_pp_consumer, (1, q_s, k_s, v_s, ready, empty, turn, n_tiles, qk_scale, O, i_b,
                            i_kvh, i_t, n_nodes, s_ob, s_on, s_oh, G, G_PAD, BLOCK_Q, BLOCK_N, D,
                            S)),
            (_ws_producer, (K, V, BT, k_s, v_s, ready, empty, i_b, i_kvh, n_tiles, s_kp, s_ks,
                            s_kh, s_vp, s_vs, s_vh, s_btb, BLOCK_N, D, PAGE, S)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )  # fmt: skip


def prefix_attention(q, k_cache, v_cache, block_table, kv_len, scale, out, config):
    """out [B, n, H_q, D] = softmax(q k^T * scale) v over the first ``kv_len`` keys of every
    request (all visible; ``kv_len`` a multiple of the config's BLOCK_N); bf16, unit last
    strides."""
    block_m, block_n, warps, la, p_smem, mode = CONFIGS[config]
    B, n, hq, D = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    g_pad = triton.next_power_of_2(g)
    block_q = block_m // g_pad
    if kv_len % block_n or kv_len < block_n:
        raise ValueError(f"kv_len must be a positive multiple of {block_n}, got {kv_len}")
    grid = (B * hkv, triton.cdiv(n, block_q))
    args = (
        q, k_cache, v_cache, out, block_table, n, kv_len // block_n, scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2), block_table.stride(0),
    )  # fmt: skip
    tiles = dict(H_KV=hkv, G=g, G_PAD=g_pad, BLOCK_Q=block_q, BLOCK_N=block_n, D=D, PAGE=page)
    if mode == "ws":
        # the consumers' warps and the producer's warpgroup share the SM's 64K registers: a cap
        # per thread over all of them (Gluon moves the producer's spare ones to the consumers)
        cap = min(255, 65536 // (32 * (warps + 4))) // 8 * 8
        _prefix_attn_ws[grid](*args, **tiles, S=la, P_IN_SMEM=p_smem, num_warps=warps, maxnreg=cap)
    elif mode == "pp":
        # three warpgroups' worth of registers (two consumers, the producer's warp padded to
        # one): a cap per thread over all of them, the worker consumer given the same
        cap = PP_REGS or min(255, 65536 // (32 * 3 * warps)) // 8 * 8
        _prefix_attn_pp[grid](*args, **tiles, S=la, CONSUMER_REGS=PP_WORKER_REGS or cap,
                              PRODUCER_REGS=PP_PRODUCER_REGS, num_warps=warps,
                              maxnreg=cap)  # fmt: skip
    else:
        _prefix_attn[grid](*args, **tiles, LA=la, P_IN_SMEM=p_smem, num_warps=warps)
    return out


def ex2_in_flight(cubin: bytes, run) -> tuple[int, int]:
    """(MUFU.EX2 issued while a wgmma group is pending, all MUFU.EX2) in the SASS, in program
    order (``run``: compile_check's tool runner). A group ends at an HGMMA marked ``gsb0``;
    ``WARPGROUP.DEPBAR.LE gsb0, N`` leaves at most N pending."""
    import compile_check as CC

    sass = run([CC._tool("cuobjdump"), "-sass"], cubin, ".cubin").splitlines()
    pending = overlapped = total = 0
    for line in sass:
        if "HGMMA" in line and "gsb0" in line:
            pending += 1
        elif "WARPGROUP.DEPBAR.LE" in line:
            m = re.search(r"gsb0, 0x([0-9a-f]+)", line)
            pending = min(pending, int(m.group(1), 16)) if m else 0
        elif "MUFU.EX2" in line:
            total += 1
            overlapped += pending > 0
    return overlapped, total


def compile_rows() -> list[dict]:
    """Every config compiled for sm_90 on this machine (no GPU): resources and the EX2 overlap."""
    sys.path.insert(0, os.path.dirname(__file__))
    import compile_check as CC

    CC.ARCH = 90
    CC._install()
    rows = []
    B, n, hq, hkv, D, page = 2, 64, 32, 8, 128, 16
    for name, (_, block_n, *_) in CONFIGS.items():
        kv_len = 4 * block_n
        q = torch.zeros(B, n, hq, D, dtype=torch.bfloat16)
        kc = torch.zeros(B * kv_len // page, page, hkv, D, dtype=torch.bfloat16)
        bt = torch.arange(B * kv_len // page, dtype=torch.int32).view(B, -1)
        start = len(CC._COMPILED)
        prefix_attention(q, kc, kc, bt, kv_len, D**-0.5, torch.empty_like(q), name)
        kernel = CC._COMPILED[start][1]
        row = {"config": name, **CC.resources(kernel)}
        row["ex2_overlapped_total"] = ex2_in_flight(kernel.asm["cubin"], CC._run)
        notes = CC._run([CC._tool("ptxas"), "-v", "--gpu-name", "sm_90a", "-o", os.devnull],
                        kernel.asm["ptx"], ".ptx")  # fmt: skip
        # C7514: ptxas serialised the wgmmas (a wait after every one), the pipeline gone
        row["wgmma_serialized"] = "C7514" in notes
        rows.append(row)
        print(
            f"{name:<14} regs {row['regs']:>3} spill {row['spill_store_bytes']:>4} shared "
            f"{row['shared_bytes']:>6}  EX2 under a pending wgmma / all "
            f"{row['ex2_overlapped_total']}{'  SERIALIZED' if row['wgmma_serialized'] else ''}",
            flush=True,
        )
    return rows


def gpu_rows(configs, shapes=SHAPES, dev="cuda") -> list[dict]:
    """Each shape: the fp32 reference (every key visible), each config's error and µs, and
    treeops' kernel on the same caches (``dev``: "cpu" only for the harness's own test, with
    stand-ins for both kernels)."""
    import bench_tree_attention as BT
    import harness as H

    rows = []
    for B, ctx, n in shapes:
        c = BT.Case(B, ctx, n, dev=dev)
        L = ctx + n
        ref = full_reference(c)
        floor, _, flops = BT.floor_us(B, ctx, n)
        fn, _ = BT.kernel_fn(c)
        t_tree, _ = H.time_any(fn, device=dev)
        row = {"B": B, "ctx": ctx, "n": n, "floor_us": floor, "flops": flops,
               "treeops_us": t_tree, "treeops_tflops": flops / t_tree / 1e6}  # fmt: skip
        for name in configs:
            out = torch.empty_like(c.q)
            try:
                args = (c.q, c.k_cache, c.v_cache, c.block_table, L, c.scale, out, name)
                prefix_attention(*args)
                if dev == "cuda":
                    torch.cuda.synchronize()
                err = BT.rel_err(out, ref)
                t, _ = H.time_any(lambda args=args: prefix_attention(*args), device=dev)
                row[name] = {"us": t, "err": err, "ok": err <= BT.TOL, "tflops": flops / t / 1e6}
            except Exception as e:  # a config that fails to compile or launch is recorded
                row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def full_reference(c) -> torch.Tensor:
    """fp32 attention of every query over all ctx + n keys of its request: [B, n, H_q, D]."""
    L = c.ctx + c.n
    ref = torch.empty(c.B, c.n, c.hq, c.d, dtype=torch.float32, device=c.q.device)
    for b in range(c.B):
        pages = c.block_table[b].long()
        k = c.k_cache[pages].reshape(-1, c.hkv, c.d)[:L].float().repeat_interleave(c.hq // c.hkv, 1)
        v = c.v_cache[pages].reshape(-1, c.hkv, c.d)[:L].float().repeat_interleave(c.hq // c.hkv, 1)
        s = torch.einsum("nhd,lhd->hnl", c.q[b].float(), k) * c.scale
        ref[b] = torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), v)
    return ref


def isolated_rows(configs, out_dir) -> list[dict]:
    """``gpu_rows`` per config in its own process (a config that faults the GPU cannot take the
    others with it), merged by shape; ``treeops_us`` is the median of the processes' runs."""
    import statistics
    import subprocess

    merged: dict = {}
    for name in configs:
        sub = os.path.join(out_dir, f"probe_{name}")
        cmd = [sys.executable, __file__, "--configs", name, "--out", sub]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            failed = proc.returncode != 0 and (proc.stdout + proc.stderr)[-600:]
        except subprocess.TimeoutExpired:
            failed = "timed out after 120 s"
        path = os.path.join(sub, "gluon_attention_probe.json")
        rows = json.load(open(path))["rows"] if os.path.exists(path) else []
        for r in rows:
            m = merged.setdefault((r["B"], r["ctx"], r["n"]), {**r, "treeops_runs": []})
            m["treeops_runs"].append(r["treeops_us"])
            m[name] = r[name]
        if failed:
            print(f"{name}: {failed}", flush=True)
            for m in merged.values():
                m.setdefault(name, {"error": str(failed)[-300:]})
    for m in merged.values():
        m["treeops_us"] = statistics.median(m["treeops_runs"])
        m["treeops_tflops"] = m["flops"] / m["treeops_us"] / 1e6
    return list(merged.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compile", action="store_true", help="compile for sm_90 only (no GPU)")
    ap.add_argument("--out", help="directory for gluon_attention_probe.json")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma list of CONFIGS names")
    args = ap.parse_args(argv)
    configs = args.configs.split(",")
    if args.compile:
        rows = compile_rows()
    elif not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --compile)")
    elif len(configs) > 1:
        if not args.out:
            ap.error("several configs run one process each and need --out")
        rows = isolated_rows(configs, args.out)
    else:
        sys.path.insert(0, os.path.dirname(__file__))
        rows = gpu_rows(configs)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gluon_attention_probe.json"), "w") as f:
            json.dump({"rows": rows, "mode": "compile" if args.compile else "gpu"}, f, indent=1)
    if not args.compile:
        for r in rows:
            timed = [(v["us"], k) for k, v in r.items() if isinstance(v, dict) and v.get("ok")]
            best = f"{min(timed)[1]} {min(timed)[0]:.1f} µs" if timed else "none correct"
            print(f"B {r['B']:>2} ctx {r['ctx']:>5} n {r['n']:>3}: treeops {r['treeops_us']:.1f} "
                  f"µs ({r['treeops_tflops']:.0f} TF), probe best {best}, floor "
                  f"{r['floor_us']:.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
