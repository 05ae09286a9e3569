"""Tree build (EAGLE and CAST policies) on the GPU: treeops against plain PyTorch and the floor.

    python bench/bench_build_tree.py --out DIR [--quick] [--table COST_TABLE.json]
    TRITON_INTERPRET=1 python bench/bench_build_tree.py --out DIR --dry-run   # CPU smoke test
    python -m pytest bench/bench_build_tree.py --benchmark-only

Rows (docs/design.md op 3), W = top-k = 10, depth 8, bf16 draft logits:
  ``layer``         one expand step (softmax + top-k over V + path scores + next frontier +
                    the policy's decision), policy ``eagle`` and ``cast``, B x V;
  ``rerank_build``  rerank the 8 layers' candidates and emit the Tree, B x N (x policy);
  ``step``          a whole decoding step of bookkeeping: reset, 8 expand steps, rerank + emit
                    (EAGLE static depth), B x V x N.
Sweeps (``--ops``, times only): ``sweep`` the expand launch's tilings and top-K methods at layer
1, ``sweep_topk`` the ``tl.topk`` options alone, ``sweep_root`` layer 0's tilings over the root's
row ([B, 1, V]) per B; ``--tunes`` adds launcher tunings to each.
For each row, on the same inputs in one process: ``treeops_us`` (the public ops'
launches replayed in a CUDA graph, ``harness.graph_us``), ``treeops_eager_us`` (one eager call,
host included), ``torch_us`` (the same step written in PyTorch without host syncs, replayed in a
CUDA graph: the strongest plain-PyTorch form), ``eager_us`` (the step as EAGLE's reference code
writes it: one request at a time, eager, the tree mask built on the host), and ``floor_us`` =
max(bytes that must move / 4.3 TB/s, an empty kernel replayed in a CUDA graph measured in this
run). Logits rotate over buffers larger than the L2. Before timing, treeops' output is compared
with the reference on the same inputs; a mismatch is recorded instead of a speed. Writes
``DIR/tree_build_cast.json`` (``gpu``, ``versions``, ``commit``, ``rows``) and prints a table.
The standalone CAST rules (``treeops.cast_width`` ...): bench_cast.py.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
import traceback

import harness as H
import pytest
import torch

import treeops

W = TOPK = 10
DEPTH = 8
ROTATE_BYTES = 240 << 20  # > 2x the H200's 60 MB L2 (and then some): logits never sit in L2


# ------------------------------------------------------------------------------------ timing
def time_graph(calls, dev) -> float:
    """Median µs per call of ``calls`` (one per rotated logits buffer) replayed in a CUDA graph,
    about 24 calls a graph (a CPU run times one eager round)."""
    calls = list(calls)
    return H.graph_us(calls, reps=max(1, 24 // len(calls)), device=dev)


def time_eager(fn, dev, iters=20, warmup=3) -> float:
    """Median µs of one eager call, host included."""
    return H.eager_us(fn, iters=iters, warmup=warmup, device=dev)


# ---------------------------------------------------------------------------- policies/inputs
def synthetic_table():
    """docs/benchmarks.md's curve (flat to ~100 tokens per forward, then linear) for an 8B-class
    target and a one-layer draft; used when no calibrated table is given."""
    return treeops.CostTable.from_functions(
        lambda B, c, n: 130.0 * 32 + c * B / 512 + max(0, B * n - 96) * 0.6 * 32,
        lambda B, c, n: 130.0 + 700 + c * B / 16384 + max(0, B * n - 96) * 0.6,
        batch_sizes=[1, 2, 4, 8, 16, 32, 64],
        L=4096,
        M=8,
        n_max=128,
        meta={"gpu": "synthetic (docs/benchmarks.md curve)"},
    )


def make_policy(kind, N, table):
    if kind == "eagle":
        return treeops.EagleStatic(depth=DEPTH, topk=TOPK, budget=N)
    # C1 = 0: Algorithm 1 runs in full but always keeps W rows, so every replay does equal work
    return treeops.Cast(
        C1=0.0,
        C2=0.0,
        C3=0.02,
        R=4,
        cost_table=table,
        topk=TOPK,
        max_width=W,
        max_depth=DEPTH,
        capacity=N,
    )


def logits_buffers(B, V, dev, count=None, seed=0):
    nbytes = B * W * V * 2
    n = count or max(2, -(-ROTATE_BYTES // nbytes))
    g = torch.Generator(device=dev).manual_seed(seed)
    return [
        (torch.randn(B, W, V, device=dev, generator=g) * 3).to(torch.bfloat16) for _ in range(n)
    ]


# ------------------------------------------------------------------- PyTorch, graph-capturable
class TorchBuild:
    """The same step in PyTorch: no host syncs, fixed shapes, so it can be captured."""

    def __init__(self, policy, B, dev):
        self.p = policy
        self.B = B
        D, C, N = DEPTH, W * TOPK, policy.capacity
        self.C = C
        self.cand_tokens = torch.zeros(B, D, C, dtype=torch.int64, device=dev)
        self.cand_scores = torch.full((B, D, C), -1.0, device=dev)
        self.cand_parents = torch.full((B, D, C), -1, dtype=torch.int32, device=dev)
        self.frontier = torch.full((B, W), -1, dtype=torch.int32, device=dev)
        self.ftokens = torch.zeros(B, W, dtype=torch.int64, device=dev)
        self.fscores = torch.full((B, W), -1.0, device=dev)
        self.widths = torch.zeros(D, dtype=torch.int64, device=dev)
        self.roots = torch.zeros(B, dtype=torch.int64, device=dev)
        self.seq = torch.zeros(B, dtype=torch.int64, device=dev)
        self.ar_w = torch.arange(W, device=dev)
        self.ar_n = torch.arange(N, device=dev)
        self.ar_c = torch.arange(1, N, dtype=torch.int32, device=dev).expand(B, N - 1)
        self.pos = torch.zeros(B, D * C, dtype=torch.int32, device=dev)
        if policy.is_cast:
            t, d = policy.cost_table.device_tables(B, dev)
            self.tab_t, self.tab_d = t, d
        self.tokens = torch.zeros(B, N, dtype=torch.int64, device=dev)
        self.parents = torch.zeros(B, N, dtype=torch.int64, device=dev)

    def reset(self, roots, seq):
        self.roots.copy_(roots)
        self.seq.copy_(seq)
        self.frontier.fill_(-1)
        self.fscores.fill_(-1.0)
        self.fscores[:, 0] = 1.0
        self.ftokens.zero_()
        self.ftokens[:, 0] = roots

    def layer(self, i, logits):
        """Layer i from logits [B, W, V], or [B, 1, V] (the root's row alone) at layer 0."""
        B, C, K = self.B, self.C, TOPK
        R = logits.shape[1]  # rows read: the others have no candidates
        x = logits.float()
        lse = torch.logsumexp(x, dim=-1, keepdim=True)
        tv, ti = torch.topk(x, K, dim=-1)
        p = torch.exp(tv - lse)
        ok = (self.fscores[:, :R] >= 0)[:, :, None]
        if R < W:
            self.cand_scores[:, i, R * K :] = -1.0
            self.cand_tokens[:, i, R * K :] = 0
            self.cand_parents[:, i, R * K :] = -1
        self.cand_scores[:, i, : R * K] = torch.where(ok, self.fscores[:, :R, None] * p, -1.0).view(
            B, R * K
        )
        self.cand_tokens[:, i, : R * K] = torch.where(ok, ti, 0).view(B, R * K)
        par = self.frontier[:, :R, None].expand(B, R, K)
        self.cand_parents[:, i, : R * K] = torch.where(ok, par, -1).reshape(B, R * K)
        sc = self.cand_scores[:, i]
        ns, ni = torch.topk(sc, W, dim=-1)
        keep = ns >= 0
        if self.p.is_cast:
            ctx = self.seq.max() + self.widths[:i].sum()
            k = torch.clamp(ctx // self.p.cost_table.L, max=self.p.cost_table.M - 1)
            # index_select, not [k]: a 0-d device tensor as an index reads it on the host,
            # which a CUDA-graph capture refuses
            k1 = k.view(1)
            c = self.tab_d.index_select(0, k1)[0, :W] / self.tab_t.index_select(0, k1)[0, 0]
            u = torch.cumsum(ns.clamp(min=0), dim=1).mean(dim=0)
            obj = u - self.p.C1 * c
            n = W - torch.argmax(torch.flip(obj, (0,)))  # the largest argmax
            self.widths[i] = n
            keep = keep & (self.ar_w[None, :] < n)
        self.fscores.copy_(torch.where(keep, ns, -1.0))
        self.frontier.copy_(torch.where(keep, i * C + ni, -1).to(torch.int32))
        self.ftokens.copy_(torch.where(keep, self.cand_tokens[:, i].gather(1, ni), 0))

    def emit(self):
        """Top N-1 candidates + root, parents through a position map, depth, anc bits, links."""
        B, N, D, C = self.B, self.p.capacity, DEPTH, self.C
        allc = self.cand_scores.view(B, D * C)
        ts, ti = torch.topk(allc, N - 1, dim=1)
        ok = ts >= 0
        self.pos.scatter_(1, ti, self.ar_c)
        pc = self.cand_parents.view(B, D * C).gather(1, ti).long()
        par = torch.where(pc >= 0, self.pos.gather(1, pc.clamp(min=0)).long(), 0)
        par = torch.where(ok, par, -1)
        parents = torch.cat([torch.full((B, 1), -1, device=par.device, dtype=torch.long), par], 1)
        tokens = torch.cat([self.roots[:, None], self.cand_tokens.view(B, D * C).gather(1, ti)], 1)
        depth = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=ti.device), ti // C + 1], 1)
        # ancestor closure by pointer chasing (depth <= D), packed into int32 words
        anc = self.ar_n[None, :, None] == self.ar_n[None, None, :]  # [1, N, N]
        anc = anc.expand(B, N, N).clone()
        cur = parents
        for _ in range(D):
            anc |= (cur[:, :, None] == self.ar_n[None, None, :]) & (cur >= 0)[:, :, None]
            cur = torch.where(cur >= 0, parents.gather(1, cur.clamp(min=0)), -1)
        words = (N + 31) // 32
        padded = torch.zeros(B, N, words * 32, dtype=torch.long, device=anc.device)
        padded[:, :, :N] = anc.long()
        shifts = torch.arange(32, device=anc.device)
        packed = (padded.view(B, N, words, 32) << shifts).sum(-1)
        packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
        # links: first child and next sibling by [B, N, N] comparisons
        big = torch.full((B, N, N), N, device=anc.device)
        idx = self.ar_n
        kid = parents[:, None, :] == idx[None, :, None]
        fc = torch.where(kid, idx[None, None, :], big).min(dim=2).values
        sib = (
            (parents[:, :, None] == parents[:, None, :])
            & (parents[:, :, None] >= 0)
            & (idx[None, None, :] > idx[None, :, None])
        )
        ns = torch.where(sib, idx[None, None, :], big).min(dim=2).values
        self.tokens.copy_(tokens)
        self.parents.copy_(parents)
        return (
            tokens,
            parents,
            depth,
            packed,
            torch.where(fc < N, fc, -1),
            torch.where(ns < N, ns, -1),
        )


# ----------------------------------------------------------------------- EAGLE's eager style
def eagle_layer_eager(logits, scores, K):
    """EAGLE(-2)'s topK_genrate body for one draft layer, one request at a time (its code is
    batch-size 1): log-softmax, top-k per row, cumulative log scores, top-k of the layer."""
    out = []
    for b in range(logits.shape[0]):
        last_p = torch.log_softmax(logits[b].float(), dim=-1)
        top = torch.topk(last_p, K, dim=-1)
        cu = top.values + scores[b][:, None]
        topk_cs = torch.topk(cu.view(-1), K, dim=-1)
        input_ids = top.indices.view(-1)[topk_cs.indices]
        out.append((topk_cs.values, topk_cs.indices // K, input_ids))
    return out


def eagle_rerank_eager(all_scores, all_tokens, all_parents, N):
    """EAGLE-2's rerank + tree mask, one request at a time (``tolist`` and a host loop)."""
    res = []
    for b in range(all_scores.shape[0]):
        top = torch.topk(all_scores[b], N - 1, dim=-1)
        idx = torch.sort(top.indices).values
        draft_tokens = all_tokens[b][idx]
        draft_parents = all_parents[b][idx].long()
        mask_index = torch.searchsorted(idx, draft_parents, right=False)
        mask_index[draft_parents < 0] = -1
        mask_index = mask_index + 1
        mask_index_list = mask_index.tolist()
        tree_mask = torch.eye(N).bool()
        tree_mask[:, 0] = True
        for i in range(N - 1):
            tree_mask[i + 1].add_(tree_mask[mask_index_list[i]])
        pos = torch.sum(tree_mask, dim=1) - 1
        res.append((draft_tokens, tree_mask.to(all_scores.device), pos.to(all_scores.device)))
    return res


# ------------------------------------------------------------------------------------ rows
def fresh_state(policy, B, V, dev):
    g = torch.Generator(device=dev).manual_seed(1)
    roots = torch.randint(0, V, (B,), device=dev, generator=g)
    seq = torch.randint(1000, 8000, (B,), device=dev, generator=g)
    return treeops.DraftState.new(policy, roots, seq), roots, seq


def cpu_copy(st):
    """A CPU copy of a DraftState (for the reference)."""
    return st.to("cpu")


def check_layer(before, st, logits, pol, i):
    """treeops' layer i against the reference applied to the same state (``before``, on the
    CPU): top-k tokens and parents exact, scores close, the frontier exactly the top-W of
    treeops' own scores (GPU exp rounds differently, so near-equal scores may swap)."""
    from treeops.reference import build_tree as RB

    before.layer = i
    RB.build_tree_expand(logits.cpu(), before, pol)
    if not torch.equal(st.cand_tokens[:, i].cpu(), before.cand_tokens[:, i]):
        return f"layer {i}: candidate tokens differ from the reference"
    if not torch.equal(st.cand_parents[:, i].cpu(), before.cand_parents[:, i]):
        return f"layer {i}: candidate parents differ from the reference"
    if not torch.allclose(
        st.cand_scores[:, i].cpu(), before.cand_scores[:, i], rtol=1e-5, atol=1e-9
    ):
        return f"layer {i}: candidate scores differ from the reference"
    sc = st.cand_scores[:, i].cpu()
    order = torch.sort(sc, dim=1, descending=True, stable=True).indices[:, :W]
    top = sc.gather(1, order)
    n = int(st.decisions[i])
    keep = (torch.arange(W)[None, :] < n) & (top >= 0)
    if not torch.equal(st.frontier.cpu(), torch.where(keep, i * W * TOPK + order, -1).int()):
        return f"layer {i}: frontier is not the top-{n} of the layer"
    return None


def check_tree(st, pol, tree):
    """treeops' tree against the reference rerank of the same candidates (exact)."""
    from treeops.reference import build_tree as RB

    want = RB.build_tree_emit(cpu_copy(st), pol)
    for f in ("tokens", "parents", "num_nodes", "depth", "anc", "first_child", "next_sibling"):
        if not torch.equal(getattr(tree, f).cpu(), getattr(want, f)):
            return f"tree.{f} differs from the reference"
    return None


def check_torch(tb_scores, st_scores):
    """The PyTorch baseline computes the same candidates (up to the order of tied scores)."""
    a = torch.sort(tb_scores.float().flatten(1), dim=1).values
    b = torch.sort(st_scores.float().flatten(1), dim=1).values
    return "ok" if torch.allclose(a, b, rtol=1e-3, atol=1e-6) else "scores differ"


def expand_at(x, st, pol, layer):
    """``treeops.build_tree_expand`` of draft layer ``layer`` (the state's layer reset first, so
    that every captured call expands the same layer)."""
    st.layer = layer
    treeops.build_tree_expand(x, st, pol)


def row_layer(kind, B, V, table, dev, empty_us, quick, time_treeops=None):
    """One expand step (layer 1: a full frontier of W rows), checked against the reference."""
    time_treeops = time_treeops or time_graph
    pol = make_policy(kind, 64, table)
    bufs = logits_buffers(B, V, dev)
    st, roots, seq = fresh_state(pol, B, V, dev)
    tb = TorchBuild(pol, B, dev)
    tb.reset(roots, seq)
    # layer 0 from the root, then time layer 1 (a full frontier of W rows)
    expand_at(bufs[0], st, pol, 0)
    tb.layer(0, bufs[0])
    row = dict(op="layer", policy=kind, B=B, N=None, V=V, W=W, topk=TOPK, dtype="bf16")
    nbytes = B * W * V * 2
    row["bytes"] = nbytes
    row["floor_us"] = round(H.floor_us(nbytes, empty_us=empty_us), 2)
    before = cpu_copy(st)
    expand_at(bufs[1], st, pol, 1)
    tb.layer(1, bufs[1])
    err = check_layer(before, st, bufs[1], pol, 1)
    row["check"] = err or "ok"
    row["torch_check"] = check_torch(tb.cand_scores[:, 1], st.cand_scores[:, 1])
    if err is None:
        row["treeops_us"] = round(
            time_treeops([lambda x=x: expand_at(x, st, pol, 1) for x in bufs], dev), 2
        )
        row["treeops_eager_us"] = round(
            time_eager(lambda: expand_at(bufs[0], st, pol, 1), dev, iters=5 if quick else 20), 2
        )
    row["torch_us"] = round(time_graph([lambda x=x: tb.layer(1, x) for x in bufs], dev), 2)
    if kind == "eagle":
        sc = torch.zeros(B, W, device=dev)
        row["eager_us"] = round(
            time_eager(lambda: eagle_layer_eager(bufs[0], sc, TOPK), dev, iters=3 if quick else 10),
            2,
        )
    finish(row)
    return row


def time_tunes(row, tunes, extra, bufs, st, pol, dev):
    """Each of ``tunes`` ({name: launcher tuning}) and ``extra`` (tunings named by their items)
    of the expand launch at the state's layer, replayed over ``bufs``, into ``row["configs"]``
    (µs, or the error a tuning raised); the fastest into ``row["best"]`` and ``treeops_us``."""
    from treeops.build_tree import _launch_expand  # the CUDA branch with the launcher's tuning

    for tune in extra:
        tunes[",".join(f"{k}={v}" for k, v in tune.items())] = dict(tune)
    for name, tune in tunes.items():
        try:
            _launch_expand(bufs[0], st, pol, **tune)
            t = time_graph([lambda x=x, t=tune: _launch_expand(x, st, pol, **t) for x in bufs], dev)
            row["configs"][name] = round(t, 2)
        except Exception as e:  # noqa: BLE001
            row["configs"][name] = f"{type(e).__name__}: {e}"[:200]
    ok = {k: v for k, v in row["configs"].items() if isinstance(v, float)}
    if ok:
        best = min(ok, key=ok.get)
        row["best"], row["treeops_us"] = best, ok[best]
    return row


def row_sweep(B, V, table, dev, empty_us, topk_only=False, extra=()):
    """The expand launch's tiling on one shape (the defaults are set from this): the vocabulary
    tile, the programs per row (``split``; None: the default rule, ``expand_tiling``) and the
    warps of the streaming programs (split > 1; with split = 1, of the one program per row);
    then, at the default tiling, the split top-K's method (``cand_cap``, ``cand_tiles``, or the
    tokens per recorded maximum: ``max_block``). ``topk_only``: the defaults against the
    ``tl.topk`` options alone; ``extra``: launcher tunings (dicts) timed besides."""
    pol = make_policy("eagle", 64, table)
    bufs = logits_buffers(B, V, dev)
    st, _, _ = fresh_state(pol, B, V, dev)
    expand_at(bufs[0], st, pol, 0)
    st.layer = 1
    row = dict(
        op="layer_sweep",
        policy="eagle",
        B=B,
        N=None,
        V=V,
        floor_us=round(H.floor_us(B * W * V * 2, empty_us=empty_us), 2),
        configs={},
    )
    tunes = {"default": {}}
    tilings = () if topk_only else itertools.product((256, 512), (1, 2, 4), (None, 1, 2, 4, 16))
    for bv, nw, sp in tilings:
        if sp == 1 and nw < 4:
            continue  # one program per row streams the whole row: one or two warps starve it
        tunes[f"block_v={bv},warps={nw},split={sp or 'auto'}"] = dict(
            block_v=bv, num_warps=nw, split=sp
        )
    # the split top-K's method at the default tiling: candidates ranked at once (cap, tiles read
    # at a time) or the tile-by-tile merge (cap 0); ``topk_only`` skips to the tl.topk options
    methods = () if topk_only else ((0, 1), (32, 1), (32, 2), (32, 4), (32, 8), (32, 16), (64, 1))
    for cap, tiles in methods:
        tunes[f"cand_cap={cap},cand_tiles={tiles}"] = dict(cand_cap=cap, cand_tiles=tiles)
    # and the tokens per recorded maximum (the block re-read; the default is expand_max_block's)
    blocks = itertools.product((512, 256, 128, 64, 32), (1, 2, 4, 8))
    for mb, tiles in () if topk_only else blocks:
        tunes[f"max_block={mb},cand_tiles={tiles}"] = dict(max_block=mb, cand_tiles=tiles)
    # and the per-row programs' warps at the default blocks (4 by default)
    for rw, tiles in () if topk_only else itertools.product((2, 8), (1, 2, 4)):
        tunes[f"row_warps={rw},cand_tiles={tiles}"] = dict(row_warps=rw, cand_tiles=tiles)
    # and the K best blocks or the ranked candidates by one tl.topk each, at the default blocks
    for bt, rt in ((True, False), (False, True), (True, True)):
        tunes[f"blocks_topk={bt},rank_topk={rt}"] = dict(blocks_topk=bt, rank_topk=rt)
    # and the candidates' tile reads issued one at a time (the default issues them one ahead),
    # and one ahead at 1 and 4 a read
    for ahead, tiles in ((False, None), (True, 1), (True, 4)):
        tunes[f"cand_ahead={ahead},cand_tiles={tiles or 'auto'}"] = dict(
            cand_ahead=ahead, cand_tiles=tiles
        )
    return time_tunes(row, tunes, extra, bufs, st, pol, dev)


def row_sweep_root(B, V, table, dev, empty_us, extra=()):
    """Layer 0 from the root's row alone ([B, 1, V], as a step's first expand reads it) under
    tilings of its B-row launch: the default, the programs per row (``split``: 1 streams each
    row in its own program) at 512- and 1,024-token tiles, the tokens per recorded maximum, and
    ``extra`` launcher tunings. Times only (the layer and step rows check the defaults)."""
    pol = make_policy("eagle", 64, table)
    bufs = [x[:, :1] for x in logits_buffers(B, V, dev)]
    st, roots, seq = fresh_state(pol, B, V, dev)
    st.reset(roots, seq)
    row = dict(
        op="root_sweep",
        policy="eagle",
        B=B,
        N=None,
        V=V,
        floor_us=round(H.floor_us(B * V * 2, empty_us=empty_us), 2),
        configs={},
    )
    tunes = {"default": {}}
    for bv, sp in itertools.product((512, 1024), (1, 2, 4, 8, 16, 32, 64)):
        nw = 4 if sp == 1 else (1 if bv == 512 else 2)  # split 1: the per-row program streams
        tunes[f"block_v={bv},warps={nw},split={sp}"] = dict(block_v=bv, num_warps=nw, split=sp)
    for mb in (64, 128, 256):
        tunes[f"max_block={mb}"] = dict(max_block=mb)
    st.layer = 0
    return time_tunes(row, tunes, extra, bufs, st, pol, dev)


def prepared(kind, B, N, V, table, dev):
    """A state after DEPTH expand steps (treeops and PyTorch fed the same logits)."""
    pol = make_policy(kind, N, table)
    bufs = logits_buffers(B, V, dev, count=DEPTH, seed=2)
    st, roots, seq = fresh_state(pol, B, V, dev)
    tb = TorchBuild(pol, B, dev)
    tb.reset(roots, seq)
    for i in range(DEPTH):
        expand_at(bufs[i], st, pol, i)
        tb.layer(i, bufs[i])
    st.layer = DEPTH
    return pol, bufs, st, tb, roots, seq


def row_rerank(kind, B, N, table, dev, empty_us, quick, V=32000, time_treeops=None):
    """Rerank + emit after DEPTH layers, checked against the reference (exact)."""
    time_treeops = time_treeops or time_graph
    pol, bufs, st, tb, _, _ = prepared(kind, B, N, V, table, dev)
    del bufs
    tb.cand_scores.copy_(st.cand_scores)  # same candidates for both (no tie ambiguity)
    tb.cand_tokens.copy_(st.cand_tokens)
    tb.cand_parents.copy_(st.cand_parents)
    out = treeops.Tree.empty(B, N, dev)
    C = W * TOPK
    aw = (N + 31) // 32
    nbytes = B * DEPTH * C * (4 + 8 + 4) + B * N * (8 + 4 + 4 + 4 * aw + 4 + 4 + 4) + B * 4
    row = dict(
        op="rerank_build",
        policy=kind,
        B=B,
        N=N,
        V=None,
        W=W,
        topk=TOPK,
        bytes=nbytes,
        floor_us=round(H.floor_us(nbytes, empty_us=empty_us), 2),
    )

    def emit():
        return treeops.build_tree_emit(st, pol, out=out)

    err = check_tree(st, pol, emit())
    ok = err is None
    row["check"] = err or "ok"
    if kind == "cast":
        row["verify_count"] = int(st.decisions[-1])
    if ok:
        row["treeops_us"] = round(time_treeops([emit], dev), 2)
        row["treeops_eager_us"] = round(time_eager(emit, dev, iters=5 if quick else 20), 2)
    if kind == "eagle":
        row["torch_us"] = round(time_graph([tb.emit], dev), 2)
        flat_s = st.cand_scores.view(B, -1)
        flat_t = st.cand_tokens.view(B, -1)
        flat_p = st.cand_parents.view(B, -1)
        row["eager_us"] = round(
            time_eager(
                lambda: eagle_rerank_eager(flat_s, flat_t, flat_p, N),
                dev,
                iters=2 if quick else 5,
                warmup=1,
            ),
            2,
        )
    else:
        row["torch_us"] = None
        row["torch_note"] = "the PyTorch baseline has EAGLE's fixed count (no C3 rule)"
    finish(row)
    return row


def row_step(B, N, V, table, dev, empty_us, quick, layer_checks=True, time_treeops=None):
    """A whole step (reset, DEPTH expands, emit), every layer and the tree checked first. Layer 0
    reads the root's row alone ([B, 1, V], as a draft forward of the root alone gives it), the
    others [B, W, V]; the PyTorch step is fed the same."""
    time_treeops = time_treeops or time_graph
    pol = make_policy("eagle", N, table)
    bufs = logits_buffers(B, V, dev, count=DEPTH, seed=3)
    bufs[0] = bufs[0][:, :1]
    st, roots, seq = fresh_state(pol, B, V, dev)
    tb = TorchBuild(pol, B, dev)
    out = treeops.Tree.empty(B, N, dev)

    def step_treeops():
        st.reset(roots, seq)
        for i in range(DEPTH):
            expand_at(bufs[i], st, pol, i)
        return treeops.build_tree_emit(st, pol, out=out)

    def step_torch():
        tb.reset(roots, seq)
        for i in range(DEPTH):
            tb.layer(i, bufs[i])
        return tb.emit()

    # check: every layer against the reference on treeops' own state (once per B, V: the
    # logits do not depend on N), then the rerank
    st.reset(roots, seq)
    err = None
    for i in range(DEPTH):
        before = cpu_copy(st) if layer_checks else None
        expand_at(bufs[i], st, pol, i)
        if layer_checks:
            err = err or check_layer(before, st, bufs[i], pol, i)
    err = err or check_tree(st, pol, treeops.build_tree_emit(st, pol, out=out))
    step_torch()
    ok = err is None
    nbytes = (DEPTH - 1) * B * W * V * 2 + B * V * 2
    row = dict(
        op="step",
        policy="eagle",
        B=B,
        N=N,
        V=V,
        W=W,
        topk=TOPK,
        depth=DEPTH,
        bytes=nbytes,
        floor_us=round(H.floor_us(nbytes, empty_us=empty_us), 2),
        check=err or "ok",
        torch_check=check_torch(tb.cand_scores, st.cand_scores),
    )
    if ok:
        row["treeops_us"] = round(time_treeops([step_treeops], dev), 2)
        row["treeops_eager_us"] = round(time_eager(step_treeops, dev, iters=5 if quick else 20), 2)
    row["torch_us"] = round(time_graph([step_torch], dev), 2)
    finish(row)
    return row


def finish(row):
    t, p, f = row.get("treeops_us"), row.get("torch_us"), row.get("floor_us")
    if t and p:
        row["speedup_vs_torch"] = round(p / t, 2)
    if t and row.get("eager_us"):
        row["speedup_vs_eager"] = round(row["eager_us"] / t, 2)
    if t and f:
        row["treeops_over_floor"] = round(t / f, 2)


# ------------------------------------------------------------------------------------ main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true", help="B in {1, 64}, V = 32000, N = 64 only")
    ap.add_argument(
        "--ops",
        default="layer,rerank_build,step",
        help="comma-separated; add 'sweep' for the expand kernel's tile sweep, 'sweep_topk'"
        " for its top-K methods alone, or 'sweep_root' for layer 0's tilings (the root's row)",
    )
    ap.add_argument("--table", default=None, help="a CostTable JSON for the CAST rows")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny shapes on the CPU under TRITON_INTERPRET=1 (checks the script)",
    )
    ap.add_argument("--commit", default=None)
    ap.add_argument(
        "--batches", default=None, help="comma-separated batch sizes, a subset of the grid's"
    )
    ap.add_argument(
        "--tunes",
        default="[]",
        help="sweep rows: a JSON list of expand launcher tunings timed besides, e.g. "
        '\'[{"row_warps": 2}, {"max_block": 128}]\'',
    )
    ap.add_argument(
        "--vocabs", default=None, help="comma-separated vocabulary sizes, a subset of the grid's"
    )
    ap.add_argument(
        "--budget-s", type=float, default=0.0, help="start no row after this many seconds (0: none)"
    )
    args = ap.parse_args(argv)
    global W, TOPK, DEPTH, ROTATE_BYTES
    if args.dry_run:
        dev = torch.device("cpu")
        W = TOPK = 3
        DEPTH = 3
        ROTATE_BYTES = 1
        Bs, Vs, Ns = (1, 3), (100,), (8,)
    else:
        dev = torch.device("cuda")
        Bs, Vs, Ns = (1, 8, 32, 64), (32000, 128256), (32, 64, 128)
        if args.quick:
            Bs, Vs, Ns = (1, 64), (32000,), (64,)
    if args.batches:
        want = [int(b) for b in args.batches.split(",")]
        if any(b not in Bs for b in want):
            raise ValueError(f"Invalid value of --batches: expected a subset of {Bs}, got {want}")
        Bs = tuple(want)
    if args.vocabs:
        want = [int(v) for v in args.vocabs.split(",")]
        if any(v not in Vs for v in want):
            raise ValueError(f"Invalid value of --vocabs: expected a subset of {Vs}, got {want}")
        Vs = tuple(want)
    table = treeops.CostTable.load(args.table) if args.table else synthetic_table()
    ops = set(args.ops.split(","))
    extra = json.loads(args.tunes)
    empty_us = H.empty_kernel_us(dev)
    rows = []
    result = H.result_doc(
        dev,
        commit_id=args.commit,
        empty_kernel_graph_us=round(empty_us, 2),
        cost_table=table.meta,
        rows=rows,
    )

    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "tree_build_cast.json")

    def run(fn, *a):
        if args.budget_s and time.time() - t_start > args.budget_s:
            result["skipped_rows"] = result.get("skipped_rows", 0) + 1
            return
        try:
            r = fn(*a)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            r = dict(
                op=fn.__name__,
                args=[str(x) for x in a if not hasattr(x, "meta")],
                error=f"{type(e).__name__}: {str(e)[:400]}",
            )
        rows.append(r)
        print(json.dumps(r), flush=True)
        H.write_json(path, result)  # after every row: a stage time limit keeps what was measured
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    for B in Bs:
        if "layer" in ops:
            for V in Vs:
                for kind in ("eagle", "cast"):
                    run(row_layer, kind, B, V, table, dev, empty_us, args.quick)
        if "rerank_build" in ops:
            for N in Ns:
                for kind in ("eagle", "cast"):
                    run(row_rerank, kind, B, N, table, dev, empty_us, args.quick, Vs[0])
        if "step" in ops:
            for V in Vs:
                for N in Ns:
                    run(row_step, B, N, V, table, dev, empty_us, args.quick, N == Ns[0])
    if "sweep_root" in ops:  # a compile per configuration
        for B in Bs:
            run(row_sweep_root, B, Vs[0], table, dev, empty_us, extra)
    if "sweep" in ops or "sweep_topk" in ops:  # last: a compile per configuration
        for B, V in dict.fromkeys(
            ((Bs[-1], Vs[0]), (Bs[0], Vs[-1]), (Bs[0], Vs[0]), (Bs[-1], Vs[-1]))
        ):
            run(row_sweep, B, V, table, dev, empty_us, "sweep" not in ops, extra)
    H.write_json(path, result)
    print_table(rows, empty_us)
    return result


def print_table(rows, empty_us):
    def f(x):
        return "-" if x is None else (f"{x:.1f}" if isinstance(x, float) else str(x))

    print(f"\nempty kernel in a CUDA graph: {empty_us:.2f} us")
    hdr = (
        "op",
        "policy",
        "B",
        "N",
        "V",
        "treeops_us",
        "torch_us",
        "eager_us",
        "floor_us",
        "speedup_vs_torch",
        "treeops_over_floor",
        "check",
    )
    print(" | ".join(hdr))
    for r in rows:
        if "error" in r:
            print(f"{r['op']} {r.get('args')}: ERROR {r['error']}")
            continue
        if r["op"] in ("layer_sweep", "root_sweep"):
            print(
                f"{r['op']} B={r['B']} V={r['V']} floor {r['floor_us']}: best {r.get('best')} "
                f"{r.get('treeops_us')} us; {r['configs']}"
            )
            continue
        print(" | ".join(f(r.get(k)) for k in hdr))


# ------------------------------------------------------------------------------ pytest
B_TEST, V_TEST, N_TEST = 8, 128256, 64


def _timed(benchmark):
    return lambda calls, dev: H.benchmark_graph(benchmark, calls, reps=max(1, 24 // len(calls)))


@pytest.mark.parametrize("kind", ["eagle", "cast"])
def test_build_tree_layer(benchmark, kind):
    """One expand step: B = 8, W = top-k = 10, V = 128256, bf16 logits (rotated past the L2).
    Peer: the same step in sync-free PyTorch, replayed in a graph."""
    dev = torch.device("cuda")
    row = row_layer(kind, B_TEST, V_TEST, synthetic_table(), dev, H.empty_kernel_us(dev), True,
                    time_treeops=_timed(benchmark))  # fmt: skip
    assert row["check"] == "ok", row["check"]
    H.record(benchmark, row)


@pytest.mark.parametrize("kind", ["eagle", "cast"])
def test_build_tree_emit(benchmark, kind):
    """Rerank 8 layers' 100 candidates each and emit the tree: B = 8, N = 64. Peer (EAGLE):
    the PyTorch rerank + emit, replayed in a graph."""
    dev = torch.device("cuda")
    row = row_rerank(kind, B_TEST, N_TEST, synthetic_table(), dev, H.empty_kernel_us(dev), True,
                     time_treeops=_timed(benchmark))  # fmt: skip
    assert row["check"] == "ok", row["check"]
    H.record(benchmark, row)


def test_build_tree_step(benchmark):
    """A whole EAGLE step (reset, 8 expands, emit): B = 8, N = 64, V = 32000. Peer: the same
    step in sync-free PyTorch, replayed in a graph."""
    dev = torch.device("cuda")
    row = row_step(B_TEST, N_TEST, 32000, synthetic_table(), dev, H.empty_kernel_us(dev), True,
                   time_treeops=_timed(benchmark))  # fmt: skip
    assert row["check"] == "ok", row["check"]
    H.record(benchmark, row)


if __name__ == "__main__":
    main()
