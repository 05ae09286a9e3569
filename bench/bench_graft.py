# ruff: noqa: B023  (the timed thunks run within the loop iteration that defines them)
"""Graft on the GPU: retrieve + merge + rebuild, and the table update, against PyTorch.

    python bench/bench_graft.py --out DIR

For B in {1, 8, 64}, V in {32000, 128256}, capacity N = 64, budget 60 (root included), the
default 80-node template and k = 8:

- ``retrieve_merge``: ``treeops.graft`` (one fused launch) on a draft tree pruned to 25 nodes,
  against the same steps written as sync-free batched PyTorch (``torch_graft`` below);
- ``update``: ``AdjacencyTable.update`` from bf16 target logits [B, 64, V] of 60 verified nodes
  (fused top-8 over V + duplicate resolution), against ``torch.topk`` + ``scatter_reduce``;
- ``update_ids``: the same from acceptance's ``topk_ids`` (no logits pass).

``--sweep-update`` times the update's configurations instead (``graft_update_sweep.json``) and
``--learn`` a decoder's per-step learning two ways (``graft_learn.json``): acceptance with the
fused top-k ids then the update from them, against acceptance alone then the update from the
logits.

Every timed call is captured in a CUDA graph (``harness.graph_us``: R calls on rotated inputs
per graph, so the L2 does not hold them) and replayed; the time per call is the median over
replays (``treeops_eager_us``: one eager call, host included). The floor is max(bytes that
must move / 4.3 TB/s, an empty kernel replayed the same way in the same run). Each treeops output
is checked against the reference first (exact equality); a mismatch is reported instead of a
time. Writes DIR/graft.json and prints a short table last; ``python -m pytest
bench/bench_graft.py --benchmark-only`` times one row per op (B = 8, V = 128256).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import harness as H
import pytest
import torch

from treeops import AdjacencyTable, RankTemplate, Tree, accept_greedy, graft, graft_tail, prune
from treeops.reference import graft as ref

INT32_MAX = 2**31 - 1


# ----------------------------------------------------------------------------- PyTorch peers


_LEVELS: dict = {}


def _levels(template: RankTemplate, dev: torch.device) -> list[tuple[torch.Tensor]]:
    """Template columns of each depth on ``dev``, copied once (not inside a graph capture)."""
    key = (id(template), str(dev))
    if key not in _LEVELS:
        _LEVELS[key] = [
            (torch.nonzero(template.depth == d).flatten().to(dev),)
            for d in range(1, template.max_depth + 1)
        ]
    return _LEVELS[key]


def torch_graft(tree: Tree, table: torch.Tensor, template: RankTemplate, budget: int) -> Tree:
    """Retrieve + trie merge + rebuild as batched, sync-free PyTorch (capturable in a graph):
    the template is static, so each depth is a fixed set of columns."""
    B, N = tree.parents.shape
    W = tree.anc.shape[2]
    V = table.shape[0]
    dev = tree.parents.device
    T = template.size
    t_par, t_rank, t_dep = template.tensors(dev)
    levels = _levels(template, dev)
    cap = min(budget, N)
    n_draft = torch.clamp(tree.num_nodes, max=cap).long()
    active = n_draft > 0
    ii = torch.arange(N, device=dev)
    dmask = (ii[None] < n_draft[:, None]) & (ii[None] > 0)
    d_par = torch.where(dmask, tree.parents.long(), -2)
    rtok = torch.full((B, T), -1, dtype=torch.int64, device=dev)
    rtok[:, 0] = tree.tokens[:, 0]
    key = torch.full((B, T), -1, dtype=torch.int64, device=dev)
    key[:, 0] = 0
    pkey = torch.full((B, T), -1, dtype=torch.int64, device=dev)
    new = torch.zeros(B, T, dtype=torch.bool, device=dev)
    ranc = torch.zeros(B, T, W, dtype=torch.int64, device=dev)
    ranc[:, 0, 0] = 1
    n_used = n_draft.clone()
    words = torch.arange(W, device=dev)
    for (cols,) in levels:
        L = cols.shape[0]
        pcols = t_par[cols].long()
        ptok = rtok[:, pcols]  # [B, L]
        pk = key[:, pcols]
        look = (ptok >= 0) & (ptok < V)
        nt = table[ptok.clamp(0, V - 1), t_rank[cols].long()[None, :].expand(B, L)].long()
        got = look & (nt >= 0) & (nt < V)
        nt = torch.where(got, nt, -1)
        rtok[:, cols] = nt
        live = got & (pk >= 0) & active[:, None]
        match = (d_par[:, None, :] == pk[:, :, None]) & (tree.tokens[:, None, :] == nt[:, :, None])
        dm = torch.where(match, ii, N).amin(-1)  # [B, L]
        un = live & (dm == N)
        ll = torch.arange(L, device=dev)
        same = (
            un[:, :, None]
            & un[:, None, :]
            & (pk[:, :, None] == pk[:, None, :])
            & (nt[:, :, None] == nt[:, None, :])
        )
        canon = torch.where(same, ll, L).amin(-1)
        first = un & (canon == ll)
        idx = n_used[:, None] + torch.cumsum(first.long(), 1) - 1
        kept = first & (idx < cap)
        n_used = n_used + first.long().sum(1)
        ckey = torch.where(kept, idx, -1)
        dup = ckey.gather(1, canon.clamp(max=L - 1))
        k = torch.where(live, torch.where(un, dup, dm), -1)
        key[:, cols] = k
        pkey[:, cols] = pk
        new[:, cols] = kept
        kc = k.clamp(min=0)
        bit = torch.where((kc // 32)[:, :, None] == words, (1 << (kc % 32))[:, :, None], 0)
        row = ranc[:, pcols] | bit
        ranc[:, cols] = torch.where((k >= 0)[:, :, None], row, ranc[:, cols])
    n_out = torch.minimum(n_used, torch.full_like(n_used, cap))
    keepd = ii[None] < n_draft[:, None]
    dest = torch.where(new, key, N)  # column N: a dummy slot for nodes that are not new

    def scatter(base: torch.Tensor, vals: torch.Tensor, pad) -> torch.Tensor:
        ext = torch.cat([torch.where(keepd, base, pad), base[:, :1]], 1)
        ext.scatter_(1, dest, vals.to(base.dtype))
        return ext[:, :N]

    tokens = scatter(tree.tokens, rtok, 0)
    parents = scatter(tree.parents, pkey, -1)
    depth = scatter(tree.depth, t_dep.long()[None].expand(B, T), 0)
    anc32 = ((ranc + 2**31) % 2**32 - 2**31).to(torch.int32)  # bit 31 is the sign bit
    anc_ext = torch.cat([torch.where(keepd[:, :, None], tree.anc, 0), tree.anc[:, :1]], 1)
    anc_ext.scatter_(1, dest[:, :, None].expand(B, T, W), anc32)
    anc = anc_ext[:, :N]
    valid = ii[None] < n_out[:, None]
    par = torch.where(valid, parents, -1)
    child_of = (par[:, None, :] == ii[None, :, None]) & valid[:, None, :]
    fc = torch.where(child_of, ii, N).amin(-1)
    sib = (
        (par[:, :, None] == par[:, None, :])
        & (par[:, :, None] >= 0)
        & valid[:, :, None]
        & valid[:, None, :]
        & (ii[None, None, :] > ii[None, :, None])
    )
    ns = torch.where(sib, ii, N).amin(-1)
    return Tree(
        tokens=torch.where(valid, tokens, 0),
        parents=par,
        num_nodes=n_out.to(torch.int32),
        depth=torch.where(valid, depth, 0),
        anc=torch.where(valid[:, :, None], anc, 0),
        first_child=torch.where(valid & (fc < N), fc, -1).to(torch.int32),
        next_sibling=torch.where(valid & (ns < N), ns, -1).to(torch.int32),
        scores=torch.where(keepd & valid, tree.scores, 0.0),
    )


class TorchTable:
    """The update as sync-free PyTorch: owner by ``scatter_reduce(amin)``, ``torch.topk``, rows
    written by ``index_copy_`` (non-winners go to a dummy row V)."""

    def __init__(self, V: int, k: int, device):
        self.table = torch.full((V + 1, k), -1, dtype=torch.int32, device=device)
        self.owner = torch.full((V + 1,), INT32_MAX, dtype=torch.int64, device=device)
        self.V, self.k = V, k

    def update(self, tokens, num_nodes, logits=None, topk_ids=None) -> None:
        B, N = tokens.shape
        flat = torch.arange(B * N, device=tokens.device)
        valid = (torch.arange(N, device=tokens.device)[None] < num_nodes[:, None]).flatten()
        tok = torch.where(valid, tokens.flatten(), self.V)
        self.owner.fill_(INT32_MAX)
        self.owner.scatter_reduce_(0, tok, flat, "amin")
        win = valid & (self.owner[tok] == flat)
        dest = torch.where(win, tok, self.V)
        if logits is not None:
            rows = torch.topk(logits.view(B * N, -1), self.k, dim=1).indices.to(torch.int32)
        else:
            rows = topk_ids.reshape(B * N, -1)[:, : self.k]
        self.table.index_copy_(0, dest, rows)


# ----------------------------------------------------------------------------- inputs


def random_tree(B: int, N: int, n: int, V: int, gen: torch.Generator, device) -> Tree:
    """B random draft trees of n nodes in rank order, siblings' tokens distinct (V large)."""
    par = torch.full((B, N), -1, dtype=torch.int32)
    for i in range(1, n):
        recent = torch.randint(max(0, i - 3), i, (B,), generator=gen)
        anyp = torch.randint(0, i, (B,), generator=gen)
        pick = torch.rand(B, generator=gen) < 0.5
        par[:, i] = torch.where(pick, anyp, recent).to(torch.int32)
    tok = torch.randint(0, V, (B, N), generator=gen)
    scores = torch.sort(torch.rand(B, N, generator=gen), dim=1, descending=True).values
    scores[:, 0] = 1.0
    num = torch.full((B,), n, dtype=torch.int32)
    return Tree.from_parents(par, num, tok, scores).to(device)


