"""Tree-masked attention on the GPU: treeops against its peers and the physical floor.

    python bench/bench_tree_attention.py --out DIR [--shapes bench|all|layout] [--sweep
        [--configs NAME,...] [--auto]] [--no-flex]
    python bench/bench_tree_attention.py --out DIR --splits
    python bench/bench_tree_attention.py --out DIR --latency

For every shape, on the same tensors in one process: treeops (Triton); FlashInfer's custom-mask
prefill through its paged wrapper and through its ragged wrapper; FlashInfer's causal prefill on
the same shape (the cost with no tree); SDPA with a boolean mask; FlexAttention (compiled; failures
recorded). Each output is compared with an fp32 reference before it is timed; a mismatch is
reported instead of a time. treeops and FlashInfer's paged prefills (custom mask, causal) are
timed chained (``Rotation``): medians of CUDA-graph replays of many calls, each on its own copy of
the paged caches (together twice the L2), per call; ``*_single_us`` is the same call alone in a
graph, whose replay costs what the host takes to start it whatever the kernel (an empty
kernel's, ``empty_kernel_graph_us``). SDPA and FlashInfer's ragged
prefill are timed alone in a graph (CUDA events around eager calls where a peer cannot be
captured: the method is recorded per peer) and compared with ``treeops_single_us``.
``treeops_eager_us`` is one eager call with the host included (a call and a sync, median),
``treeops_prepared_eager_us`` the same through ``treeops.prepare`` (q, caches and output
rebound per call, as a layer loop calls it).
The floor is max(bytes / 4.3 TB/s, flops / 790 TFLOP/s) as docs/benchmarks.md defines it. Writes
``DIR/tree_attention.json`` (``gpu``, ``versions``, ``commit``, ``rows``) and prints a table
last. ``python -m pytest bench/bench_tree_attention.py --benchmark-only`` times treeops on the
docs/benchmarks.md shapes (FlashInfer's custom-mask prefill as the peer where it imports).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import time
import traceback

import harness as H
import pytest
import torch

import treeops

BENCH_SHAPES = [(1, 1024, 64), (1, 16384, 64), (8, 4096, 64), (32, 4096, 64), (64, 2048, 32)]
GRID_SHAPES = [(b, c, n) for b in (1, 4, 16, 64) for c in (512, 4096, 32768) for n in (16, 64, 128)]
LONG_SHAPES = [(1, 131072, 64)]
# FlexAttention compiles per shape (tens of seconds of device time each): one shape only
FLEX_SHAPES = [(8, 4096, 64)]
HQ, HKV, D, PAGE = 32, 8, 128, 16  # the default layout; a shape may name its own heads and D
# shapes beyond the default layout (B, ctx, n, H_q, H_kv, D): many query heads, a tree of 127
# nodes, D = 256 and D = 64 (the tiles each head dim compiles), a tiny tree
LAYOUT_SHAPES = [
    (16, 8192, 16, 64, 8, 128),
    (4, 4096, 127, 32, 8, 128),
    (32, 2048, 64, 16, 4, 256),
    (32, 2048, 64, 32, 8, 64),
    (1, 512, 8, 32, 8, 128),
]
TOL = 2e-2  # bf16 inputs and outputs, fp32 accumulation: max error / max |ref|


def floor_us(B, ctx, n, hq=HQ, hkv=HKV, d=D):
    kv_bytes = 2 * B * (ctx + n) * hkv * d * 2
    qo_bytes = 2 * B * n * hq * d * 2
    flops = 4 * hq * d * B * n * (ctx + n)
    return H.floor_us(kv_bytes + qo_bytes, flops), kv_bytes + qo_bytes, flops


def random_tree(B: int, n: int, rng: random.Random, dev) -> treeops.Tree:
    """B full trees of n nodes: node i's parent is a random earlier node, half the time one of
    the three before it (deep trees as well as bushy ones)."""
    par = torch.full((B, n), -1, dtype=torch.int32)
    for b in range(B):
        for i in range(1, n):
            par[b, i] = rng.randrange(i) if rng.random() < 0.5 else rng.randrange(max(0, i - 3), i)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    tokens = torch.randint(0, 32000, (B, n), generator=g)
    return treeops.Tree.from_parents(par, torch.full((B,), n, dtype=torch.int32), tokens).to(dev)


class Case:
    """Random bf16 tensors of one shape: paged caches (pages shuffled), trees, queries."""

    def __init__(self, B, ctx, n, seed=0, dev="cuda", hq=HQ, hkv=HKV, d=D, capacity=0):
        rng = random.Random(seed)
        self.B, self.ctx, self.n = B, ctx, n
        self.hq, self.hkv, self.d = hq, hkv, d
        L = ctx + n
        # a block table of ``capacity`` slots per request when larger (an engine's, sized for
        # long contexts) than the ctx + n the case uses
        self.pages_per = -(-max(L, capacity) // PAGE)
        P = B * self.pages_per
        perm = torch.randperm(P, generator=torch.Generator().manual_seed(seed))
        self.block_table = perm.view(B, self.pages_per).to(torch.int32).to(dev)
        g = torch.Generator(device=dev).manual_seed(seed)
        kw = dict(device=dev, generator=g, dtype=torch.bfloat16)
        self.k_cache = torch.randn(P, PAGE, hkv, d, **kw)
        self.v_cache = torch.randn(P, PAGE, hkv, d, **kw)
        self.q = torch.randn(B, n, hq, d, **kw)
        self.seq_lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        self.tree = random_tree(B, n, rng, dev)
        self.tree_mask = self.tree.ancestor_mask()  # [B, n, n] bool
        self.scale = 1.0 / math.sqrt(d)

    def mask(self, b):
        """[n, ctx + n] bool: prefix visible, tree keys by ancestry."""
        m = torch.ones(self.n, self.ctx + self.n, dtype=torch.bool, device=self.q.device)
        m[:, self.ctx :] = self.tree_mask[b]
        return m

    def kv_contig(self):
        """[B, L, H_kv, D] contiguous K and V (the layout SDPA, Flex and ragged FlashInfer take)."""
        L = self.ctx + self.n
        k = self.k_cache[self.block_table.long()].reshape(self.B, -1, self.hkv, self.d)[:, :L]
        v = self.v_cache[self.block_table.long()].reshape(self.B, -1, self.hkv, self.d)[:, :L]
        return k.contiguous(), v.contiguous()

    def reference(self):
        """fp32 reference, one request at a time: [B, n, H_q, D]."""
        hq, hkv, d = self.hq, self.hkv, self.d
        ref = torch.empty(self.B, self.n, hq, d, dtype=torch.float32, device=self.q.device)
        L = self.ctx + self.n
        for b in range(self.B):
            pages = self.block_table[b].long()
            k = self.k_cache[pages].reshape(-1, hkv, d)[:L].float().repeat_interleave(hq // hkv, 1)
            v = self.v_cache[pages].reshape(-1, hkv, d)[:L].float().repeat_interleave(hq // hkv, 1)
            s = torch.einsum("nhd,lhd->hnl", self.q[b].float(), k) * self.scale
            s.masked_fill_(~self.mask(b)[None], float("-inf"))
            ref[b] = torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), v)
        return ref


def rel_err(out, ref):
    out = out.float().reshape(ref.shape)
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).abs().max() / ref.abs().max())


def time_us(fn, graph=True):
    """(µs, method): a CUDA-graph replay where ``fn`` can be captured (``graph``), else CUDA
    events around eager calls."""
    if graph:
        return H.time_any(fn)
    return H.eager_us(fn, host=False), "events"


def treeops_fn(c: Case, k_cache=None, v_cache=None):
    """treeops' public op on the case's tensors (or these caches), its output and workspace
    allocated once."""
    out = torch.empty_like(c.q)
    ws = treeops.tree_attention_workspace(c.q, c.k_cache, c.block_table)
    kc = c.k_cache if k_cache is None else k_cache
    vc = c.v_cache if v_cache is None else v_cache

    def fn():
        return treeops.tree_attention(
            c.q, kc, vc, c.block_table, c.seq_lens, c.tree, sm_scale=c.scale, out=out,
            workspace=ws,
        )  # fmt: skip

    return fn


def prepared_fn(c: Case):
    """treeops' op through ``treeops.prepare`` (the per-layer loop's eager path: q, the caches
    and the output rebound per call), on the case's tensors."""
    out = torch.empty_like(c.q)
    ws = treeops.tree_attention_workspace(c.q, c.k_cache, c.block_table)
    attn = treeops.prepare(
        treeops.tree_attention, c.q, c.k_cache, c.v_cache, c.block_table, c.seq_lens, c.tree,
        sm_scale=c.scale, out=out, workspace=ws, rebind=("q", "k_cache", "v_cache", "out"),
    )  # fmt: skip
    return lambda: attn(c.q, c.k_cache, c.v_cache, out)


