"""Acceptance on one GPU (docs/design.md op 7, docs/benchmarks.md protocol).

    python bench/bench_accept.py --out DIR          # writes DIR/accept.json, prints a table
    python -m pytest bench/bench_accept.py --benchmark-only     # one row per op, pytest-benchmark
    python bench/bench_accept.py --out DIR --topk   # the fused top-K ids: DIR/accept_topk.json

Rows: greedy and sampling acceptance, B in {1, 8, 64}, N = 64, V in {32000, 128256}, bf16 logits,
against the usual two-step pipeline -- torch argmax (or softmax / top-k / top-p over the whole
logits) and then a per-request tree walk in torch, vectorised over the batch, on device --
and, for sampling, FlashInfer's softmax / top-k / top-p renorm kernels as the first step where
``flashinfer.sampling`` imports. Every op is checked before it is timed (treeops against the CPU
reference on a subset of requests; the torch pipeline's agreement with treeops is reported).
Times are medians of CUDA-graph replays (``harness.graph_us``: each graph holds several calls on
rotated inputs so the 60 MB L2 does not flatter small cases); ``treeops_eager_us`` is one eager
call with the host included. Floor = max(bytes / 4.3 TB/s, an empty Triton kernel replayed in a
CUDA graph, measured in this run); bytes = logits read once. KV compaction (op 8) runs after
them, ``bench_compact_kv.py``'s rows at the same B (``--no-compact`` leaves them out), so that
accept.json holds every op the acceptance step runs.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import time

import harness as H
import pytest
import torch

import treeops
from treeops.kernels.accept import accept_launch
from treeops.reference import accept as ref

DEV = "cuda"


def graph_time_us(calls, reps: int) -> float:
    """Median µs per call of ``calls`` replayed ``reps`` times in one CUDA graph (``--cpu-dry-run``:
    wall-clock)."""
    return H.graph_us(calls, reps, replays=20, device=DEV)


def rotation(nbytes: int) -> tuple[int, int]:
    return (2, 1) if DEV == "cpu" else H.rotation(nbytes)


# ------------------------------------------------------------------------------------ inputs
def bench_tree(B: int, N: int, V: int, seed: int) -> treeops.Tree:
    """EAGLE-like draft trees of N = 64 nodes over 8 levels (depth 7), in rank order: each
    node's parent is in the previous level, biased towards its best-ranked nodes; distinct
    sibling tokens. Any other N: a chain of N nodes."""
    widths = [1, 4, 8, 12, 14, 12, 8, 5] if N == 64 else [1] * N
    rng = random.Random(seed)
    par = torch.full((B, N), -1, dtype=torch.int32)
    tok = torch.zeros(B, N, dtype=torch.int64)
    for b in range(B):
        used: dict[int, set] = {}
        start, prev = 0, []
        for w in widths:
            level = list(range(start, start + w))
            kids = (
                sorted(prev[min(int(rng.expovariate(0.6)), len(prev) - 1)] for _ in level)
                if prev
                else [-1]
            )
            for i, p in zip(level, kids):
                par[b, i] = p
                s = used.setdefault(p, set())
                t = rng.randrange(V)
                while t in s:
                    t = rng.randrange(V)
                s.add(t)
                tok[b, i] = t
            start, prev = start + w, level
    scores = torch.linspace(1.0, 0.01, N).expand(B, N).contiguous()
    return treeops.Tree.from_parents(par, torch.full((B,), N, dtype=torch.int32), tok, scores).to(
        DEV
    )


def bench_logits(tree: treeops.Tree, V: int, seed: int, boost: float) -> torch.Tensor:
    """Random bf16 logits where most nodes favour one of their children (so paths are
    accepted, about 4-6 nodes deep)."""
    B, N = tree.parents.shape
    g = torch.Generator(device=DEV).manual_seed(seed)
    lg = torch.randn(B, N, V, device=DEV, generator=g, dtype=torch.float32).mul_(2.0)
    lg = lg.to(torch.bfloat16)
    par = tree.parents.cpu()
    rng = random.Random(seed)
    rows, cols, toks = [], [], []
    for b in range(B):
        for i in range(N):
            kids = (par[b] == i).nonzero().flatten().tolist()
            if kids and rng.random() < 0.8:
                rows.append(b)
                cols.append(i)
                toks.append(int(tree.tokens[b, rng.choice(kids)]))
    r = torch.tensor(rows, device=DEV)
    c = torch.tensor(cols, device=DEV)
    t = torch.tensor(toks, device=DEV)
    lg[r, c, t] = (lg[r, c].float().amax(-1) + boost).to(torch.bfloat16)
    return lg


def max_depth(tree: treeops.Tree) -> int:
    return int(tree.depth.max())


# --------------------------------------------------------------------------- torch pipeline
def torch_walk_greedy(am: torch.Tensor, tree: treeops.Tree, steps: int):
    """Per-request greedy walk, vectorised over the batch, ``steps`` fixed (no host sync)."""
    B, N = am.shape
    ar = torch.arange(B, device=DEV)
    idx = torch.arange(N, device=DEV)
    valid = idx[None, :] < tree.num_nodes[:, None]
    cur = torch.zeros(B, dtype=torch.long, device=DEV)
    done = tree.num_nodes == 0
    L = (~done).long()
    path = torch.full((B, N), -1, dtype=torch.long, device=DEV)
    path[:, 0] = torch.where(done, -1, 0)
    bonus = torch.full((B,), -1, dtype=torch.long, device=DEV)
    for _ in range(steps):
        amc = am[ar, cur]
        hit = (
            valid
            & (idx[None, :] > 0)
            & (tree.parents == cur[:, None])
            & (tree.tokens == amc[:, None])
        )
        first = torch.where(hit, idx[None, :], N).amin(1)
        has = (first < N) & ~done
        stop = ~has & ~done
        bonus = torch.where(stop, amc, bonus)
        done = done | stop
        path.scatter_(
            1,
            L.clamp(max=N - 1)[:, None],
            torch.where(has, first, path.gather(1, L.clamp(max=N - 1)[:, None])[:, 0])[:, None],
        )
        cur = torch.where(has, first, cur)
        L = L + has.long()
    return path, L, bonus


def torch_walk_sample(probs: torch.Tensor, tree: treeops.Tree, u: torch.Tensor, steps: int):
    """docs/design.md op 7's interval rule on a materialised [B, N, V] probability tensor."""
    B, N, V = probs.shape
    ar = torch.arange(B, device=DEV)
    idx = torch.arange(N, device=DEV)
    vid = torch.arange(V, device=DEV)
    valid = idx[None, :] < tree.num_nodes[:, None]
    tok = tree.tokens.clamp(0, V - 1)
    cur = torch.zeros(B, dtype=torch.long, device=DEV)
    done = tree.num_nodes == 0
    L = (~done).long()
    path = torch.full((B, N), -1, dtype=torch.long, device=DEV)
    path[:, 0] = torch.where(done, -1, 0)
    bonus = torch.full((B,), -1, dtype=torch.long, device=DEV)
    for _ in range(steps):
        pc = probs[ar, cur]  # [B, V]
        uc = u[ar, cur]
        ch = valid & (idx[None, :] > 0) & (tree.parents == cur[:, None])
        cp = torch.where(ch, pc.gather(1, tok), 0.0)
        cum = cp.cumsum(1)
        hit = ch & (cp > 0) & (cum > uc[:, None])
        first = torch.where(hit, idx[None, :], N).amin(1)
        has = (first < N) & ~done
        is_child = (
            torch.zeros(B, V, dtype=torch.int32, device=DEV).scatter_add_(1, tok, ch.int()) > 0
        )
        rest = pc.masked_fill(is_child, 0.0)
        csum = cp.sum(1, keepdim=True) + rest.cumsum(1)
        pick = torch.where((csum > uc[:, None]) & (rest > 0), vid[None, :], V).amin(1)
        last = torch.where(rest > 0, vid[None, :], -1).amax(1)
        pick = torch.where(pick < V, pick, last)
        stop = ~has & ~done
        bonus = torch.where(stop, pick, bonus)
        done = done | stop
        Lc = L.clamp(max=N - 1)[:, None]
        path.scatter_(1, Lc, torch.where(has, first, path.gather(1, Lc)[:, 0])[:, None])
        cur = torch.where(has, first, cur)
        L = L + has.long()
    return path, L, bonus