def random_table(V: int, k: int, gen: torch.Generator, device) -> AdjacencyTable:
    t = AdjacencyTable(V, k, device=device)
    vals = torch.randint(0, V, (V, k), generator=gen, dtype=torch.int32)
    empty = torch.rand(V, k, generator=gen) < 0.1
    t.table.copy_(torch.where(empty, -1, vals).to(device))
    return t


# ----------------------------------------------------------------------------- timing


def tree_equal(a: Tree, b: Tree) -> bool:
    return all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a.tensors(), b.tensors()))


def stable_topk_table(tokens, num_nodes, logits, k, V, base):
    """The update's exact result (ties to the lowest id, lowest flat index wins), on device."""
    B, N = tokens.shape
    want = base.clone()
    flat = torch.arange(B * N, device=tokens.device)
    valid = (torch.arange(N, device=tokens.device)[None] < num_nodes[:, None]).flatten()
    tok = torch.where(valid, tokens.flatten(), V)
    owner = torch.full((V + 1,), INT32_MAX, dtype=torch.int64, device=tokens.device)
    owner.scatter_reduce_(0, tok, flat, "amin")
    win = (valid & (owner[tok] == flat)).nonzero().flatten()
    x = logits.view(B * N, V)[win].float()
    ids = torch.sort(-x, dim=1, stable=True).indices[:, :k].to(torch.int32)
    want[tok[win]] = ids
    return want