def kernel_fn(c: Case, override=None, num_splits=None, k_cache=None, v_cache=None):
    """The kernel launcher with a tile override or split count (the sweep), on the case's caches
    or these: (fn, config)."""
    from treeops.kernels import tree_attention as K

    kc = c.k_cache if k_cache is None else k_cache
    vc = c.v_cache if v_cache is None else v_cache
    out = torch.empty_like(c.q)
    cfg = K.config_for(c.q, kc, c.block_table, num_splits, override)
    ws = torch.empty(
        max(1, K.workspace_numel(c.B, c.n, c.hq, c.d, cfg)), dtype=torch.float32, device=c.q.device
    )

    def fn():
        K.tree_attention_fwd(
            c.q, kc, vc, c.block_table, c.seq_lens, c.tree.num_nodes, c.tree.anc,
            None, None, c.scale, out, None, ws, num_splits=num_splits, override=override,
        )  # fmt: skip
        return out

    return fn, cfg


def config_of(c: Case, override=None) -> dict:
    """The kernel configuration the launch picks (tiles, splits, warps, stages) and which
    forward runs it (``forward``: "gluon" where a gluon configuration can launch, else
    "triton")."""
    try:
        from treeops.kernels import tree_attention as K
        from treeops.kernels import tree_attention_gluon as KG

        cfg = K.config_for(c.q, c.k_cache, c.block_table, None, override)
        gluon = cfg.gluon and KG.launchable(c.q, c.k_cache, c.v_cache, c.q)
        return dict(dataclasses.asdict(cfg), block_m=cfg.block_m,
                    forward="gluon" if gluon else "triton")  # fmt: skip
    except Exception as e:  # noqa: BLE001 - a record, not a measurement
        return {"unavailable": f"{type(e).__name__}: {e}"[:200]}


