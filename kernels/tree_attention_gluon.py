"""Tree attention's forward in Gluon for Hopper (sm_90): the same contract, grid and split-KV
workspace as ``tree_attention._tree_attn_fwd``, with the prefix loop's waits placed by hand.

Why Gluon: compiled for sm_90, Triton waits for every QK^T wgmma right after issuing it, so a
program's softmax never runs while its tensor cores do (docs/benchmarks.md, "Tree attention's
softmax and MMAs"). Here each full prefix tile j issues QK^T of tile j and PV of tile j - 1 back
to back, waits for the older (the scores), runs tile j's softmax while the PV is on the tensor
cores, then waits for the PV (FlashAttention-3's intra-warpgroup overlap). ptxas may still move
that wait ahead of the exp2s: for sm_90 the unsplit 128x64 build keeps 34 of its 136 under the
PV, the split one none (with P in shared memory, the other way round). K/V tiles come through
the block table by ``cp.async`` into shared-memory rings ``LA`` tiles ahead of use (K: LA + 1
stages, V: LA + 2: tile j - 1's K and tile j - 2's V are free at iteration j's barrier). Each
iteration issues its two wgmmas before its copies, whose page ids were loaded an iteration
earlier, so no warp waits on the block table before the tensor cores have work. Every iteration
ends with no wgmma in flight and the loop has no branch: a wgmma pending across the back edge, or
waits under a branch, make ptxas serialise every wgmma (its note C7514), which
``bench/gluon_attention_probe.py --compile`` checks.

The tail tile (keys up to the prefix length) and the tree's tiles (keys visible by the ``anc``
words, as the Triton kernel reads them) run after the prefix, one synchronous tile at a time.
Rows outside the query range are written as the Triton kernel writes them (0 and LSE -inf); split
launches write fp32 partials and LSEs for ``_merge_splits``. With ``TREEOPS_PDL`` set
(kernels/_pdl.py), a program waits for the kernel before it first, and lets the merge be placed
once its key loops are done.

A launch configuration chooses this kernel with ``gluon=True`` (``tree_attention_config``): 16-bit
q and caches, head dim 64 or 128, unit last strides and 16-byte aligned rows (``launchable``);
anywhere else, and under the interpreter (which has no Gluon), the Triton kernel runs.
"""

from __future__ import annotations

import torch

try:  # Gluon ships with Triton 3.5+; older Tritons run the Triton kernel
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
except ImportError:  # pragma: no cover - exercised only with an old Triton
    gluon = None

AVAILABLE = gluon is not None
"""Whether this Triton has Gluon (else ``launchable`` is always False)."""


def launchable(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out) -> bool:
    """Whether this kernel can take the call: Gluon present, a Hopper GPU (``device_ok``), bf16
    or fp16 q and caches of one dtype, head dim 64 or 128, and q, the caches and the output with
    unit last strides, 16-byte aligned base pointers and every other stride a multiple of 8
    elements (``cp.async`` copies 16-byte vectors)."""
    if not AVAILABLE or not device_ok(q):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] not in (64, 128):
        return False
    for t in (q, k_cache, v_cache, out):
        if t.dtype != q.dtype or t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any(s % 8 for s in t.stride()[:-1]):
            return False
    return True


def device_ok(q: torch.Tensor) -> bool:
    """A CUDA tensor on a compute capability 9 GPU (wgmma; ``bench/compile_check.py`` replaces
    this to compile the kernel without one)."""
    return q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9