def torch_probs(lg, T, k, p, use_k: bool, use_p: bool):
    """softmax(logits / T), top-k, top-p, renormalised: the usual sort-based torch recipe."""
    B, N, V = lg.shape
    x = lg.float() / T.view(B, 1, 1)
    if use_k or use_p:
        xs, order = x.sort(dim=-1, descending=True, stable=True)
        pos = torch.arange(V, device=DEV)
        if use_k:
            xs = xs.masked_fill(pos.view(1, 1, V) >= k.view(B, 1, 1), float("-inf"))
        if use_p:
            ps = xs.softmax(-1)
            excl = ps.cumsum(-1) - ps  # mass strictly before each sorted token
            xs = xs.masked_fill(excl >= p.view(B, 1, 1), float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter_(-1, order, xs)
    return x.softmax(-1)


def flashinfer_probs(fi, lg, T_rows, k_rows, p_rows, use_k: bool, use_p: bool):
    B, N, V = lg.shape
    x = lg.view(B * N, V)
    if not hasattr(fi, "softmax"):  # older FlashInfer: torch's softmax as the first kernel
        probs = (x.float() / T_rows[:, None]).softmax(-1)
    else:
        try:
            probs = fi.softmax(x, temperature=T_rows)
        except Exception:  # noqa: BLE001 -- builds that take fp32 logits only
            probs = fi.softmax(x.float(), temperature=T_rows)
    if use_k:
        probs = fi.top_k_renorm_probs(probs, k_rows)
    if use_p:
        probs = fi.top_p_renorm_probs(probs, p_rows)
    return probs.view(B, N, V)


# ---------------------------------------------------------------------------- correctness
def subset(tree: treeops.Tree, rows: int) -> treeops.Tree:
    return treeops.Tree(*(t[:rows].cpu() for t in tree.tensors()))


def check_against_reference(tree, lg, res, sample=None, rows: int = 4) -> tuple[bool, str]:
    """treeops == reference on the first ``rows`` requests (sampling: a mismatch is tolerated
    only where shifting the uniforms or top_p by 1e-6 changes the reference's own answer)."""
    rows = min(rows, tree.batch_size)
    t = subset(tree, rows)
    x = lg[:rows].cpu()
    if sample is None:
        want = ref.accept_greedy(t, x)
    else:
        T, k, p, u = (a[:rows].cpu() for a in sample)
        want = ref.accept_sample(t, x, T, k, p, u)
    got = (res.accepted[:rows].cpu(), res.accept_len[:rows].cpu(), res.bonus[:rows].cpu())
    ok = (
        torch.equal(got[0], want.accepted)
        and torch.equal(got[1], want.accept_len)
        and torch.equal(got[2], want.bonus)
    )
    if ok:
        return True, ""
    if sample is not None:
        for du, dp in ((1e-6, 0), (-1e-6, 0), (0, 1e-6), (0, -1e-6)):
            r = ref.accept_sample(
                t, x, T, k, (p + dp).clamp(max=1.0), (u + du).clamp(0, 1 - 2**-24)
            )
            if not (torch.equal(r.accepted, want.accepted) and torch.equal(r.bonus, want.bonus)):
                return True, "mismatch within 1e-6 of an interval boundary (allowed)"
    return (
        False,
        f"treeops {got[1].tolist()}/{got[2].tolist()} != reference "
        f"{want.accept_len.tolist()}/{want.bonus.tolist()}",
    )


def agreement(a_path, a_len, a_bonus, res) -> float:
    same = (a_len.to(torch.int32) == res.accept_len) & (a_bonus == res.bonus)
    N = res.accepted.shape[1]
    d = torch.arange(N, device=DEV)[None, :]
    live = d < res.accept_len[:, None]
    same &= ((a_path.to(torch.int32) == res.accepted) | ~live).all(1)
    return float(same.float().mean())


# ------------------------------------------------------------------------------------ rows
def bench_accept_row(
    op: str, B: int, V: int, empty_us: float, fi, params=None, time_treeops=None
) -> dict:
    """One acceptance row: checked against the reference first (an incorrect row has no times).
    ``time_treeops(calls, reps)`` times treeops' calls (default: ``graph_time_us``)."""
    time_treeops = time_treeops or graph_time_us
    N = 64
    seed = B * 131 + V
    tree = bench_tree(B, N, V, seed)
    steps = max_depth(tree) + 1
    nbytes = B * N * V * 2
    copies, reps = rotation(nbytes)
    boost = 16.0 if op == "sampling" else 4.0
    lgs = [bench_logits(tree, V, seed + c, boost) for c in range(copies)]
    row = dict(op=op, B=B, N=N, V=V, dtype="bfloat16", copies=copies, reps=reps)
    row.update(
        floor_bytes_us=H.bytes_floor_us(nbytes),
        empty_kernel_us=empty_us,
        floor_us=H.floor_us(nbytes, empty_us=empty_us),
    )
    if op == "greedy":
        res = treeops.accept_greedy(tree, lgs[0])
        ok, why = check_against_reference(tree, lgs[0], res)
        row.update(correct=ok, note=why, mean_accept_len=float(res.accept_len.float().mean()))
        if not ok:
            return row
        path, L, bonus = torch_walk_greedy(lgs[0].argmax(-1), tree, steps)
        row["torch_agrees"] = agreement(path, L, bonus, res)
        row["treeops_us"] = time_treeops(
            [lambda x=x: treeops.accept_greedy(tree, x) for x in lgs], reps
        )
        row["treeops_eager_us"] = H.eager_us(
            lambda x=lgs[0]: treeops.accept_greedy(tree, x), device=DEV
        )
        row["treeops_two_launch_us"] = graph_time_us(
            [lambda x=x: accept_launch(tree, x, phase=1) for x in lgs], reps
        )
        row["torch_step1_us"] = graph_time_us([lambda x=x: x.argmax(-1) for x in lgs], reps)
        row["torch_us"] = graph_time_us(
            [lambda x=x: torch_walk_greedy(x.argmax(-1), tree, steps) for x in lgs], reps
        )
        row["walk_steps"] = steps
    else:
        Tv, kv, pv = params
        T = torch.full((B,), Tv, device=DEV)
        k = torch.full((B,), kv, device=DEV, dtype=torch.int32)
        p = torch.full((B,), pv, device=DEV)
        use_k, use_p = 0 < kv < V, pv < 1.0
        row.update(temperature=Tv, top_k=kv, top_p=pv)
        us = [
            torch.rand(B, N, device=DEV, generator=torch.Generator(device=DEV).manual_seed(c))
            for c in range(copies)
        ]
        # a row without truncation is called as an engine would whose batch has none: without
        # top-k / top-p tensors (no kept-set pass); ``treeops_tensor_params_us`` times the same
        # row with all-off tensors (three launches)
        plain = not (use_k or use_p)
        k_arg, p_arg = (None, None) if plain else (k, p)
        res = treeops.accept_sample(tree, lgs[0], T, k_arg, p_arg, us[0])
        ok, why = check_against_reference(tree, lgs[0], res, (T, k, p, us[0]))
        row.update(correct=ok, note=why, mean_accept_len=float(res.accept_len.float().mean()))
        if not ok:
            return row
        probs = torch_probs(lgs[0], T, k, p, use_k, use_p)
        path, L, bonus = torch_walk_sample(probs, tree, us[0], steps)
        del probs
        row["torch_agrees"] = agreement(path, L, bonus, res)
        pairs = list(zip(lgs, us))
        row["treeops_us"] = time_treeops(
            [lambda x=x, u=u: treeops.accept_sample(tree, x, T, k_arg, p_arg, u)
             for x, u in pairs],
            reps,
        )  # fmt: skip
        row["treeops_eager_us"] = H.eager_us(
            lambda x=lgs[0], u=us[0]: treeops.accept_sample(tree, x, T, k_arg, p_arg, u),
            device=DEV,
        )
        if plain:
            row["treeops_tensor_params_us"] = graph_time_us(
                [lambda x=x, u=u: treeops.accept_sample(tree, x, T, k, p, u) for x, u in pairs],
                reps,
            )
        if plain:  # the other form of the launch without a kept-set pass
            row["treeops_one_launch_us"] = graph_time_us(
                [
                    lambda x=x, u=u: accept_launch(
                        tree, x, temperature=T, top_k=None, top_p=None, uniforms=u, phase=0
                    )
                    for x, u in pairs
                ],
                reps,
            )
        row["torch_step1_us"] = graph_time_us(
            [lambda x=x: torch_probs(x, T, k, p, use_k, use_p) for x in lgs], reps
        )
        row["torch_us"] = graph_time_us(
            [
                lambda x=x, u=u: torch_walk_sample(
                    torch_probs(x, T, k, p, use_k, use_p), tree, u, steps
                )
                for x, u in pairs
            ],
            reps,
        )
        row["walk_steps"] = steps
        if fi is None:
            row["flashinfer_skipped"] = FI_REASON
        else:
            try:
                T_r = T.repeat_interleave(N)
                k_r = k.repeat_interleave(N)
                p_r = p.repeat_interleave(N)
                probs = flashinfer_probs(fi, lgs[0], T_r, k_r, p_r, use_k, use_p)
                path, L, bonus = torch_walk_sample(probs, tree, us[0], steps)
                del probs
                row["flashinfer_agrees"] = agreement(path, L, bonus, res)
                row["flashinfer_step1_us"] = graph_time_us(
                    [lambda x=x: flashinfer_probs(fi, x, T_r, k_r, p_r, use_k, use_p) for x in lgs],
                    reps,
                )
                row["flashinfer_us"] = graph_time_us(
                    [
                        lambda x=x, u=u: torch_walk_sample(
                            flashinfer_probs(fi, x, T_r, k_r, p_r, use_k, use_p), tree, u, steps
                        )
                        for x, u in pairs
                    ],
                    reps,
                )
            except Exception as e:  # noqa: BLE001 -- record why the peer did not run
                row["flashinfer_skipped"] = f"{type(e).__name__}: {e}"[:300]
    del lgs
    torch.cuda.empty_cache()
    return row


def topk_shapes(Bs, Vs, Ns):
    """The top-K rows' inputs per shape, V outermost: (B, N, V, tree, logits copies to rotate
    through, graph replays per timing, logits bytes)."""
    for V in Vs:
        for N in Ns:
            for B in Bs:
                seed = B * 131 + V + N
                tree = bench_tree(B, N, V, seed)
                nbytes = B * N * V * 2
                copies, reps = rotation(nbytes)
                lgs = [bench_logits(tree, V, seed + c, 4.0) for c in range(copies)]
                yield B, N, V, tree, lgs, reps, nbytes
                del lgs
                if DEV == "cuda":
                    torch.cuda.empty_cache()


def topk_rows(empty_us: float, Bs, Vs, Ns, K: int = 8) -> list[dict]:
    """Greedy acceptance with the target's top-``K`` ids of every node (``topk_ids``, what
    Graft's successor table learns from) next to greedy alone over the same logits, and the
    torch peer (``torch.topk`` over the logits, then the greedy op): what the fused top-K costs
    on top of the acceptance. ids checked against the reference first."""
    rows = []
    for B, N, V, tree, lgs, reps, nbytes in topk_shapes(Bs, Vs, Ns):
        got = treeops.accept_greedy(tree, lgs[0], topk_ids=K)
        cpu = subset(tree, min(B, 4))
        want = ref.accept_greedy(cpu, lgs[0][: cpu.parents.shape[0]].cpu(), topk_ids=K)
        ok = torch.equal(got.topk[: cpu.parents.shape[0]].cpu(), want.topk)
        row = dict(op="greedy_topk", B=B, N=N, V=V, K=K, dtype="bfloat16", copies=len(lgs),
                   reps=reps, correct=ok, empty_kernel_us=empty_us,
                   floor_us=H.floor_us(nbytes, empty_us=empty_us))  # fmt: skip
        if ok:
            row["treeops_us"] = graph_time_us(
                [lambda x=x, t=tree: treeops.accept_greedy(t, x, topk_ids=K) for x in lgs],
                reps,
            )
            row["greedy_alone_us"] = graph_time_us(
                [lambda x=x, t=tree: treeops.accept_greedy(t, x) for x in lgs], reps
            )
            row["torch_us"] = graph_time_us(
                [
                    lambda x=x, t=tree: (treeops.accept_greedy(t, x), torch.topk(x, K, -1))
                    for x in lgs
                ],
                reps,
            )
        rows.append(row)
    return rows


def topk_split_rows(empty_us: float, Bs, Vs, Ns, splits, K: int = 8) -> list[dict]:
    """Acceptance at forced split counts of pass 1 (``num_splits``) and the default, for greedy,
    temperature-only sampling and top-k 50 / top-p 0.9 sampling, with the top-``K`` ids (how
    many splits the walker's merge of every split's K candidates can afford) or, K = 0,
    without. Each forced launch's accepted path, bonus and top-K ids must equal the default
    launch's (``same_as_default``; sampling may differ where a uniform falls within rounding
    of a bucket's edge), and the default's the reference's (``correct``: the top-K ids, or with
    K = 0 ``check_against_reference``)."""
    rows = []
    tag = "_topk" if K else ""
    for B, N, V, tree, lgs, reps, nbytes in topk_shapes(Bs, Vs, Ns):
        T = torch.full((B,), 0.8, device=DEV)
        k = torch.full((B,), 50, dtype=torch.int32, device=DEV)
        p = torch.full((B,), 0.9, device=DEV)
        u = torch.rand(B, N, device=DEV)
        flavours = {
            "greedy": ({}, None),
            "sample": (dict(temperature=T, uniforms=u),
                       (T, torch.zeros_like(k), torch.ones_like(p), u)),
            "sample_trunc": (dict(temperature=T, top_k=k, top_p=p, uniforms=u),
                             (T, k, p, u)),
        }  # fmt: skip
        cpu = subset(tree, min(B, 4))
        for flavour, (kw, samp) in flavours.items():
            op = f"{flavour}{tag}_split"
            bases = [accept_launch(tree, x, topk_ids=K, **kw) for x in lgs]
            if K:
                want = ref.accept_greedy(cpu, lgs[0][: cpu.parents.shape[0]].cpu(), topk_ids=K)
                ok = torch.equal(bases[0].topk[: cpu.parents.shape[0]].cpu(), want.topk)
            else:
                ok = check_against_reference(tree, lgs[0], bases[0], samp)[0]
            for S in [None, *splits]:
                if S is not None and S > 16:
                    continue
                same = True
                for x, base in zip(lgs, bases):
                    r = accept_launch(tree, x, topk_ids=K, num_splits=S, **kw)
                    for name in ("accepted", "bonus") + (("topk",) if K else ()):
                        same &= torch.equal(getattr(r, name), getattr(base, name))
                t = graph_time_us(
                    [lambda x=x, t=tree, S=S, kw=kw: accept_launch(
                        t, x, topk_ids=K, num_splits=S, **kw) for x in lgs],
                    reps,
                )  # fmt: skip
                row = dict(op=op, B=B, N=N, V=V, K=K, splits=S or "default",
                           correct=ok, same_as_default=same, treeops_us=t,
                           floor_us=H.floor_us(nbytes, empty_us=empty_us))  # fmt: skip
                rows.append(row)
                print(f"{op} B={B} N={N} V={V} splits={row['splits']}: {t:.2f} us "
                      f"same={same} correct={ok}", flush=True)  # fmt: skip
    return rows


def sweep_inputs(B: int, N: int, V: int, boost: float, empty_us: float):
    """A sweep's inputs at one (B, V): the bench tree, enough logits copies to rotate through
    (``rotation``), the graph replays per timing and the byte floor."""
    tree = bench_tree(B, N, V, B * 131 + V)
    nbytes = B * N * V * 2
    copies, reps = rotation(nbytes)
    lgs = [bench_logits(tree, V, B * 131 + V + c, boost) for c in range(copies)]
    return tree, lgs, reps, H.floor_us(nbytes, empty_us=empty_us)


def sweep_rows(empty_us: float, Bs, Vs, rows: list | None = None) -> list[dict]:
    """Greedy (and temperature-only sampling) over launch configurations: vocabulary splits per
    node and block sizes; each configuration's outputs must equal the default launch's. Rows
    go to ``rows`` (a ``harness.SavedRows`` saves each as it comes), returned."""
    rows = [] if rows is None else rows
    N = 64
    for V in Vs:
        for B in Bs:
            tree, lgs, reps, floor = sweep_inputs(B, N, V, 4.0, empty_us)
            # the default launch on every copy, itself checked against the reference on the first
            bases = [treeops.accept_greedy(tree, x) for x in lgs]
            ok, why = check_against_reference(tree, lgs[0], bases[0])
            assert ok, f"default greedy launch differs from the reference: {why}"
            for bv, S, nw in itertools.product(
                (1024, 2048, 4096, 8192), (1, 2, 4, 8, 16, 32), (4, 8)
            ):
                if S * bv > V:
                    continue
                same = True
                for x, want in zip(lgs, bases):
                    r = accept_launch(tree, x, num_splits=S, block_v=bv, num_warps=nw)
                    same &= torch.equal(r.accepted, want.accepted)
                    same &= torch.equal(r.bonus, want.bonus)

                def run(x, t=tree, S=S, bv=bv, nw=nw):
                    return accept_launch(t, x, num_splits=S, block_v=bv, num_warps=nw)

                t = graph_time_us([lambda x=x: run(x) for x in lgs], reps)
                rows.append(
                    dict(op="greedy_sweep", B=B, N=N, V=V, block_v=bv, splits=S, num_warps=nw,
                         treeops_us=t, floor_us=floor, same_as_default=same)
                )  # fmt: skip
            T = torch.full((B,), 0.8, device=DEV)
            k = torch.zeros(B, dtype=torch.int32, device=DEV)
            p = torch.ones(B, device=DEV)
            u = torch.rand(B, N, device=DEV)
            sbs = [treeops.accept_sample(tree, x, T, k, p, u) for x in lgs]
            ok, why = check_against_reference(tree, lgs[0], sbs[0], (T, k, p, u))
            assert ok, f"default sampling launch differs from the reference: {why}"
            for bv, nw in itertools.product((512, 1024, 2048, 4096), (4, 8)):
                same = True
                for x, want in zip(lgs, sbs):
                    r = accept_launch(tree, x, temperature=T, top_k=k, top_p=p, uniforms=u,
                                      block_v=bv, num_warps=nw)  # fmt: skip
                    same &= torch.equal(r.accepted, want.accepted)
                    same &= torch.equal(r.bonus, want.bonus)
                t = graph_time_us(
                    [lambda x=x, t=tree, T=T, k=k, p=p, u=u, bv=bv, nw=nw: accept_launch(
                        t, x, temperature=T, top_k=k, top_p=p, uniforms=u, block_v=bv,
                        num_warps=nw)
                     for x in lgs],
                    reps,
                )  # fmt: skip
                rows.append(
                    dict(op="sampling_sweep", B=B, N=N, V=V, block_v=bv, splits=1, num_warps=nw,
                         treeops_us=t, floor_us=floor, same_as_default=same)
                )  # fmt: skip
            print(f"  sweep B={B} V={V} done", flush=True)
    return rows


def top_sweep_configs(cpu: bool = False) -> list[dict]:
    """The launch overrides ``--sweep-top`` times: pass 1's group count (the group maxima pass 2
    bounds the threshold with: more groups, fewer tokens reread; 2,048 is the default), then
    pass 2's reread tile at the default group count (a smaller tile takes fewer registers, so
    more programs an SM, for more serial reads). 512 groups and 8 warps for pass 2 are left out:
    they lost at every B on the H100 (docs/benchmarks.md, session 37); a configuration costs
    about 10 s of compiling a row."""
    if cpu:
        return [dict(max_groups=16), dict(reread=16, pass2_warps=4)]
    groups = [dict(max_groups=g) for g in (1024, 2048, 4096)]
    tiles = [dict(reread=r, pass2_warps=4) for r in (256, 1024)]
    return groups + tiles


def wide_reread_configs(cpu: bool = False) -> list[dict]:
    """The reread tiles ``--sweep-top-tiles`` times, for launches whose pass-2 programs have an
    SM each (B·N at most the SMs, where registers cost no occupancy): at V 128,256 a node's
    candidate groups take about 8 of the default's 512-token reads, each waiting on the last
    (``bench/pass2_phases.py``). Each spill-free on sm_90 (``bench/compile_check.py``; 4,096
    tokens spill at 4 warps)."""
    if cpu:
        return [dict(reread=32, pass2_warps=4), dict(reread=64, pass2_warps=8)]
    return [dict(reread=512, pass2_warps=4), dict(reread=1024, pass2_warps=4),
            dict(reread=2048, pass2_warps=4), dict(reread=2048, pass2_warps=8),
            dict(reread=4096, pass2_warps=8)]  # fmt: skip


def top_sweep_rows(empty_us: float, Bs, Vs, configs: list[dict],
                   rows: list | None = None) -> list[dict]:  # fmt: skip
    """Top-k 50 / top-p 0.9 sampling at each launch override of ``configs`` (keyword arguments
    of ``accept_launch``); each configuration's outputs must equal the default launch's. Rows
    go to ``rows`` as in ``sweep_rows``."""
    rows = [] if rows is None else rows
    N = 64
    for V in Vs:
        for B in Bs:
            tree, lgs, reps, floor = sweep_inputs(B, N, V, 16.0, empty_us)
            T = torch.full((B,), 0.8, device=DEV)
            k = torch.full((B,), 50, dtype=torch.int32, device=DEV)
            p = torch.full((B,), 0.9, device=DEV)
            u = torch.rand(B, N, device=DEV)
            sbs = [treeops.accept_sample(tree, x, T, k, p, u) for x in lgs]
            ok, why = check_against_reference(tree, lgs[0], sbs[0], (T, k, p, u))
            assert ok, f"default top-k/top-p launch differs from the reference: {why}"
            for cfg in configs:
                same = True
                for x, want in zip(lgs, sbs):
                    r = accept_launch(tree, x, temperature=T, top_k=k, top_p=p, uniforms=u,
                                      **cfg)  # fmt: skip
                    same &= torch.equal(r.accepted, want.accepted)
                    same &= torch.equal(r.bonus, want.bonus)
                t = graph_time_us(
                    [lambda x=x, tr=tree, T=T, k=k, p=p, u=u, cfg=cfg: accept_launch(
                        tr, x, temperature=T, top_k=k, top_p=p, uniforms=u, **cfg)
                     for x in lgs],
                    reps,
                )  # fmt: skip
                rows.append(
                    dict(op="top_sweep", B=B, N=N, V=V, top_k=50, top_p=0.9, **cfg,
                         treeops_us=t, floor_us=floor, same_as_default=same)
                )  # fmt: skip
                what = " ".join(f"{a}={b}" for a, b in cfg.items())
                print(f"  top-k/top-p B={B} V={V} {what}: {t:.1f} us same={same}", flush=True)
    return rows


def pass1_sweep_rows(empty_us: float, Bs, Vs, rows: list | None = None) -> list[dict]:
    """Pass 1's load forms, each against the others in the same run: ``vector_loads`` (the
    blocks' alignment told to the compiler: 16-byte loads; False: one element per load, the
    code before it) x ``ahead`` (the next block loaded before this one is reduced), for greedy
    at its default launch and at the sweep's best small-batch one (2,048-logit blocks, 16
    splits, 4 warps: ``accept_sweep.json``), plain sampling (all-off tensors; without them,
    pass 1 and the walk, and the one launch) and top-k 50 / top-p 0.9 sampling; each
    configuration's outputs must equal the default launch's. Rows go to ``rows`` as in
    ``sweep_rows``."""
    rows = [] if rows is None else rows
    N = 64
    forms = [(v, a) for v in (False, True) for a in (1, 2)]
    for V in Vs:
        for B in Bs:
            tree, lgs, reps, floor = sweep_inputs(B, N, V, 16.0, empty_us)
            T = torch.full((B,), 0.8, device=DEV)
            u = torch.rand(B, N, device=DEV)
            kinds = {
                "greedy": (None, {}),
                "greedy_s16": (None, dict(block_v=2048, num_splits=16, num_warps=4)),
                "sample": ((T, torch.zeros(B, dtype=torch.int32, device=DEV),
                            torch.ones(B, device=DEV), u), {}),
                "sample_top": ((T, torch.full((B,), 50, dtype=torch.int32, device=DEV),
                                torch.full((B,), 0.9, device=DEV), u), {}),
                # without top-k / top-p tensors: pass 1 and the walk, or one launch
                "sample_none": ((T, None, None, u), dict(phase=1)),
                "sample_none_fused": ((T, None, None, u), dict(phase=0)),
            }  # fmt: skip
            if V < 2048 * 16:
                del kinds["greedy_s16"]  # fewer logits than the 16 splits' blocks
            for kind, (smp, tune) in kinds.items():
                extra = {}
                if smp is not None:
                    extra = dict(temperature=smp[0], top_k=smp[1], top_p=smp[2], uniforms=smp[3])
                bases = [accept_launch(tree, x, **extra) for x in lgs]
                if smp is not None and smp[1] is None:  # the reference's all-off tensors
                    smp = (T, torch.zeros(B, dtype=torch.int32, device=DEV),
                           torch.ones(B, device=DEV), u)  # fmt: skip
                ok, why = check_against_reference(tree, lgs[0], bases[0], smp)
                assert ok, f"default {kind} launch differs from the reference: {why}"
                for vec, ahead in forms:
                    kw = dict(extra, **tune, vector_loads=vec, ahead=ahead)
                    same = True
                    for x, want in zip(lgs, bases):
                        r = accept_launch(tree, x, **kw)
                        same &= torch.equal(r.accepted, want.accepted)
                        same &= torch.equal(r.bonus, want.bonus)
                    t = graph_time_us(
                        [lambda x=x, t=tree, kw=kw: accept_launch(t, x, **kw) for x in lgs], reps
                    )
                    rows.append(
                        dict(op="pass1_sweep", kind=kind, B=B, N=N, V=V, vector_loads=vec,
                             ahead=ahead, **tune, treeops_us=t, floor_us=floor,
                             same_as_default=same)
                    )  # fmt: skip
                    print(f"  {kind} B={B} V={V} vector_loads={vec} ahead={ahead}: {t:.1f} us "
                          f"same={same}", flush=True)  # fmt: skip
    return rows


FI_REASON = ""


def main() -> None:
    global FI_REASON
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for accept.json")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument(
        "--no-compact", action="store_true", help="leave out KV compaction's rows (op 8)"
    )
    ap.add_argument("--quick", action="store_true", help="V = 32000 and B = 8 only")
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="only time launch configurations (block size, splits, warps): accept_sweep.json",
    )
    ap.add_argument(
        "--sweep-top",
        action="store_true",
        help="only top-k 50 / top-p 0.9 sampling over pass 1's group count and pass 2's reread "
        "tile x warps: accept_top_sweep.json",
    )
    ap.add_argument(
        "--sweep-top-tiles",
        action="store_true",
        help="only top-k 50 / top-p 0.9 sampling over pass 2's wide reread tiles x warps "
        "(small B): accept_top_tiles.json",
    )
    ap.add_argument(
        "--sweep-pass1",
        action="store_true",
        help="only pass 1's load forms (vector loads, a block loaded ahead) for greedy, "
        "sampling and top-k/top-p sampling: accept_pass1_sweep.json",
    )
    ap.add_argument(
        "--topk",
        action="store_true",
        help="only greedy with the fused top-8 ids (Graft's table input) against greedy alone "
        "and torch.topk, V = 8192 and 32000 (--vocabs), N = 7 and 64 (--topk-nodes): "
        "accept_topk.json",
    )
    ap.add_argument(
        "--topk-splits",
        default=None,
        help="only acceptance with the top-8 ids (--topk-ids; greedy, sampling, top-k/top-p "
        "sampling) at these forced split counts and the default ('default': the default "
        "alone), V = 8192 and 32000 (--vocabs), N from --topk-nodes: accept_topk_splits.json",
    )
    ap.add_argument(
        "--topk-ids",
        type=int,
        default=8,
        help="--topk-splits only: the top-K ids each launch returns (0: none)",
    )
    ap.add_argument(
        "--batches", default=None, help="comma-separated batch sizes (default 1,8,64; --quick 8)"
    )
    ap.add_argument(
        "--topk-nodes", default="7,64", help="--topk only: comma-separated node counts N"
    )
    ap.add_argument(
        "--vocabs", default=None, help="comma-separated vocabulary sizes (default 32000,128256)"
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=240.0,
        help="stop starting new rows (and FlashInfer peers past 60%%) after this",
    )
    ap.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="tiny sizes on CPU under TRITON_INTERPRET=1 (checks the script only)",
    )
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.cpu_dry_run:
        global DEV
        DEV = "cpu"
        args.no_flashinfer = True
    else:
        assert torch.cuda.is_available(), "needs a CUDA GPU"
    t_start = time.time()
    fi = None
    if args.no_flashinfer:
        FI_REASON = "disabled by --no-flashinfer"
    else:
        try:
            import flashinfer.sampling as fi  # noqa: F811
        except Exception as e:  # noqa: BLE001
            FI_REASON = f"flashinfer.sampling not importable: {type(e).__name__}: {e}"[:300]
    empty_us = H.empty_kernel_us(DEV)
    Bs = [8] if args.quick else [1, 8, 64]
    if args.batches:
        Bs = [int(b) for b in args.batches.split(",")]
    Vs = [32000] if args.quick else [32000, 128256]
    if args.vocabs:
        Vs = [int(v) for v in args.vocabs.split(",")]
    if args.cpu_dry_run:
        Bs, Vs = [1, 2], [300]
    Vt = [int(v) for v in args.vocabs.split(",")] if args.vocabs else [8192, 32000]
    if args.cpu_dry_run:
        Vt = [300]
    if args.topk_splits:
        splits = [int(x) for x in args.topk_splits.split(",") if x != "default"]
        rows = topk_split_rows(
            empty_us, Bs, Vt, [int(n) for n in args.topk_nodes.split(",")], splits,
            K=args.topk_ids,
        )  # fmt: skip
        doc = H.result_doc(DEV, empty_kernel_graph_us=empty_us, rows=rows)
        H.write_json(os.path.join(args.out, "accept_topk_splits.json"), doc)
        return
    if args.topk:
        rows = topk_rows(empty_us, Bs, Vt, [int(n) for n in args.topk_nodes.split(",")])
        doc = H.result_doc(DEV, empty_kernel_graph_us=empty_us, rows=rows)
        H.write_json(os.path.join(args.out, "accept_topk.json"), doc)
        for r in rows:
            print(f"greedy top-{r['K']} B={r['B']} N={r['N']} V={r['V']}: correct={r['correct']} "
                  f"treeops {r.get('treeops_us', float('nan')):.1f} us, greedy alone "
                  f"{r.get('greedy_alone_us', float('nan')):.1f}, greedy + torch.topk "
                  f"{r.get('torch_us', float('nan')):.1f}, floor {r['floor_us']:.1f}")  # fmt: skip
        return

    def saved(name: str) -> H.SavedRows:
        """The sweep's rows, its JSON rewritten with each (a stage's time limit keeps them)."""
        head = H.result_doc(DEV, empty_kernel_graph_us=empty_us)
        return H.SavedRows(os.path.join(args.out, name), lambda rows: dict(head, rows=rows))

    if args.sweep_top:
        configs = top_sweep_configs(args.cpu_dry_run)
        top_sweep_rows(empty_us, Bs, Vs, configs, saved("accept_top_sweep.json"))
        return
    if args.sweep_top_tiles:
        configs = wide_reread_configs(args.cpu_dry_run)
        top_sweep_rows(empty_us, Bs, Vs, configs, saved("accept_top_tiles.json"))
        return
    if args.sweep_pass1:
        pass1_sweep_rows(empty_us, Bs, Vs, saved("accept_pass1_sweep.json"))
        return
    if args.sweep:
        rows = sweep_rows(empty_us, Bs, Vs, saved("accept_sweep.json"))
        for op in ("greedy_sweep", "sampling_sweep"):
            for V in Vs:
                for B in Bs:
                    rs = [r for r in rows if r["op"] == op and r["B"] == B and r["V"] == V]
                    rs = [r for r in rs if r["same_as_default"]]  # a wrong answer is not fast
                    if not rs:
                        continue
                    b = min(rs, key=lambda r: r["treeops_us"])
                    d = [r for r in rs if r["block_v"] == (4096 if op[0] == "g" else 2048)]
                    print(f"{op} B={B} V={V}: best {b['treeops_us']:.1f} us (block {b['block_v']},"
                          f" splits {b['splits']}, warps {b['num_warps']}, same="
                          f"{b['same_as_default']}); floor {b['floor_us']:.1f}; block-default rows "
                          + ", ".join(f"S{r['splits']}w{r['num_warps']}:{r['treeops_us']:.1f}"
                                      for r in d))  # fmt: skip
        return
    rows = []

    def add(r):
        rows.append(r)
        t = r.get("treeops_us")
        print(
            f"  {r['op']:<11} B={r['B']:<3} V={r.get('V')!s:<7} "
            f"treeops={t if t is None else round(t, 1)}"
            f" torch={r.get('torch_us') and round(r['torch_us'], 1)} correct={r.get('correct')}"
            f" [{time.time() - t_start:.0f}s]",
            flush=True,
        )

    path = os.path.join(args.out, "accept.json")

    def save():
        # rewritten after every row, so a stage time limit still leaves the rows measured so far
        H.ratios(rows, ("torch", "flashinfer"))
        out = H.result_doc(
            DEV,
            hbm_bytes_per_s=H.ceilings()["hbm_bytes_per_s"],
            empty_kernel_graph_us=empty_us,
            wall_s=round(time.time() - t_start, 1),
            rows=rows,
        )
        H.write_json(path, out)
        return out

    jobs = []
    for op, params in (("greedy", None), ("sampling", (0.8, 0, 1.0)), ("sampling", (0.8, 50, 0.9))):
        for V in Vs:
            for B in Bs:
                jobs.append(
                    lambda op=op, B=B, V=V, params=params: bench_accept_row(
                        op, B, V, empty_us, fi, params
                    )
                )
    if not args.no_compact:
        import bench_compact_kv

        bench_compact_kv.DEV = DEV
        for B in Bs:
            jobs.append(lambda B=B: bench_compact_kv.bench_compact_row(B, empty_us))
    for job in jobs:
        if time.time() - t_start > args.budget_s:
            print(f"time budget of {args.budget_s} s spent: {len(jobs) - len(rows)} rows skipped")
            break
        if fi is not None and time.time() - t_start > 0.6 * args.budget_s:
            FI_REASON = "skipped to stay within --budget-s"
            fi = None
        add(job())
        save()
    out = save()

    def fmt(x):
        return "-" if x is None else (f"{x:.1f}" if isinstance(x, float) else str(x))

    print(
        f"\n{out['gpu']}  commit {out['commit'][:10]}  empty-kernel graph replay {empty_us:.2f} us"
        f"  ({out['wall_s']} s) -> {path}"
    )
    hdr = (
        "op",
        "B",
        "V",
        "T/k/p",
        "treeops",
        "other form",  # greedy: the walk launched apart; plain sampling: one launch
        "torch",
        "flashinfer",
        "floor",
        "x floor",
        "x torch",
        "ok",
        "acc len",
    )
    print(" | ".join(f"{h:>10}" for h in hdr))
    for r in rows:
        tkp = "" if r["op"] != "sampling" else f"{r['temperature']}/{r['top_k']}/{r['top_p']}"
        cells = (
            r["op"],
            r["B"],
            r.get("V"),
            tkp,
            r.get("treeops_us"),
            r.get("treeops_two_launch_us", r.get("treeops_one_launch_us")),
            r.get("torch_us"),
            r.get("flashinfer_us"),
            r["floor_us"],
            r.get("treeops_over_floor"),
            r.get("treeops_over_torch"),
            r.get("correct"),
            r.get("mean_accept_len"),
        )
        print(" | ".join(f"{fmt(c):>10}" for c in cells))


# ------------------------------------------------------------------------------ pytest
def _flashinfer_sampling():
    global FI_REASON
    try:
        import flashinfer.sampling as fi
    except Exception as e:  # noqa: BLE001
        FI_REASON = f"flashinfer.sampling not importable: {type(e).__name__}: {e}"[:300]
        return None
    return fi


@pytest.mark.parametrize(
    "op,params", [("greedy", None), ("sampling", (0.8, 50, 0.9))], ids=["greedy", "sampling"]
)
def test_accept(benchmark, op, params):
    """B = 8, N = 64, V = 128256 (Llama 3), bf16 logits; sampling with temperature 0.8, top-k
    50, top-p 0.9. Peers: the torch pipeline, and FlashInfer's renorm kernels where importable."""
    fi = _flashinfer_sampling() if op == "sampling" else None
    row = bench_accept_row(
        op, 8, 128256, H.empty_kernel_us(), fi, params,
        time_treeops=lambda calls, reps: H.benchmark_graph(benchmark, calls, reps),
    )  # fmt: skip
    assert row["correct"], row["note"]
    H.ratios([row], ("torch", "flashinfer"))
    H.record(benchmark, row)


if __name__ == "__main__":
    main()