def fi_indptrs(c: Case):
    dev = c.q.device
    qo_indptr = torch.arange(c.B + 1, dtype=torch.int32, device=dev) * c.n
    kv_indptr = torch.arange(c.B + 1, dtype=torch.int32, device=dev) * c.pages_per
    last = torch.full((c.B,), (c.ctx + c.n - 1) % PAGE + 1, dtype=torch.int32, device=dev)
    indices = c.block_table.reshape(-1).contiguous()
    return qo_indptr, kv_indptr, indices, last


_FI_WS = {}


def fi_workspace():
    if "ws" not in _FI_WS:
        _FI_WS["ws"] = torch.empty(512 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    return _FI_WS["ws"]


def flashinfer_paged(c: Case, causal: bool):
    import flashinfer

    qo_indptr, kv_indptr, indices, last = fi_indptrs(c)
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(fi_workspace(), "NHD")
    kw = (
        dict(causal=True)
        if causal
        else dict(custom_mask=torch.cat([c.mask(b).reshape(-1) for b in range(c.B)]))
    )
    t0 = time.perf_counter()
    w.plan(
        qo_indptr,
        kv_indptr,
        indices,
        last,
        c.hq,
        c.hkv,
        c.d,
        PAGE,
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
        sm_scale=c.scale,
        **kw,
    )
    torch.cuda.synchronize()
    plan_us = (time.perf_counter() - t0) * 1e6
    q = c.q.reshape(c.B * c.n, c.hq, c.d)
    return (lambda kc, vc: lambda: w.run(q, (kc, vc))), plan_us


def flashinfer_ragged(c: Case, k, v):
    import flashinfer

    dev = c.q.device
    qo_indptr = torch.arange(c.B + 1, dtype=torch.int32, device=dev) * c.n
    kv_indptr = torch.arange(c.B + 1, dtype=torch.int32, device=dev) * (c.ctx + c.n)
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(fi_workspace(), "NHD")
    t0 = time.perf_counter()
    w.plan(
        qo_indptr,
        kv_indptr,
        c.hq,
        c.hkv,
        c.d,
        custom_mask=torch.cat([c.mask(b).reshape(-1) for b in range(c.B)]),
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
        sm_scale=c.scale,
    )
    torch.cuda.synchronize()
    plan_us = (time.perf_counter() - t0) * 1e6
    q = c.q.reshape(c.B * c.n, c.hq, c.d)
    kf, vf = k.reshape(-1, c.hkv, c.d), v.reshape(-1, c.hkv, c.d)
    return (lambda: w.run(q, kf, vf)), plan_us


def sdpa_fn(c: Case, k, v):
    import torch.nn.functional as F

    q = c.q.transpose(1, 2)  # [B, H_q, n, D]
    # heads expanded once, outside the timing: the memory-efficient backend takes a bool mask
    # but not GQA, and the math fallback would time a different algorithm
    kt = k.transpose(1, 2).repeat_interleave(c.hq // c.hkv, 1)  # [B, H_q, L, D]
    vt = v.transpose(1, 2).repeat_interleave(c.hq // c.hkv, 1)
    mask = torch.stack([c.mask(b) for b in range(c.B)])[:, None]  # [B, 1, n, L]
    return lambda: F.scaled_dot_product_attention(
        q, kt, vt, attn_mask=mask, scale=c.scale
    ).transpose(1, 2)


def flex_fn(c: Case, k, v):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    ctx, tm = c.ctx, c.tree_mask

    def mask_mod(b, h, q_idx, kv_idx):
        j = (kv_idx - ctx).clamp(min=0)
        return (kv_idx < ctx) | tm[b, q_idx, j]

    bm = create_block_mask(mask_mod, c.B, None, c.n, ctx + c.n, device="cuda")
    flex = torch.compile(flex_attention, dynamic=False)
    q, kt, vt = c.q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    return lambda: flex(q, kt, vt, block_mask=bm, scale=c.scale, enable_gqa=True).transpose(1, 2)


def measure(name, row, make, ref, graph=True, timer=None):
    """Build, check against ``ref``, time (``timer(fn)``, default ``time_us``); record
    ``<name>_us`` (or null and the reason)."""
    try:
        fn = make()
        out = fn()
        torch.cuda.synchronize()
        err = rel_err(out, ref)
        row[f"{name}_err"] = err
        if not err <= TOL:
            row[f"{name}_us"] = None
            row[f"{name}_note"] = f"mismatch: max rel err {err:.3e} > {TOL}"
            return
        t, how = timer(fn) if timer else time_us(fn, graph)
        row[f"{name}_us"] = round(t, 2)
        row[f"{name}_method"] = how
    except Exception as e:  # noqa: BLE001 - a failing peer is a result, not a crash
        torch.cuda.synchronize()
        row[f"{name}_us"] = None
        row[f"{name}_note"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        traceback.print_exc(limit=2)


class Rotation:
    """Copies of a case's paged caches, enough to span twice the L2 (``harness.rotation``), and
    the chained timing over them: ``time(make)`` captures ``reps`` rounds of one call per copy
    (``make(k_cache, v_cache)`` returns the call) in one CUDA graph and returns the median µs
    per call. A graph of one small kernel measures mostly the host's start of the replay (an
    empty kernel: ``empty_kernel_graph_us``); a chain of calls on cold copies measures what a
    step graph that holds the op pays for it."""

    def __init__(self, c: Case):
        kv_bytes = 2 * c.k_cache.numel() * c.k_cache.element_size()
        self.copies, self.reps = H.rotation(kv_bytes)
        self.k = [c.k_cache] + [c.k_cache.clone() for _ in range(self.copies - 1)]
        self.v = [c.v_cache] + [c.v_cache.clone() for _ in range(self.copies - 1)]

    def time(self, make) -> tuple[float, str]:
        calls = [make(kc, vc) for kc, vc in zip(self.k, self.v, strict=True)]
        how = f"cudagraph chain: {self.copies} cache copies x {self.reps}"
        return H.graph_us(calls, self.reps), how


def run_shape(B, ctx, n, peers, flex, override=None, time_treeops=None, sdpa=True, hq=HQ,
              hkv=HKV, d=D):  # fmt: skip
    """One row: treeops (the public op, or the kernel with ``override``) and its peers, each
    checked against the fp32 reference before it is timed. ``time_treeops(fn) -> (µs, method)``
    times treeops (default ``time_us``)."""
    c = Case(B, ctx, n, hq=hq, hkv=hkv, d=d)
    fl, nbytes, flops = floor_us(B, ctx, n, hq, hkv, d)
    row = dict(
        B=B,
        ctx=ctx,
        n=n,
        hq=hq,
        hkv=hkv,
        d=d,
        H_q=hq,  # the names ../shared/targets/check.py reads the layout by
        D=d,
        page_size=PAGE,
        dtype="bf16",
        floor_us=round(fl, 2),
        bytes=nbytes,
        flops=flops,
    )
    ref = c.reference()
    rot = None if override or time_treeops else Rotation(c)
    row["chain_copies"], row["chain_reps"] = (rot.copies, rot.reps) if rot else (None, None)
    fn = kernel_fn(c, override)[0] if override else treeops_fn(c)
    row["treeops_config"] = config_of(c, override)

    def chained(name, make):
        """``measure``'s timer: the call alone in a graph (``<name>_single_us``), then the chain
        over the rotated caches (what it returns: ``<name>_us``)."""

        def timer(f):
            row[f"{name}_single_us"] = round(time_us(f)[0], 2)
            return rot.time(make)

        return timer

    timer = chained("treeops", lambda kc, vc: treeops_fn(c, kc, vc)) if rot else time_treeops
    measure("treeops", row, lambda: fn, ref, timer=timer)
    row["max_rel_err"] = row.get("treeops_err")
    if row.get("treeops_us") is not None:
        row["treeops_do_bench_us"] = round(time_us(fn, graph=False)[0], 2)
        row["treeops_eager_us"] = round(H.eager_us(fn), 2)
        if not override:
            row["treeops_prepared_eager_us"] = round(H.eager_us(prepared_fn(c)), 2)
    k, v = c.kv_contig()
    if peers:
        plan = {}

        def fi(causal):
            make, plan["causal" if causal else "custom"] = flashinfer_paged(c, causal)
            return make

        def fir():
            f, plan["ragged"] = flashinfer_ragged(c, k, v)
            return f

        for name, causal in (("flashinfer_custom", False), ("flashinfer_causal", True)):
            try:
                make = fi(causal)
            except Exception as e:  # noqa: BLE001 - a failing peer is a result
                row[f"{name}_us"] = None
                row[f"{name}_note"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
                continue
            f0 = make(c.k_cache, c.v_cache)
            timer = chained(name, make) if rot else None
            if causal:  # not the tree's function: timed, checked only to run (finite)
                try:
                    f0()
                    t, how = timer(f0) if timer else time_us(f0)
                    row[f"{name}_us"], row[f"{name}_method"] = round(t, 2), how
                except Exception as e:  # noqa: BLE001
                    row[f"{name}_us"] = None
                    row[f"{name}_note"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
            else:
                measure(name, row, lambda f0=f0: f0, ref, timer=timer)
        measure("flashinfer_ragged", row, fir, ref)
        row["flashinfer_plan_us"] = {key: round(val, 1) for key, val in plan.items()}
        if sdpa:
            measure("sdpa", row, lambda: sdpa_fn(c, k, v), ref)
        if flex:
            measure("flex", row, lambda: flex_fn(c, k, v), ref, graph=False)
        else:
            row["flex_us"] = None
            row["flex_note"] = (
                "not run on this shape (device-time budget: compiled for FLEX_SHAPES only)"
            )
    row["sglang_extend_us"] = None
    row["sglang_extend_note"] = "sglang is not installed on the device (no wheel carried)"
    for peer in ("flashinfer_custom", "flashinfer_causal", "sdpa", "flex"):
        # like with like: the chained peers against the chained time, the others (timed alone in
        # a graph, or eagerly) against treeops alone in a graph
        ours = row.get("treeops_us" if peer.startswith("flashinfer") else "treeops_single_us")
        ours = ours or row.get("treeops_us")
        if row.get(f"{peer}_us") and ours:
            row[f"speedup_vs_{peer}"] = round(row[f"{peer}_us"] / ours, 2)
    if row.get("treeops_us"):
        row["treeops_over_floor"] = round(row["treeops_us"] / fl, 2)
    return row


SWEEP_SHAPES = [
    (1, 1024, 64, HQ, HKV, D),
    (1, 16384, 64, HQ, HKV, D),
    (8, 4096, 64, HQ, HKV, D),
    (32, 4096, 64, HQ, HKV, D),
    (4, 4096, 127, HQ, HKV, D),
    (16, 4096, 128, HQ, HKV, D),
    (32, 2048, 64, 16, 4, 256),
    (32, 2048, 64, 32, 8, 64),
    (1, 512, 8, HQ, HKV, D),
    (1, 1024, 16, HQ, HKV, D),
    (16, 512, 64, HQ, HKV, D),
    (64, 512, 16, HQ, HKV, D),
    (8, 4096, 64, 16, 4, 256),
    (16, 4096, 64, 16, 4, 256),
    (64, 1024, 16, 16, 4, 256),
    (8, 4096, 64, 32, 8, 64),
    (4, 512, 64, HQ, HKV, D),
    (1, 4096, 16, HQ, HKV, D),
    (16, 512, 128, HQ, HKV, D),
]
"""(B, ctx, n, H_q, H_kv, D) the sweep times every candidate on: the docs/benchmarks.md shapes that
fit, the 127-node tree, a 128-node tree at B 16 (compute-bound: where FlashInfer's causal kernel
was 1.9x faster in session 20), D = 256 and D = 64 split and unsplit, two small trees (the
small-tree path), two more unsplit D = 128 grids (``TUNED`` routes unsplit launches only), and
the rows furthest from their targets in session 34's ``--shapes all``: the slowest two with a
floor under 5 us and the one furthest behind FlashInfer's causal kernel (and its floor)."""


def candidates(c: Case, names=None):
    """(name, override) of every launch configuration the kernel offers for this case's head dim
    (``CANDIDATES``), and the small-tree path where it applies; ``names`` keeps only those."""
    from treeops.kernels import tree_attention as K

    out = list(K.CANDIDATES[K.head_dim_class(c.d)].items())
    cap = c.block_table.shape[1] * PAGE
    if K.small_tree_applies(c.n, 1 << (c.hq // c.hkv - 1).bit_length(), c.d, cap):
        out.append(("small", {"small_tree": True}))
    return [(n, ov) for n, ov in out if names is None or n in names]


def sweep(shapes, names=None):
    """Time each candidate on each shape (default split counts; same process, same tensors,
    each output checked against the fp32 reference first; chained over rotated caches,
    ``Rotation``): (rows, best per shape)."""
    rows, best = [], []
    for B, ctx, n, hq, hkv, d in shapes:
        c = Case(B, ctx, n, hq=hq, hkv=hkv, d=d)
        ref = c.reference()
        fl = floor_us(B, ctx, n, hq, hkv, d)[0]
        shape = dict(B=B, ctx=ctx, n=n, hq=hq, hkv=hkv, d=d, floor_us=round(fl, 2))
        rot = Rotation(c)
        first = len(rows)
        for name, ov in candidates(c, names):
            # "default" passes {}: the built-in tiles, not what TUNED routes a launch to
            r = dict(shape, candidate=name, override=ov, config=config_of(c, ov))
            try:
                fn, _ = kernel_fn(c, ov)
                err = rel_err(fn(), ref)
                r["err"] = err
                r["us"] = None
                if err <= TOL:
                    make = lambda kc, vc, c=c, ov=ov: kernel_fn(c, ov, None, kc, vc)[0]  # noqa: E731
                    r["us"] = round(rot.time(make)[0], 2)
            except Exception as e:  # noqa: BLE001 - a failing config is a result
                r["us"] = None
                r["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append(r)
            print(json.dumps(r), flush=True)
        timed = [r for r in rows[first:] if r.get("us") is not None]
        if timed:
            win = min(timed, key=lambda r: r["us"])
            dflt = next((r["us"] for r in timed if r["candidate"] == "default"), None)
            best.append(dict(shape, best=win["candidate"], best_us=win["us"], default_us=dflt))
            print("sweep best:", json.dumps(best[-1]), flush=True)
        del c, rot
        torch.cuda.empty_cache()
    return rows, best


# the split study: the trained pair's heads (10 query / 2 KV, D = 64) and the default layout, at
# decode batch sizes and verify widths, over a block table of SPLIT_CAPACITY slots per request
SPLIT_LAYOUTS = [(10, 2, 64), (HQ, HKV, D)]
SPLIT_SHAPES = [(b, c, n) for b in (1, 8, 16, 64) for c in (300, 1000, 4000) for n in (8, 64)]
SPLIT_CAPACITY = 8192
SPLIT_COUNTS = (1, 2, 3, 4, 8, 16)
SPLIT_BOUND = 512


def split_study():
    """Per shape, on the same tensors: the automatic launch (its split count a cap each request
    lowers from its own length), the same count with a device-side bound of SPLIT_BOUND keys
    (shorter requests unsplit, chunks of at least MIN_CHUNK: ``split_min_len``), the automatic
    launch with the merge fused into the forward kernel (``fused_merge``), and each forced count
    of SPLIT_COUNTS; every output checked against the fp32 reference before it is timed. Rows:
    µs per variant."""
    from treeops.kernels import tree_attention as K

    rows = []
    for hq, hkv, d in SPLIT_LAYOUTS:
        for B, ctx, n in SPLIT_SHAPES:
            c = Case(B, ctx, n, hq=hq, hkv=hkv, d=d, capacity=SPLIT_CAPACITY)
            ref = c.reference()
            auto = K.config_for(c.q, c.k_cache, c.block_table)
            fl = floor_us(B, ctx, n, hq, hkv, d)[0]
            row = dict(B=B, ctx=ctx, n=n, hq=hq, hkv=hkv, d=d, capacity=SPLIT_CAPACITY,
                       auto_splits=auto.num_splits, floor_us=round(fl, 2))  # fmt: skip
            variants = [("auto", None, None),
                        ("auto_bounded", None, {"split_min_len": SPLIT_BOUND}),
                        ("auto_fused", None, {"fused_merge": True})]  # fmt: skip
            variants += [(f"s{k}", k, None) for k in SPLIT_COUNTS]
            for name, k, ov in variants:
                try:
                    fn, _ = kernel_fn(c, ov, num_splits=k)
                    err = rel_err(fn(), ref)
                    row[name] = round(time_us(fn)[0], 2) if err <= TOL else f"err {err:.3g}"
                except Exception as e:  # noqa: BLE001 - a failing variant is a result
                    row[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
            del c
            torch.cuda.empty_cache()
    return rows


LATENCY_SHAPES = [(1, 512, 8), (1, 512, 64), (1, 1024, 64), (4, 512, 64), (1, 4096, 16)]


def latency_study(shapes=LATENCY_SHAPES, counts=SPLIT_COUNTS, peers=True):
    """Where a small tree's time goes, per shape of ``shapes`` (default layout): the
    automatic launch, the automatic split with its merge in the forward kernel (``auto_fused``:
    one launch), the automatic split with 16-bit partial outputs (``auto_half``: half the
    workspace bytes), the small-tree path where it applies (``small``, and ``small_fused`` split
    as the automatic launch is) and each split count of ``counts``, chained over rotated cache
    copies (cold K/V, ``*_cold``) and chained on one cache (the L2 holds it, ``*_warm``),
    FlashInfer's causal prefill both ways (unless not ``peers``); every output checked first.
    Rows: µs per call."""
    rows = []
    for B, ctx, n in shapes:
        c = Case(B, ctx, n)
        ref = c.reference()
        rot = Rotation(c)
        row = dict(B=B, ctx=ctx, n=n, floor_us=round(floor_us(B, ctx, n)[0], 2))
        row["auto_splits"] = config_of(c)["num_splits"]
        variants = [("auto", None, None), ("auto_fused", None, {"fused_merge": True}),
                    ("auto_half", None, {"partial_half": True})]  # fmt: skip
        if any(name == "small" for name, _ in candidates(c)):
            fused_small = {"small_tree": True, "fused_merge": True}
            variants += [("small", None, {"small_tree": True}),
                         ("small_fused", row["auto_splits"], fused_small)]  # fmt: skip
        variants += [(f"s{k}", k, None) for k in counts]

        for name, k, ov in variants:
            try:
                fn, _ = kernel_fn(c, ov, num_splits=k)
                err = rel_err(fn(), ref)
                if not err <= TOL:
                    row[name] = f"err {err:.3g}"
                    continue
                row[f"{name}_warm"] = round(H.graph_us([fn], 24), 2)
                row[f"{name}_cold"] = round(
                    rot.time(lambda kc, vc, c=c, k=k, ov=ov: kernel_fn(c, ov, k, kc, vc)[0])[0], 2
                )
            except Exception as e:  # noqa: BLE001 - a failing variant is a result
                row[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        try:
            if peers:
                make = flashinfer_paged(c, True)[0]
                row["fi_causal_warm"] = round(H.graph_us([make(c.k_cache, c.v_cache)], 24), 2)
                row["fi_causal_cold"] = round(rot.time(make)[0], 2)
        except Exception as e:  # noqa: BLE001
            row["fi_causal"] = f"{type(e).__name__}: {str(e)[:120]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
        del c, rot
        torch.cuda.empty_cache()
    return rows


def print_split_table(rows):
    names = ["auto", "auto_bounded", "auto_fused"] + [f"s{k}" for k in SPLIT_COUNTS]
    print(
        f"{'layout':>9} {'B':>3} {'ctx':>5} {'n':>3} {'S':>3} "
        + " ".join(f"{x[:9]:>9}" for x in names)
    )
    for r in rows:
        cells = " ".join(
            f"{r[x]:9.1f}" if isinstance(r.get(x), float) else f"{'-':>9}" for x in names
        )
        lay = f"{r['hq']}/{r['hkv']}/{r['d']}"
        print(f"{lay:>9} {r['B']:3d} {r['ctx']:5d} {r['n']:3d} {r['auto_splits']:3d} {cells}")


def best_override(rows):
    """Per head-dim class, the candidate (small-tree path apart) with the lowest geometric-mean
    time over the sweep shapes of that class on which every such candidate was timed and ran
    unsplit (``TUNED`` routes only those launches): {D: name} (what ``TUNED`` takes), and whether
    the small-tree path won every shape it ran on (what ``SMALL_TREE`` takes)."""
    from treeops.kernels import tree_attention as K

    choice = {}
    for dc in K.CANDIDATES:
        mine = [r for r in rows if K.head_dim_class(r["d"]) == dc and r["candidate"] != "small"]
        split = {(r["B"], r["ctx"], r["n"], r["hq"]) for r in mine
                 if r["config"].get("num_splits", 1) != 1}  # fmt: skip
        mine = [r for r in mine if (r["B"], r["ctx"], r["n"], r["hq"]) not in split]
        shapes = {(r["B"], r["ctx"], r["n"], r["hq"]) for r in mine}
        score = {}
        for r in mine:
            if r.get("us") is not None:
                score.setdefault(r["candidate"], []).append(math.log(r["us"]))
        full = {k: sum(v) for k, v in score.items() if len(v) == len(shapes)}
        if full:
            choice[dc] = min(full, key=full.get)
    small = {}
    for r in rows:
        key = (r["B"], r["ctx"], r["n"], r["hq"], r["d"])
        if r.get("us") is not None:
            small.setdefault(key, {})[r["candidate"]] = r["us"]
    ran = [t for t in small.values() if "small" in t]
    small_wins = bool(ran) and all(t["small"] <= min(t.values()) for t in ran)
    return choice, small_wins


def _empty_call():
    x = torch.zeros(1, device="cuda")
    return lambda: H._empty_kernel[(1,)](x)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--shapes", choices=("bench", "all", "layout"), default="all",
                    help="bench: docs/benchmarks.md's five; all: those, the grid, the long "
                    "context and the other layouts (heads, head dims, tiny and 127-node trees); "
                    "layout: the other layouts only")  # fmt: skip
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="first time every launch-configuration candidate (kernels/tree_attention.py "
        "CANDIDATES, the small-tree path) on SWEEP_SHAPES and record the fastest per shape",
    )
    ap.add_argument("--configs", help="with --sweep: only these candidates (comma list)")
    ap.add_argument(
        "--auto",
        action="store_true",
        help="with --sweep: time every shape with the sweep's choice (TUNED per head dim, "
        "SMALL_TREE if it won every shape it ran on)",
    )
    ap.add_argument(
        "--splits",
        action="store_true",
        help="only the split study: automatic vs forced split counts at decode shapes over a "
        "block table sized for long contexts (SPLIT_SHAPES); writes DIR/attention_splits.json",
    )
    ap.add_argument(
        "--latency",
        action="store_true",
        help="only the small-tree study: split counts, cold and warm caches, FlashInfer's "
        "causal prefill (LATENCY_SHAPES); writes DIR/attention_latency.json",
    )
    ap.add_argument(
        "--split-counts",
        help="with --latency: the forced split counts (comma list; default "
        + ",".join(map(str, SPLIT_COUNTS))
        + ")",
    )
    ap.add_argument(
        "--latency-shapes",
        help="with --latency: the shapes as B:ctx:n (comma list; default LATENCY_SHAPES)",
    )
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    result = H.result_doc(
        commit_id=args.commit,
        layout=dict(hq=HQ, hkv=HKV, d=D, page=PAGE),  # rows name their own heads and D
        floor=dict(bandwidth=H.ceilings()["hbm_bytes_per_s"], flops=H.ceilings()["flops_per_s"]),
        rows=[],
    )
    # what starting a graph replay costs: an empty kernel alone in a graph, and 100 of them
    result["empty_kernel_graph_us"] = dict(
        single=round(H.graph_us([_empty_call()]), 2), chained=round(H.empty_kernel_us(), 2)
    )
    if args.latency:
        shapes = LATENCY_SHAPES
        if args.latency_shapes:
            shapes = [tuple(map(int, x.split(":"))) for x in args.latency_shapes.split(",")]
        counts = SPLIT_COUNTS
        if args.split_counts:
            counts = tuple(int(x) for x in args.split_counts.split(","))
        result["latency"] = latency_study(shapes, counts, not args.no_peers)
        H.write_json(os.path.join(args.out, "attention_latency.json"), result)
        return
    if args.splits:
        result["splits"] = split_study()
        H.write_json(os.path.join(args.out, "attention_splits.json"), result)
        print_split_table(result["splits"])
        return
    if args.sweep:
        names = set(args.configs.split(",")) if args.configs else None
        result["sweep"], result["sweep_best"] = sweep(SWEEP_SHAPES, names)
        choice, small = best_override(result["sweep"])
        result["sweep_choice"] = dict(tuned=choice, small_tree=small)
        print("sweep choice:", result["sweep_choice"], flush=True)
        H.write_json(os.path.join(args.out, "tree_attention_sweep.json"), result)
        if args.auto:
            from treeops.kernels import tree_attention as K
            from treeops.kernels import tree_attention_config as KC

            KC.TUNED.update({dc: n for dc, n in choice.items() if n != "default"})
            KC.SMALL_TREE = small
            K._PLANS.clear()
    default = {"bench": BENCH_SHAPES, "all": BENCH_SHAPES + GRID_SHAPES + LONG_SHAPES,
               "layout": []}[args.shapes]  # fmt: skip
    shapes = [(*s, HQ, HKV, D) for s in default]
    shapes += [] if args.shapes == "bench" else LAYOUT_SHAPES
    for i, (B, ctx, n, hq, hkv, d) in enumerate(shapes):
        t0 = time.time()
        torch.cuda.empty_cache()
        row = run_shape(
            B,
            ctx,
            n,
            not args.no_peers,
            flex=not args.no_flex and (B, ctx, n, hq, hkv, d) == (*FLEX_SHAPES[0], HQ, HKV, D),
            hq=hq,
            hkv=hkv,
            d=d,
        )
        row["bench_md_shape"] = (B, ctx, n) in BENCH_SHAPES and (hq, hkv, d) == (HQ, HKV, D)
        result["rows"].append(row)
        print(
            f"[{i + 1}/{len(shapes)}] {B} {ctx} {n} {hq}/{hkv} D{d}: {time.time() - t0:.1f}s "
            + json.dumps(
                {
                    k: row.get(k)
                    for k in (
                        "treeops_us",
                        "flashinfer_custom_us",
                        "flashinfer_causal_us",
                        "floor_us",
                    )
                }
            ),
            flush=True,
        )
        H.write_json(os.path.join(args.out, "tree_attention.json"), result)
    print_table(result["rows"])


def print_table(rows):
    def f(x):
        return "-" if x is None else f"{x:.1f}"

    print(
        f"{'B':>3} {'ctx':>6} {'n':>4} {'heads':>6} {'D':>3} {'floor':>7} {'treeops':>8} "
        f"{'FIcust':>8} {'FIrag':>8} {'FIcaus':>8} {'sdpa':>8} {'flex':>8} {'xFIc':>5} "
        f"{'/flr':>5} {'alone':>8} err"
    )
    for r in rows:
        heads = f"{r.get('hq', HQ)}/{r.get('hkv', HKV)}"
        print(
            f"{r['B']:>3} {r['ctx']:>6} {r['n']:>4} {heads:>6} {r.get('d', D):>3} "
            f"{f(r['floor_us']):>7} "
            f"{f(r.get('treeops_us')):>8} {f(r.get('flashinfer_custom_us')):>8} "
            f"{f(r.get('flashinfer_ragged_us')):>8} {f(r.get('flashinfer_causal_us')):>8} "
            f"{f(r.get('sdpa_us')):>8} {f(r.get('flex_us')):>8} "
            f"{f(r.get('speedup_vs_flashinfer_custom')):>5} {f(r.get('treeops_over_floor')):>5} "
            f"{f(r.get('treeops_single_us')):>8} {r.get('max_rel_err') or 0:.1e}"
        )
    print("(µs per call, chained over rotated cache copies; 'alone': treeops alone in a graph)")


@pytest.mark.parametrize("shape", BENCH_SHAPES, ids=lambda s: f"B{s[0]}-ctx{s[1]}-n{s[2]}")
def test_tree_attention(benchmark, shape):
    """docs/benchmarks.md's shapes (H_q/H_kv 32/8, D 128, bf16, page 16). Peers: FlashInfer's
    custom-mask prefill (paged and ragged) and its causal prefill where it imports; SDPA and
    FlexAttention are left to the script (minutes of compilation)."""

    def timed(fn):
        return H.benchmark_graph(benchmark, [fn]), "cudagraph"

    try:
        import flashinfer  # noqa: F401

        peers = True
    except Exception:  # noqa: BLE001
        peers = False
    row = run_shape(*shape, peers=peers, flex=False, time_treeops=timed, sdpa=False)
    assert row.get("treeops_us") is not None, row.get("treeops_note")
    if not peers:
        row["flashinfer_custom_note"] = "flashinfer is not importable"
    H.record(benchmark, row)


if __name__ == "__main__":
    main()