# ----------------------------------------------------------------------------- templates


def walk_lengths(r, stream: torch.Tensor, pos: torch.Tensor) -> list[int]:
    """Per request b of a ``Retrieved`` ``r`` rooted at ``stream[pos[b]]``: how many of the
    following tokens of ``stream`` its tree holds as one root path (the accepted length of
    retrieval alone)."""
    lens = []
    for b in range(len(pos)):
        n = int(r.num_nodes[b])
        toks, par = r.tokens[b, :n].tolist(), r.parents[b, :n].tolist()
        kids: dict[int, dict[int, int]] = {}
        for j in range(1, n):
            kids.setdefault(par[j], {}).setdefault(toks[j], j)
        node, depth = 0, 0
        while True:
            nxt = kids.get(node, {}).get(int(stream[int(pos[b]) + depth + 1]))
            if nxt is None:
                break
            node, depth = nxt, depth + 1
        lens.append(depth)
    return lens


def template_coverage(
    text_bytes: bytes,
    templates: dict[str, RankTemplate],
    k: int = 8,
    positions: int = 4000,
    seed: int = 0,
) -> dict[str, float]:
    """Mean accepted length of retrieval alone on real text: a byte-level table (V = 256) learns
    each byte's top-k successors (by count) from the first 80 % of the text, then from random
    positions of the rest each template's retrieved tree is walked along the true continuation.
    Runs on CPU (the reference retrieval)."""
    data = torch.tensor(list(text_bytes), dtype=torch.int64)
    cut = int(len(data) * 0.8)
    train, test = data[:cut], data[cut:]
    counts = torch.zeros(256, 256, dtype=torch.float64)
    counts.index_put_(
        (train[:-1], train[1:]), torch.ones(len(train) - 1, dtype=torch.float64), accumulate=True
    )
    table = AdjacencyTable(256, k)
    table.warm_start(torch.arange(256)[None], counts[None].float())
    table.table[counts.sum(1) == 0] = -1
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, len(test) - 16, (positions,), generator=g)
    out = {}
    for name, tpl in templates.items():
        out[name] = sum(walk_lengths(table.retrieve(test[pos], tpl), test, pos)) / positions
    return out