if AVAILABLE:

    @gluon.constexpr_function
    def _load_layout(D, num_warps):
        """Blocked layout of a [rows, D] tile: 16-byte vectors along D, the rest of a warp on
        rows."""
        tpw_d = min(32, D // 8)
        return gl.BlockedLayout([1, 8], [32 // tpw_d, tpw_d], [num_warps, 1], [1, 0])

    @gluon.jit
    def _pages(p_bt, k0, t, o_n, BLOCK_N: gl.constexpr, PAGE: gl.constexpr, n_tiles):
        """int64 page ids of full tile t's keys (k0 + t * BLOCK_N ...); 0 past the last tile."""
        live = (o_n * 0 + t) < n_tiles
        return gl.load(p_bt + (k0 + t * BLOCK_N + o_n) // PAGE, mask=live, other=0).to(gl.int64)

    @gluon.jit
    def _copy_tile(K, V, k_s, v_s, page, k0, t, o_n, o_d, off_kh, off_vh, s_kp, s_ks, s_vp, s_vs,
                   BLOCK_N: gl.constexpr, PAGE: gl.constexpr, SK: gl.constexpr,
                   SV: gl.constexpr, n_tiles):  # fmt: skip
        """cp.async of full tile t (keys k0 + t * BLOCK_N ..., on pages ``page``) of K and V,
        this KV head, into ring stages t % SK and t % SV, as one commit group; past the last
        tile the copies are masked (zero-filled)."""
        slot = ((k0 + t * BLOCK_N + o_n) % PAGE).to(gl.int64)
        ok = ((o_n * 0 + t) < n_tiles)[:, None]
        p_k = K + (page * s_kp + slot * s_ks + off_kh)[:, None] + o_d[None, :]
        cp.async_copy_global_to_shared(k_s.index(t % SK), p_k, mask=ok)
        p_v = V + (page * s_vp + slot * s_vs + off_vh)[:, None] + o_d[None, :]
        cp.async_copy_global_to_shared(v_s.index(t % SV), p_v, mask=ok)
        cp.commit_group()

    @gluon.jit
    def _landed(LA: gl.constexpr):
        """Wait until all but the newest LA - 1 copy groups have landed, make them visible to
        the wgmma's async proxy, and meet every warp (every warp is then also past its previous
        iteration's waits, so the stages those read are free)."""
        cp.wait_group(LA - 1)
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _griddepcontrol(WAIT: gl.constexpr):
        """``griddepcontrol.wait`` (``WAIT``) or ``.launch_dependents``, as kernels/_pdl.py's
        Triton helpers issue them."""
        if WAIT:
            gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [],
                                      dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip
        else:
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                                      dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip

    @gluon.jit
    def _pdl_enter(PDL: gl.constexpr):
        """kernels/_pdl.py's ``pdl_enter`` in Gluon (PDL 0 off, 1 late release, 2 early)."""
        if PDL == 2:
            _griddepcontrol(False)
        if PDL != 0:
            _griddepcontrol(True)

    @gluon.jit
    def _pdl_release(PDL: gl.constexpr):
        """kernels/_pdl.py's ``pdl_release`` in Gluon."""
        if PDL == 1:
            _griddepcontrol(False)

    @gluon.jit
    def _softmax(s, m_i, l_i, qk_scale):
        """Online softmax of a tile of scores whose keys are all visible: (p, alpha, m, l), log2
        domain."""
        s = s * qk_scale
        m_new = gl.maximum(m_i, gl.max(s, 1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)

    @gluon.jit
    def _pv(p, p_s, v, acc, P_IN_SMEM: gl.constexpr, p_op: gl.constexpr):
        """Issue acc += p v (async): p as the wgmma's A operand in registers, or (``P_IN_SMEM``)
        stored to ``p_s`` first."""
        if P_IN_SMEM:
            p_s.store(p.to(p_s.dtype))
            fence_async_shared()
            gl.thread_barrier()
            return warpgroup_mma(p_s, v, acc, is_async=True)
        else:
            return warpgroup_mma(gl.convert_layout(p.to(v.dtype), p_op), v, acc, is_async=True)

    @gluon.jit
    def _prefix(K, V, q_s, k_s, v_s, p_s, p_bt, k0, n_tiles, acc, m_i, l_i, qk_scale, o_n, o_d,
                off_kh, off_vh, s_kp, s_ks, s_vp, s_vs, s_mma: gl.constexpr, o_mma: gl.constexpr,
                p_op: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                PAGE: gl.constexpr, LA: gl.constexpr, SK: gl.constexpr, SV: gl.constexpr,
                P_IN_SMEM: gl.constexpr):  # fmt: skip
        """``n_tiles`` >= 1 full prefix tiles from key ``k0``, every key visible, into the
        running (acc, m, l); ends with no copy or wgmma in flight. Each iteration issues its two
        wgmmas first, then the copies of tile j + LA (their page ids loaded an iteration
        earlier, so no warp waits on the block table before issuing), then loads the next page
        ids."""
        for t in gl.static_range(LA):  # tiles 0 .. LA-1 in flight before the first wait
            pg = _pages(p_bt, k0, t, o_n, BLOCK_N, PAGE, n_tiles)
            _copy_tile(K, V, k_s, v_s, pg, k0, t, o_n, o_d, off_kh, off_vh, s_kp, s_ks, s_vp,
                       s_vs, BLOCK_N, PAGE, SK, SV, n_tiles)  # fmt: skip
        pg = _pages(p_bt, k0, LA, o_n, BLOCK_N, PAGE, n_tiles)
        zeros_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_mma)
        # tile 0: its scores and softmax; its PV waits for iteration 1 (or the end)
        _landed(LA)
        s_tok = warpgroup_mma(q_s, k_s.index(0).permute((1, 0)), zeros_s, use_acc=False,
                              is_async=True)  # fmt: skip
        _copy_tile(K, V, k_s, v_s, pg, k0, LA, o_n, o_d, off_kh, off_vh, s_kp, s_ks, s_vp, s_vs,
                   BLOCK_N, PAGE, SK, SV, n_tiles)  # fmt: skip
        pg = _pages(p_bt, k0, LA + 1, o_n, BLOCK_N, PAGE, n_tiles)
        s = warpgroup_mma_wait(0, deps=(s_tok,))
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale)
        for j in range(1, n_tiles):
            _landed(LA)  # K_j, V_{j-1} landed; tile j-1's K and tile j-2's V stages are free
            s_tok = warpgroup_mma(q_s, k_s.index(j % SK).permute((1, 0)), zeros_s,
                                  use_acc=False, is_async=True)  # fmt: skip
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_mma))[:, None]
            acc_tok = _pv(p, p_s, v_s.index((j - 1) % SV), acc, P_IN_SMEM, p_op)
            _copy_tile(K, V, k_s, v_s, pg, k0, j + LA, o_n, o_d, off_kh, off_vh, s_kp, s_ks,
                       s_vp, s_vs, BLOCK_N, PAGE, SK, SV, n_tiles)  # fmt: skip
            pg = _pages(p_bt, k0, j + LA + 1, o_n, BLOCK_N, PAGE, n_tiles)
            s = warpgroup_mma_wait(1, deps=(s_tok,))  # the scores; the PV may still run
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale)
            acc = warpgroup_mma_wait(0, deps=(acc_tok,))
        # the last tile's PV; then no copy in flight (the masked ones past the end included)
        cp.wait_group(0)
        fence_async_shared()
        gl.thread_barrier()
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_mma))[:, None]
        acc_tok = _pv(p, p_s, v_s.index((n_tiles - 1) % SV), acc, P_IN_SMEM, p_op)
        acc = warpgroup_mma_wait(0, deps=(acc_tok,))
        gl.thread_barrier()  # every warp done with the rings before anyone refills them
        return acc, m_i, l_i

    @gluon.jit
    def _masked_tile(K, V, q_s, k_s, v_s, p_s, p_bt, p_anc, t0, lo, hi, seq, m_row, acc, m_i,
                     l_i, qk_scale, o_n, o_d, off_kh, off_vh, s_kp, s_ks, s_vp, s_vs, N,
                     s_mma: gl.constexpr, o_mma: gl.constexpr, p_op: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, PAGE: gl.constexpr,
                     TREE: gl.constexpr, P_IN_SMEM: gl.constexpr):  # fmt: skip
        """Keys t0 .. t0 + BLOCK_N - 1, those in [lo, hi) only, synchronously: the prefix's tail
        (every such key visible) or (``TREE``) a tile of tree nodes, visible by ancestry (bit j
        of the row's ``anc`` words for node j = key - seq; t0 - seq is a multiple of BLOCK_N)."""
        pos = t0 + o_n
        m_k = (pos >= lo) & (pos < hi)
        page = gl.load(p_bt + pos // PAGE, mask=m_k, other=0).to(gl.int64)
        slot = (pos % PAGE).to(gl.int64)
        p_k = K + (page * s_kp + slot * s_ks + off_kh)[:, None] + o_d[None, :]
        cp.async_copy_global_to_shared(k_s.index(0), p_k, mask=m_k[:, None])
        p_v = V + (page * s_vp + slot * s_vs + off_vh)[:, None] + o_d[None, :]
        cp.async_copy_global_to_shared(v_s.index(0), p_v, mask=m_k[:, None])
        cp.commit_group()
        cp.wait_group(0)
        fence_async_shared()
        gl.thread_barrier()
        zeros_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_mma)
        s = warpgroup_mma(q_s, k_s.index(0).permute((1, 0)), zeros_s, use_acc=False)
        o_c = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_mma))
        pos_c = t0 + o_c
        vis = ((pos_c >= lo) & (pos_c < hi))[None, :] & m_row[:, None]
        if TREE:
            j0 = t0 - seq
            bits = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, layout=s_mma)
            for w in gl.static_range((BLOCK_N + 31) // 32):
                word = gl.load(p_anc + j0 // 32 + w, mask=m_row & (j0 + 32 * w < N), other=0)
                shifted = word[:, None] >> (o_c % 32)[None, :]
                bits = gl.where((o_c // 32 == w)[None, :], shifted, bits)
            vis = vis & ((bits & 1) != 0)
        s = gl.where(vis, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        # a row that has seen no key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_mma))[:, None]
        acc = warpgroup_mma_wait(0, deps=(_pv(p, p_s, v_s.index(0), acc, P_IN_SMEM, p_op),))
        gl.thread_barrier()  # every warp done with stage 0 before the next tile refills it
        return acc, m_new, l_i

    @gluon.jit
    def _tree_attn_fwd_gluon(Q, K, V, BT, SEQ, NN, ANC, QS, QL, O, L, WO, WL, qk_scale, N, H_KV,
                             s_qb, s_qn, s_qh, s_kp, s_ks, s_kh, s_vp, s_vs, s_vh, s_btb, s_ab,
                             s_an, s_ob, s_on, s_oh, s_lb, s_ln, s_lh, G: gl.constexpr,
                             G_PAD: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr,
                             D: gl.constexpr, PAGE_SIZE: gl.constexpr, NUM_SPLITS: gl.constexpr,
                             SPLIT_MIN_LEN: gl.constexpr, SPLIT_CHUNK: gl.constexpr,
                             HAS_QS: gl.constexpr, HAS_QL: gl.constexpr,
                             WRITE_LSE: gl.constexpr, LA: gl.constexpr, P_IN_SMEM: gl.constexpr,
                             num_warps: gl.constexpr, PDL: gl.constexpr = 0):  # fmt: skip
        BLOCK_M: gl.constexpr = G_PAD * BLOCK_Q
        SK: gl.constexpr = LA + 1
        SV: gl.constexpr = LA + 2
        dt: gl.constexpr = Q.dtype.element_ty
        ld: gl.constexpr = _load_layout(D, num_warps)
        s_mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, D, 16]
        )
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_mma, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_mma)
        row_o: gl.constexpr = gl.SliceLayout(1, o_mma)

        _pdl_enter(PDL)
        i_t = gl.program_id(0)
        i_bh = gl.program_id(1).to(gl.int64)
        i_s = gl.program_id(2)
        i_b = i_bh // H_KV
        i_kvh = i_bh % H_KV
        H_Q = H_KV * G

        seq = gl.load(SEQ + i_b)
        nn = gl.minimum(gl.load(NN + i_b), N)
        qs = 0
        if HAS_QS:
            qs = gl.load(QS + i_b)
        ql = N
        if HAS_QL:
            ql = gl.load(QL + i_b)
        q_end = gl.minimum(gl.minimum(qs + ql, nn), N)  # query nodes are [qs, q_end)
        qs = gl.maximum(qs, 0)
        kv_len = seq + nn
        # chunks this request uses (``_splits_used``); a tensor even unsplit: with a constant 1
        # Triton 3.6's lowering of this kernel to LLVM failed an assertion (sm_90)
        used = gl.minimum(gl.maximum(kv_len // SPLIT_CHUNK, 1), NUM_SPLITS)
        used = gl.where(kv_len < SPLIT_MIN_LEN, 1, used)

        # rows in the output's layout: query head and node of each row, whether it is queried
        o_mo = gl.arange(0, BLOCK_M, layout=row_o)
        o_do = gl.arange(0, D, layout=gl.SliceLayout(0, o_mma)).to(gl.int64)
        h_o = (i_kvh * G + o_mo % G_PAD).to(gl.int64)

        if (qs + i_t * BLOCK_Q < q_end) and (i_s < used):
            q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], dt)
            kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dt)
            p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dt)
            q_s = gl.allocate_shared_memory(dt, [BLOCK_M, D], q_sl)
            k_s = gl.allocate_shared_memory(dt, [SK, BLOCK_N, D], kv_sl)
            v_s = gl.allocate_shared_memory(dt, [SV, BLOCK_N, D], kv_sl)
            p_s = gl.allocate_shared_memory(dt, [BLOCK_M, BLOCK_N], p_sl)

            # Q rows: node qs + i_t * BLOCK_Q + r // G_PAD, query head i_kvh * G + r % G_PAD
            o_ml = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
            o_dl = gl.arange(0, D, layout=gl.SliceLayout(0, ld)).to(gl.int64)
            q_l = (qs + i_t * BLOCK_Q + o_ml // G_PAD).to(gl.int64)
            h_l = (i_kvh * G + o_ml % G_PAD).to(gl.int64)
            ok_l = (q_l < q_end) & (o_ml % G_PAD < G)
            p_q = Q + i_b * s_qb + (q_l * s_qn + h_l * s_qh)[:, None] + o_dl[None, :]
            cp.async_copy_global_to_shared(q_s, p_q, mask=ok_l[:, None])
            cp.commit_group()

            chunk = gl.cdiv(gl.cdiv(kv_len, used), BLOCK_N) * BLOCK_N
            start = i_s * chunk
            end = gl.minimum(start + chunk, kv_len)
            p_bt = BT + i_b * s_btb
            off_kh = i_kvh * s_kh
            off_vh = i_kvh * s_vh
            o_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))

            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
            l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
            acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_mma)
            # prefix: full tiles with every key visible, pipelined
            p_end = gl.minimum(end, seq)
            n_full = gl.maximum(p_end - start, 0) // BLOCK_N
            if n_full > 0:
                acc, m_i, l_i = _prefix(
                    K, V, q_s, k_s, v_s, p_s, p_bt, start, n_full, acc, m_i, l_i, qk_scale, o_n,
                    o_dl, off_kh, off_vh, s_kp, s_ks, s_vp, s_vs, s_mma, o_mma, p_op, BLOCK_M,
                    BLOCK_N, PAGE_SIZE, LA, SK, SV, P_IN_SMEM,
                )  # fmt: skip
            else:
                cp.wait_group(0)  # Q
                fence_async_shared()
                gl.thread_barrier()

            # the prefix's tail, then the tree's tiles, each masked
            o_q_s = (qs + i_t * BLOCK_Q + gl.arange(0, BLOCK_M, layout=row_s) // G_PAD).to(gl.int64)
            m_row_s = (o_q_s < q_end) & (gl.arange(0, BLOCK_M, layout=row_s) % G_PAD < G)
            tail = start + n_full * BLOCK_N
            if tail < p_end:
                acc, m_i, l_i = _masked_tile(
                    K, V, q_s, k_s, v_s, p_s, p_bt, ANC, tail, tail, p_end, seq, m_row_s, acc,
                    m_i, l_i, qk_scale, o_n, o_dl, off_kh, off_vh, s_kp, s_ks, s_vp, s_vs, N,
                    s_mma, o_mma, p_op, BLOCK_M, BLOCK_N, PAGE_SIZE, False, P_IN_SMEM,
                )  # fmt: skip
            p_anc = ANC + i_b * s_ab + o_q_s * s_an  # [BLOCK_M] word 0 of each row's bits
            t_first = seq + (gl.maximum(start - seq, 0) // BLOCK_N) * BLOCK_N
            for t0 in range(t_first, end, BLOCK_N):
                acc, m_i, l_i = _masked_tile(
                    K, V, q_s, k_s, v_s, p_s, p_bt, p_anc, t0, start, end, seq, m_row_s, acc,
                    m_i, l_i, qk_scale, o_n, o_dl, off_kh, off_vh, s_kp, s_ks, s_vp, s_vs, N,
                    s_mma, o_mma, p_op, BLOCK_M, BLOCK_N, PAGE_SIZE, True, P_IN_SMEM,
                )  # fmt: skip

            # the next launch (the merge) may be placed while the epilogues store; a
            # program that skips this branch releases it by exiting
            _pdl_release(PDL)
            l_o = gl.convert_layout(l_i, row_o)
            m_o = gl.convert_layout(m_i, row_o)
            seen = l_o > 0.0
            b_o = acc / gl.where(seen, l_o, 1.0)[:, None]
            lse = gl.where(seen, (m_o + gl.log2(gl.where(seen, l_o, 1.0))) * 0.6931471805599453,
                           float("-inf"))  # fmt: skip
            o_t = (i_t * BLOCK_Q + o_mo // G_PAD).to(gl.int64)  # query row relative to qs
            o_q = qs + o_t
            m_row = (o_q < q_end) & (o_mo % G_PAD < G)
            if used == 1:
                p_o = O + i_b * s_ob + (o_q * s_on + h_o * s_oh)[:, None] + o_do[None, :]
                gl.store(p_o, b_o.to(O.dtype.element_ty), mask=m_row[:, None])
                if WRITE_LSE:
                    gl.store(L + i_b * s_lb + o_q * s_ln + h_o * s_lh, lse, mask=m_row)
            else:
                # workspace [B, N, H_q, NUM_SPLITS, D] (+ LSEs [B, N, H_q, NUM_SPLITS]), by
                # relative row
                w_row = ((i_b * N + o_t) * H_Q + h_o) * NUM_SPLITS
                p_wo = WO + (w_row + i_s)[:, None] * D + o_do[None, :]
                gl.store(p_wo, b_o, mask=m_row[:, None])
                gl.store(WL + w_row + i_s, lse, mask=m_row)

        if (used == 1) and (i_s == 0):
            # rows of the absolute tile i_t outside the query range: 0, LSE -inf (split
            # requests: the merge kernel writes them). Written after the key loops: before them,
            # their [BLOCK_M, D] pointers would be shared with the epilogue's and stay live
            # across the loops, which spills the 128-key tiles
            r_abs = (i_t * BLOCK_Q + o_mo // G_PAD).to(gl.int64)
            m_zero = (r_abs < N) & (o_mo % G_PAD < G) & ((r_abs < qs) | (r_abs >= q_end))
            p_z = O + i_b * s_ob + (r_abs * s_on + h_o * s_oh)[:, None] + o_do[None, :]
            zeros_o = gl.zeros([BLOCK_M, D], O.dtype.element_ty, layout=o_mma)
            gl.store(p_z, zeros_o, mask=m_zero[:, None])
            if WRITE_LSE:
                neg = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_o)
                gl.store(L + i_b * s_lb + r_abs * s_ln + h_o * s_lh, neg, mask=m_zero)