def coverage_main(path: str) -> None:
    text = b""
    root = os.path.dirname(os.__file__)
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            with open(os.path.join(root, name), "rb") as f:
                text += f.read()
        if len(text) > 4_000_000:
            break
    tpls = {
        "default (80, rank-probs)": RankTemplate.default(),
        "balanced 4x3 (85)": RankTemplate.balanced(4, 3),
        "balanced 8x2 (73)": RankTemplate.balanced(8, 2),
        "chain 9 (10)": RankTemplate.chain(9),
        "flatter probs (80)": RankTemplate.from_rank_probs(
            [0.4, 0.2, 0.12, 0.08, 0.06, 0.05, 0.04, 0.03], 80, 9
        ),
    }
    res = template_coverage(text, tpls)
    print(
        f"mean accepted length of retrieval alone, byte-level table, {len(text)} bytes of "
        f"{path or 'stdlib'} source:"
    )
    for name, v in res.items():
        print(f"  {name:28s} {v:.3f}")


# ----------------------------------------------------------------------------- main


def setup(B: int, V: int, gen: torch.Generator, dev) -> dict:
    """Inputs of one (B, V): draft trees of 60 nodes, the tree pruned to 25 nodes, a random
    table [V, 8] some of whose entries coincide with the pruned tree's children."""
    N, k, n_verify = 64, 8, 60
    tree = random_tree(B, N, n_verify, V, gen, dev)
    pruned = prune(tree, 24)
    table = random_table(V, k, gen, dev)
    # make some retrieved tokens coincide with draft children (the trie reuses them)
    tab_cpu = table.table.cpu()
    tk, pr = pruned.tokens.cpu(), pruned.parents.cpu()
    for b in range(B):
        for i in range(1, 25, 3):
            tab_cpu[int(tk[b, int(pr[b, i])]), i % k] = int(tk[b, i])
    table.table.copy_(tab_cpu.to(dev))
    return dict(B=B, V=V, N=N, k=k, n_verify=n_verify, budget=60, tree=tree, pruned=pruned,
                table=table, tab_cpu=tab_cpu, tpl=RankTemplate.default(), dev=dev)  # fmt: skip


def _row(op: str, c: dict, **kw) -> dict:
    return dict(op=op, B=c["B"], budget=c["budget"], V=c["V"], N=c["N"], **kw)


def _timer(dev):
    return lambda calls: H.graph_us(calls, device=dev)


def row_retrieve_merge(c: dict, empty_us: float, time_treeops=None) -> dict:
    """``graft`` against the reference (exact), then timed against ``torch_graft``."""
    timer = _timer(c["dev"])
    time_treeops = time_treeops or timer
    pruned, table, tpl, budget = c["pruned"], c["table"], c["tpl"], c["budget"]
    B, N = c["B"], c["N"]
    want = ref.graft(pruned.to("cpu"), c["tab_cpu"], tpl, budget)
    _levels(tpl, c["dev"])
    ok = tree_equal(graft(pruned, table, tpl, budget), want)
    ok_torch = tree_equal(torch_graft(pruned, table.table, tpl, budget), want)
    W = c["tree"].anc.shape[2]
    tree_bytes = B * N * (8 + 4 * 6 + 4 * W) + B * 4
    nbytes = 2 * tree_bytes + B * tpl.size * 4
    row = _row("retrieve_merge", c, floor_us=H.floor_us(nbytes, empty_us=empty_us),
               bytes=nbytes, match=ok, torch_match=ok_torch)  # fmt: skip
    row["treeops_us"] = (
        time_treeops([lambda: graft(pruned, table, tpl, budget)] * 16) if ok else None
    )
    if ok:
        row["treeops_eager_us"] = H.eager_us(
            lambda: graft(pruned, table, tpl, budget), device=c["dev"]
        )
    row["torch_us"] = (
        timer([lambda: torch_graft(pruned, table.table, tpl, budget)] * 4) if ok_torch else None
    )
    return row


def update_inputs(c: dict, empty_us: float):
    """The update rows' inputs: bf16 logits rotating through >= 256 MB, the table before the
    update, the exact table after it (from the first logits) and the byte floor."""
    B, N, V, k, dev = c["B"], c["N"], c["V"], c["k"], c["dev"]
    R = max(2, min(64, (256 << 20) // (B * N * V * 2) + 1))
    logits = [torch.randn(B, N, V, device=dev, dtype=torch.bfloat16) * 3 for _ in range(R)]
    base = c["table"].table.clone()
    tree = c["tree"]
    want = stable_topk_table(tree.tokens, tree.num_nodes, logits[0], k, V, base)
    nbytes = B * c["n_verify"] * V * 2 + B * c["n_verify"] * (k * 4 + 8)
    return logits, base, want, nbytes, H.floor_us(nbytes, empty_us=empty_us)


def row_update(c: dict, empty_us: float, time_treeops=None) -> dict:
    """``AdjacencyTable.update`` from bf16 logits against its exact result, then timed against
    ``TorchTable``; logits rotate through >= 256 MB."""
    timer = _timer(c["dev"])
    time_treeops = time_treeops or timer
    V, k, dev = c["V"], c["k"], c["dev"]
    tree, table = c["tree"], c["table"]
    logits, base, want_t, nbytes, floor = update_inputs(c, empty_us)
    table.update(tree, logits[0])
    ok = torch.equal(table.table, want_t)
    again = AdjacencyTable(V, k, device=dev)
    again.table.copy_(base)
    again.update(tree, logits[0])
    ok = ok and torch.equal(again.table, want_t)  # deterministic
    ttab = TorchTable(V, k, dev)
    row = _row("update", c, floor_us=floor, bytes=nbytes, match=ok)
    row["treeops_us"] = (
        time_treeops([(lambda lg=lg: table.update(tree, lg)) for lg in logits]) if ok else None
    )
    if ok:
        row["treeops_eager_us"] = H.eager_us(lambda: table.update(tree, logits[0]), device=dev)
    row["torch_us"] = timer(
        [(lambda lg=lg: ttab.update(tree.tokens, tree.num_nodes, lg)) for lg in logits]
    )
    table.table.copy_(base)
    return row


def sweep_update_rows(c: dict, empty_us: float, configs=None) -> list[dict]:
    """``AdjacencyTable.update`` from bf16 logits under each configuration
    (``kernels.graft_update.UPDATE_TUNING``: block, programs per SM, warps, top-k method,
    merge), each checked against the exact result first; the default configuration is restored
    afterwards."""
    import itertools

    from treeops.kernels import graft_update as kg

    timer = _timer(c["dev"])
    B, N, V, k, dev = c["B"], c["N"], c["V"], c["k"], c["dev"]
    tree = c["tree"]
    logits, base, want, _, floor = update_inputs(c, empty_us)
    default = dict(kg.UPDATE_TUNING)
    # the running list (group 0) near its sweep's best with either merge, group maxima over a
    # grid, and session 22's best group configuration with the bitonic merge
    grid = itertools.product((16, 32), (512, 1024, 2048), (8, 16, 32), (1, 2, 4))
    configs = configs or (
        [dict(block_v=512, programs_per_sm=pps, num_warps=1, group=0, merge=m)
         for pps, m in itertools.product((16, 32), ("passes", "bitonic"))]
        + [dict(block_v=bv, programs_per_sm=pps, num_warps=nw, group=g, merge="passes")
           for g, bv, pps, nw in grid]
        + [dict(block_v=2048, programs_per_sm=pps, num_warps=1, group=16, merge="bitonic")
           for pps in (16, 32)]
    )  # fmt: skip
    rows = []
    try:
        for cfg in configs:
            kg.UPDATE_TUNING.clear()
            kg.UPDATE_TUNING.update(default, **cfg)  # a configuration names what it changes
            table = AdjacencyTable(V, k, device=dev)  # a workspace sized by this configuration
            table.table.copy_(base)
            table.update(tree, logits[0])
            ok = torch.equal(table.table, want)
            t = timer([(lambda lg=lg: table.update(tree, lg)) for lg in logits]) if ok else None
            S = kg.update_splits(B * N, V, dev)
            # the stage-1 block and warps in effect (``block_v`` None: ``update_tiling``'s rule)
            tuning = dict(kg.UPDATE_TUNING)
            tuning["block_v"], tuning["num_warps"] = kg.update_tiling(B * N, V, dev)
            rows.append(_row("update_sweep", c, floor_us=floor, match=ok, splits=S,
                             treeops_us=t, **tuning))  # fmt: skip
    finally:
        kg.UPDATE_TUNING.clear()
        kg.UPDATE_TUNING.update(default)
    return rows


def learn_rows(c: dict, empty_us: float, block_maxes=(0, 128)) -> list[dict]:
    """What a decoder pays per step to teach the table the verified tree, two ways, on the same
    logits: ``ids`` (acceptance with the fused top-k ids, then the update from them) and
    ``logits`` (acceptance alone, then the update from the logits, under each ``block_max`` of
    ``UPDATE_TUNING``: what the example decoder does). Both must leave the same acceptance and
    table; graph replays over rotated logits."""
    from treeops.kernels import graft_update as kg

    timer = _timer(c["dev"])
    V, k, dev, tree = c["V"], c["k"], c["dev"], c["tree"]
    logits, base, want, nbytes, floor = update_inputs(c, empty_us)
    first = accept_greedy(tree, logits[0])
    rows = []

    def by_ids(table, lg):
        acc = accept_greedy(tree, lg, topk_ids=k)
        table.update(tree, topk_ids=acc.topk)
        return acc

    def by_logits(table, lg):
        acc = accept_greedy(tree, lg)
        table.update(tree, lg)
        return acc

    saved = kg.UPDATE_TUNING["block_max"]
    try:
        for way, mb in [("ids", saved)] + [("logits", m) for m in block_maxes]:
            kg.UPDATE_TUNING["block_max"] = mb
            table = AdjacencyTable(V, k, device=dev)
            table.table.copy_(base)
            fn = by_ids if way == "ids" else by_logits
            acc = fn(table, logits[0])
            ok = torch.equal(table.table, want) and torch.equal(acc.accepted, first.accepted)
            ok = ok and torch.equal(acc.bonus, first.bonus)
            t = timer([(lambda lg=lg: fn(table, lg)) for lg in logits]) if ok else None
            rows.append(_row("learn", c, way=way, block_max=mb, floor_us=floor, bytes=nbytes,
                             match=ok, treeops_us=t))  # fmt: skip
    finally:
        kg.UPDATE_TUNING["block_max"] = saved
    return rows


def row_update_ids(c: dict, empty_us: float, time_treeops=None) -> dict:
    """``AdjacencyTable.update`` from ``topk_ids`` against its exact result, then timed."""
    timer = _timer(c["dev"])
    time_treeops = time_treeops or timer
    B, N, V, k, dev = c["B"], c["N"], c["V"], c["k"], c["dev"]
    tree, table, n_verify = c["tree"], c["table"], c["n_verify"]
    base = table.table.clone()
    ids = torch.randint(-1, V, (B, N, k), device=dev, dtype=torch.int32)
    table.update(tree, topk_ids=ids)
    want_i = base.clone()
    flat = torch.arange(B * N, device=dev)
    valid = (torch.arange(N, device=dev)[None] < tree.num_nodes[:, None]).flatten()
    tok = torch.where(valid, tree.tokens.flatten(), V)
    owner = torch.full((V + 1,), INT32_MAX, dtype=torch.int64, device=dev)
    owner.scatter_reduce_(0, tok, flat, "amin")
    win = (valid & (owner[tok] == flat)).nonzero().flatten()
    want_i[tok[win]] = ids.view(B * N, k)[win]
    ok = torch.equal(table.table, want_i)
    ttab = TorchTable(V, k, dev)
    nbytes = B * n_verify * (k * 4 * 2 + 8)
    row = _row("update_ids", c, floor_us=H.floor_us(nbytes, empty_us=empty_us), bytes=nbytes,
               match=ok)  # fmt: skip
    row["treeops_us"] = (
        time_treeops([lambda: table.update(tree, topk_ids=ids)] * 16) if ok else None
    )
    if ok:
        row["treeops_eager_us"] = H.eager_us(lambda: table.update(tree, topk_ids=ids), device=dev)
    row["torch_us"] = timer([lambda: ttab.update(tree.tokens, tree.num_nodes, topk_ids=ids)] * 4)
    table.table.copy_(base)
    return row


TAIL = 8
"""Chain nodes a ``tail`` row grafts below each request's best leaf."""


def torch_tail(tree: Tree, table: torch.Tensor, count: int, budget: int) -> Tree:
    """``graft_tail`` in PyTorch ops: the best leaf by a masked argmax, the chain by ``count``
    gathers, the tree rebuilt by ``Tree.from_parents`` (the peer an engine would write)."""
    B, N = tree.parents.shape
    V = table.shape[0]
    ar = torch.arange(N, device=tree.parents.device)
    n = tree.num_nodes.long()
    leaf = (ar[None] < n[:, None]) & (tree.first_child < 0)
    key = torch.where(leaf, tree.scores, float("-inf"))
    # the highest score, the lowest index on ties: argmax of (score, -index) via a stable sort
    a = torch.sort(key, dim=1, descending=True, stable=True).indices[:, 0]
    par, tok, sc = tree.parents.clone(), tree.tokens.clone(), tree.scores.clone()
    rows = torch.arange(B, device=par.device)
    cap = min(budget, N)
    alive = (n > 0) & (n <= cap)
    above, above_tok, got = a, tok[rows, a], torch.zeros_like(n)
    for i in range(count):
        ok_tok = (above_tok >= 0) & (above_tok < V)
        nt = table[above_tok.clamp(0, V - 1), 0].long()
        alive = alive & (n + i < cap) & ok_tok & (nt >= 0) & (nt < V)
        idx = (n + i).clamp(max=N - 1)
        par[rows, idx] = torch.where(alive, above.int(), par[rows, idx])
        tok[rows, idx] = torch.where(alive, nt, tok[rows, idx])
        sc[rows, idx] = torch.where(alive, 0.0, sc[rows, idx])
        got += alive.long()
        above = torch.where(alive, idx, above)
        above_tok = torch.where(alive, nt, above_tok)
    return Tree.from_parents(par, (n + got).int(), tok, sc)


def row_tail(c: dict, empty_us: float, time_treeops=None) -> dict:
    """``graft_tail`` (a ``TAIL``-node chain below the best leaf, budget 60) against the
    reference (exact), then timed against ``torch_tail``."""
    timer = _timer(c["dev"])
    time_treeops = time_treeops or timer
    pruned, table, budget = c["pruned"], c["table"], c["budget"]
    B, N = c["B"], c["N"]
    want = ref.graft_tail(pruned.to("cpu"), c["tab_cpu"], TAIL, budget)
    ok = tree_equal(graft_tail(pruned, table, TAIL, budget), want)
    ok_torch = tree_equal(torch_tail(pruned, table.table, TAIL, budget), want)
    W = c["tree"].anc.shape[2]
    nbytes = 2 * (B * N * (8 + 4 * 6 + 4 * W) + B * 4) + B * TAIL * 4
    row = _row("tail", c, floor_us=H.floor_us(nbytes, empty_us=empty_us), bytes=nbytes,
               match=ok, torch_match=ok_torch)  # fmt: skip
    row["treeops_us"] = (
        time_treeops([lambda: graft_tail(pruned, table, TAIL, budget)] * 16) if ok else None
    )
    if ok:
        row["treeops_eager_us"] = H.eager_us(
            lambda: graft_tail(pruned, table, TAIL, budget), device=c["dev"]
        )
    row["torch_us"] = (
        timer([lambda: torch_tail(pruned, table.table, TAIL, budget)] * 4) if ok_torch else None
    )
    return row


ROWS = {"retrieve_merge": row_retrieve_merge, "tail": row_tail, "update": row_update,
        "update_ids": row_update_ids}  # fmt: skip


def main(argv=None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument(
        "--template-coverage",
        action="store_true",
        help="compare templates on real text (CPU), then exit",
    )
    ap.add_argument(
        "--sweep-update",
        action="store_true",
        help="only the update's configurations (kernels.graft_update.UPDATE_TUNING): "
        "graft_update_sweep.json",
    )
    ap.add_argument(
        "--learn",
        action="store_true",
        help="only the table's learning per step: acceptance's top-k ids then the update from "
        "them, against acceptance alone then the update from the logits: graft_learn.json",
    )
    ap.add_argument(
        "--update-configs",
        default=None,
        help="with --sweep-update: a JSON list of UPDATE_TUNING changes to time instead of the "
        "grid, e.g. '[{}, {\"block_max\": 128}]' ({} is the default configuration)",
    )
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--vocabs", default="32000,128256")
    ap.add_argument(
        "--device",
        default="cuda",
        help="'cpu': a dry run of the script's logic (references, wall-clock times)",
    )
    args = ap.parse_args(argv)
    if args.template_coverage:
        coverage_main("")
        return None
    if not args.out:
        ap.error("--out is required")
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_graft needs a CUDA device")
    gen = torch.Generator().manual_seed(0)
    empty_us = H.empty_kernel_us(dev)
    rows: list[dict] = []
    out = H.result_doc(
        dev,
        empty_kernel_graph_us=empty_us,
        notes="median per call over CUDA-graph replays; N=64, k=8, default 80-node template; "
        "retrieve_merge on trees pruned to 25 nodes; update from bf16 logits of 60 nodes",
        rows=rows,
    )
    path = os.path.join(args.out, "graft.json")
    if args.learn:
        path = os.path.join(args.out, "graft_learn.json")
        for V in [int(v) for v in args.vocabs.split(",")]:
            for B in [int(b) for b in args.batches.split(",")]:
                rows += learn_rows(setup(B, V, gen, dev), empty_us)
                H.write_json(path, out)
                for r in rows[-3:]:
                    print(f"  learn V={V} B={B} {r['way']} block_max {r['block_max']}: "
                          f"{r['treeops_us']} us (match {r['match']})", flush=True)  # fmt: skip
        return out
    if args.sweep_update:
        path = os.path.join(args.out, "graft_update_sweep.json")
        for V in [int(v) for v in args.vocabs.split(",")]:
            for B in [int(b) for b in args.batches.split(",")]:
                c = setup(B, V, gen, dev)
                cfgs = (
                    [
                        dict(block_v=512, programs_per_sm=32, num_warps=1, group=g, merge=m)
                        for g, m in ((0, "passes"), (32, "bitonic"))
                    ]  # fmt: skip
                    + [dict(block_max=64)]
                    if dev.type != "cuda"
                    else None
                )
                if args.update_configs:
                    cfgs = json.loads(args.update_configs)
                rows += sweep_update_rows(c, empty_us, cfgs)
                H.write_json(path, out)
                best = min((r for r in rows if r["B"] == B and r["V"] == V and r["treeops_us"]),
                           key=lambda r: r["treeops_us"], default=None)  # fmt: skip
                print(f"  update sweep V={V} B={B}: best {best}", flush=True)
        return out
    for V in [int(v) for v in args.vocabs.split(",")]:
        for B in [int(b) for b in args.batches.split(",")]:
            t0 = time.time()
            c = setup(B, V, gen, dev)
            for fn in ROWS.values():
                rows.append(fn(c, empty_us))
            H.write_json(path, out)
            print(f"  V={V} B={B} done in {time.time() - t0:.1f} s", file=sys.stderr)

    def fmt(v):
        return "mismatch" if v is None else f"{v:8.1f}"

    print(f"\n{out['gpu']}  empty kernel in a graph: {empty_us:.2f} us  -> {path}")
    print(
        f"{'op':15s} {'B':>3s} {'V':>7s} {'treeops':>9s} {'torch':>9s} {'floor':>8s} "
        f"{'x floor':>8s} {'x torch':>8s}"
    )
    for r in rows:
        t, p, fl = r["treeops_us"], r["torch_us"], r["floor_us"]
        xf = f"{t / fl:8.2f}" if t else "       -"
        xt = f"{t / p:8.2f}" if t and p else "       -"
        print(
            f"{r['op']:15s} {r['B']:3d} {r['V']:7d} {fmt(t):>9s} {fmt(p):>9s} {fl:8.1f} {xf} {xt}"
        )
    return out


# ------------------------------------------------------------------------------ pytest


@pytest.mark.parametrize("op", list(ROWS))
def test_graft(benchmark, op):
    """B = 8, V = 128256, N = 64, budget 60, k = 8, the default 80-node template; retrieve_merge
    on a tree pruned to 25 nodes, update from bf16 logits of 60 nodes. Peer: the torch
    pipeline (``torch_graft``, ``TorchTable``)."""
    dev = torch.device("cuda")
    c = setup(8, 128256, torch.Generator().manual_seed(0), dev)
    row = ROWS[op](c, H.empty_kernel_us(dev), lambda calls: H.benchmark_graph(benchmark, calls))
    assert row["match"], f"{op}: treeops differs from the reference"
    H.ratios([row])
    H.record(benchmark, row)


if __name__ == "__main__":
    main()
