"""GPU tests of the Graft kernels (compiled, realistic sizes), against the references on CPU.

Skipped unless ``TREEOPS_GPU_TESTS=1`` on a CUDA machine. Fixed shapes (no hypothesis), so the
file also runs under ``compute-sanitizer --tool memcheck``:

    TREEOPS_GPU_TESTS=1 python -m pytest tests/test_graft_gpu.py -q
    TREEOPS_GPU_TESTS=1 compute-sanitizer --tool memcheck \
        python -m pytest tests/test_graft_gpu.py -q -k "not large_vocab"

``TREEOPS_GPU_TEST_DEVICE=cpu`` runs the same logic through the interpreter (a dry run).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

import treeops
from strategies import make_tree, parents_of
from treeops import NO_PRUNE, AdjacencyTable, RankTemplate, graft, graft_merge, prune
from treeops.kernels import graft_update as kern_update
from treeops.reference import graft as ref

pytestmark = pytest.mark.gpu
DEV = os.environ.get("TREEOPS_GPU_TEST_DEVICE", "cuda")
LARGE_V = int(os.environ.get("TREEOPS_GRAFT_LARGE_V", "128256"))
FIELDS = ("tokens", "parents", "num_nodes", "depth", "anc", "first_child", "next_sibling", "scores")


def same_tree(got: treeops.Tree, want: treeops.Tree) -> None:
    for f in FIELDS:
        assert torch.equal(getattr(got, f).cpu(), getattr(want, f).cpu()), f


def batch(B: int, N: int, V: int, seed: int, keep: int | None = 24):
    """A ragged batch of draft trees (every kind), pruned, and a table that points at the trees'
    own children in places (so the merge reuses draft nodes)."""
    rng = random.Random(seed)
    kinds = ["random", "chain", "binary", "star", "random", "single", "inactive"]
    rows = [
        parents_of(kinds[b % len(kinds)], N if b % 3 else rng.randint(1, N), rng) for b in range(B)
    ]
    if not any(rows):
        rows[0] = [-1]
    tree = make_tree(rows, N, V, rng)
    if keep is not None:
        tree = prune(
            tree,
            torch.tensor([rng.choice([2, 8, keep, NO_PRUNE]) for _ in range(B)], dtype=torch.int32),
        )
    k = 8
    g = torch.Generator().manual_seed(seed)
    tab = torch.randint(0, V, (V, k), generator=g, dtype=torch.int32)
    tab[torch.rand(V, k, generator=g) < 0.15] = -1
    for b in range(B):
        for i in range(1, int(tree.num_nodes[b]), 2):
            tab[int(tree.tokens[b, int(tree.parents[b, i])]), i % k] = int(tree.tokens[b, i])
    return tree, tab, rng


TEMPLATES = {
    "default": RankTemplate.default(),
    "balanced": RankTemplate.balanced(4, 3),
    "chain": RankTemplate.chain(9),
    "wide": RankTemplate.from_rank_probs([0.4, 0.3, 0.2, 0.1, 0.05, 0.04, 0.03, 0.02], 200, 6),
}


@pytest.mark.parametrize(
    "B,N,V",
    [(1, 64, 32000), (8, 64, 200), (64, 64, 32000), (5, 33, 50), (3, 128, 1000), (2, 1, 10)],
)
@pytest.mark.parametrize("tpl", list(TEMPLATES))
def test_graft_matches_reference(B, N, V, tpl):
    tree, tab, rng = batch(B, N, V, seed=B * 1000 + N)
    template = TEMPLATES[tpl]
    table = AdjacencyTable(V, 8, device=DEV)
    table.table.copy_(tab)
    for budget in (
        60,
        torch.tensor([rng.randrange(0, N + 2) for _ in range(B)], dtype=torch.int32),
    ):
        for count in (None, 7):
            want = ref.graft(tree, tab, template, budget, count)
            b_dev = budget.to(DEV) if isinstance(budget, torch.Tensor) else budget
            got = graft(tree.to(DEV), table, template, b_dev, count)
            same_tree(got, want)
            want.validate()
        r_want = ref.adjacency_retrieve(tab, tree.tokens[:, 0], template)
        r = table.retrieve(tree.to(DEV).tokens[:, 0], template)  # a strided [B] view
        for f in ("tokens", "parents", "depth", "num_nodes"):
            assert torch.equal(getattr(r, f).cpu(), getattr(r_want, f)), f
        same_tree(graft_merge(tree.to(DEV), r, b_dev), ref.graft_merge(tree, r_want, budget))


@pytest.mark.parametrize("B,N,V", [(1, 64, 32000), (8, 64, 200), (64, 64, 32000), (3, 128, 1000),
                                   (2, 1, 10), (5, 33, 50)])  # fmt: skip
def test_graft_tail_matches_reference(B, N, V):
    """The chain below each request's best leaf, int and tensor count and budget (some budgets
    under a request's node count, some chains cut by empty entries), as the reference."""
    tree, tab, rng = batch(B, N, V, seed=B * 7 + N)
    table = AdjacencyTable(V, 8, device=DEV)
    table.table.copy_(tab)
    budgets = (60, torch.tensor([rng.randrange(0, N + 2) for _ in range(B)], dtype=torch.int32))
    counts = (4, torch.tensor([rng.randrange(0, 9) for _ in range(B)], dtype=torch.int32))
    for budget in budgets:
        for count in counts:
            want = ref.graft_tail(tree, tab, count, budget)
            b_dev = budget.to(DEV) if isinstance(budget, torch.Tensor) else budget
            c_dev = count.to(DEV) if isinstance(count, torch.Tensor) else count
            got = treeops.graft_tail(tree.to(DEV), table, c_dev, b_dev, max_count=8)
            same_tree(got, want)
            want.validate()


def test_graft_is_graph_capturable():
    if DEV != "cuda":
        pytest.skip("CUDA graphs need CUDA")
    B, N, V = 8, 64, 500
    tree, tab, _ = batch(B, N, V, seed=5)
    table = AdjacencyTable(V, 8, device=DEV)
    table.table.copy_(tab)
    tpl = RankTemplate.default()
    src = tree.to(DEV)
    budget = torch.full((B,), 60, dtype=torch.int32, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        graft(src, table, tpl, budget)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = graft(src, table, tpl, budget)
    for seed in (6, 7):  # new inputs copied into the captured tensors, then replay
        t2, tab2, _ = batch(B, N, V, seed=seed)
        for f in FIELDS:
            getattr(src, f).copy_(getattr(t2, f))
        table.table.copy_(tab2)
        g.replay()
        torch.cuda.synchronize()
        same_tree(out, ref.graft(t2, tab2, tpl, 60))


@pytest.mark.parametrize(
    "B,N,V,dtype",
    [
        (1, 64, 32000, torch.bfloat16),
        (8, 64, 32000, torch.float32),
        (64, 64, 2000, torch.bfloat16),
        (3, 16, 300, torch.float32),
    ],
)
@pytest.mark.parametrize(
    "group,merge,block_max,rank32,rank_all",
    [(0, "passes", 0, False, None), (0, "bitonic", 0, False, None), (16, "passes", 0, False, None),
     (64, "bitonic", 0, False, None), (0, "bitonic", 64, False, None),
     (0, "bitonic", 128, False, None), (0, "bitonic", 512, False, None),
     (0, "bitonic", 64, True, None), (0, "bitonic", 128, True, None),
     (0, "bitonic", 128, True, True), (0, "bitonic", 64, False, True),
     (0, "bitonic", 128, True, False)],
)  # fmt: skip
def test_update_matches_reference(
    B, N, V, dtype, group, merge, block_max, rank32, rank_all, monkeypatch
):
    """Every top-k method of the update's stage 1 (group 0: the running list; else group
    maxima of that many logits; block_max > 0: block maxima, whose stage 2 rereads each node's
    k best blocks, ranking int32 keys with ``rank32`` where the logits are bf16, by the winner
    of a token alone or, ``rank_all``, by each of its nodes; None: the launcher's rule) and both
    merges of the lists' write stage, with many ties, duplicate tokens, top-k ids, warm start."""
    monkeypatch.setitem(kern_update.UPDATE_TUNING, "rank_all", rank_all)
    monkeypatch.setitem(kern_update.UPDATE_TUNING, "rank32", rank32)
    monkeypatch.setitem(kern_update.UPDATE_TUNING, "group", group)
    monkeypatch.setitem(kern_update.UPDATE_TUNING, "merge", merge)
    monkeypatch.setitem(kern_update.UPDATE_TUNING, "block_max", block_max)
    tree, tab, rng = batch(B, N, V, seed=B + N, keep=None)
    tree.tokens.copy_(tree.tokens % max(1, V // 7))  # duplicates across nodes and requests
    g = torch.Generator().manual_seed(B)
    logits = torch.randint(0, 5, (B, N, V), generator=g).to(dtype)  # many ties
    want = tab.clone()
    ref.adjacency_update(want, tree, logits)
    table = AdjacencyTable(V, 8, device=DEV)
    table.table.copy_(tab)
    dtree = tree.to(DEV)
    table.update(dtree, logits.to(DEV))
    assert torch.equal(table.table.cpu(), want)
    if table._owner is not None:
        assert (table._owner == kern_update.INT32_MAX).all()
    ids = torch.randint(-1, V, (B, N, 6), generator=g, dtype=torch.int32)
    want = tab.clone()
    ref.adjacency_update(want, tree, None, ids)
    table.table.copy_(tab)
    table.update(dtree, topk_ids=ids.to(DEV))
    assert torch.equal(table.table.cpu(), want)
    lengths = torch.tensor([rng.randint(0, N) for _ in range(B)], dtype=torch.int32)
    want = tab.clone()
    ref.adjacency_warm_start(want, tree.tokens, logits, lengths)
    table.table.copy_(tab)
    table.warm_start(dtree.tokens, logits.to(DEV), lengths.to(DEV))
    assert torch.equal(table.table.cpu(), want)


@pytest.mark.parametrize(
    "group,block_max,rank32", [(0, 0, False), (32, 0, False), (0, 128, False), (0, 128, True)]
)
def test_update_large_vocab_deterministic(group, block_max, rank32, monkeypatch):
    """V = 128256, bf16, 64 x 60 nodes: exact against a stable sort; the same table on reruns
    (each top-k method; the block maxima ranked on int64 and on int32 keys)."""
    monkeypatch.setitem(kern_update.UPDATE_TUNING, "rank32", rank32)
    monkeypatch.setitem(kern_update.UPDATE_TUNING, "group", group)
    monkeypatch.setitem(kern_update.UPDATE_TUNING, "block_max", block_max)
    B, N, V, k = 64 if DEV == "cuda" else 2, 64, LARGE_V, 8
    tree, _, _ = batch(B, N, min(V, 5000), seed=11, keep=None)
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(B, N, V, generator=g) * 3).to(torch.bfloat16).to(DEV)
    dtree = tree.to(DEV)
    tables = []
    for _ in range(3):
        table = AdjacencyTable(V, k, device=DEV)
        table.update(dtree, logits)
        tables.append(table.table.cpu())
    assert all(torch.equal(t, tables[0]) for t in tables)
    flat = tree.tokens.flatten()
    valid = (torch.arange(N)[None] < tree.num_nodes[:, None]).flatten()
    seen: set[int] = set()
    rows = []
    for f in range(B * N):
        t = int(flat[f])
        if valid[f] and t not in seen:
            seen.add(t)
            rows.append((t, f))
    toks = torch.tensor([t for t, _ in rows])
    idx = torch.tensor([f for _, f in rows], device=DEV)
    x = logits.view(B * N, V)[idx].float()
    want = torch.sort(-x, dim=1, stable=True).indices[:, :k].to(torch.int32).cpu()
    assert torch.equal(tables[0][toks], want)
    untouched = torch.ones(V, dtype=torch.bool)
    untouched[toks] = False
    assert (tables[0][untouched] == -1).all()


@pytest.mark.parametrize("kind", ["specials", "masked"])
@pytest.mark.parametrize("block_max,rank32", [(0, False), (128, False), (128, True)])
def test_update_special_values(kind, block_max, rank32, monkeypatch):
    """±0, ±inf and NaN at a real vocabulary ("masked": -inf and NaN rows with 2 % values, so
    that fewer than k blocks may hold a value above -inf and the block-maxima method ranks the
    whole row): the reference's table, either method, either key width."""
    monkeypatch.setitem(kern_update.UPDATE_TUNING, "block_max", block_max)
    monkeypatch.setitem(kern_update.UPDATE_TUNING, "rank32", rank32)
    B, N, V = 4, 64, 32000
    tree, _, _ = batch(B, N, 5000, seed=5, keep=None)  # tokens below 5,000
    g = torch.Generator().manual_seed(7)
    pick = torch.randint(0, 9, (B, N, V), generator=g)
    specials = torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, *[float(x) for x in
                             ("inf", "-inf", "nan")]])[pick]  # fmt: skip
    if kind == "masked":
        few = torch.rand(B, N, V, generator=g) < 0.02
        rest = torch.where(pick % 2 == 0, float("-inf"), float("nan"))
        logits = torch.where(few, torch.randn(B, N, V, generator=g), rest)
    else:
        logits = specials
    logits = logits.to(torch.bfloat16)
    want = torch.full((V, 8), -1, dtype=torch.int32)
    ref.adjacency_update(want, tree, logits)
    table = AdjacencyTable(V, 8, device=DEV)
    table.update(tree.to(DEV), logits.to(DEV))
    assert torch.equal(table.table.cpu(), want)


@pytest.mark.parametrize("block_max", [0, 128])
def test_update_is_graph_capturable(block_max, monkeypatch):
    if DEV != "cuda":
        pytest.skip("CUDA graphs need CUDA")
    monkeypatch.setitem(kern_update.UPDATE_TUNING, "block_max", block_max)
    B, N, V = 8, 64, 32000
    tree, tab, _ = batch(B, N, 5000, seed=2, keep=None)
    dtree = tree.to(DEV)
    logits = torch.randn(B, N, V, device=DEV).to(torch.bfloat16)
    table = AdjacencyTable(V, 8, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        table.update(dtree, logits)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        table.update(dtree, logits)
    for seed in (1, 2):
        new = torch.randn(B, N, V, generator=torch.Generator().manual_seed(seed))
        logits.copy_(new.to(torch.bfloat16).to(DEV))
        table.table.fill_(-1)
        g.replay()
        torch.cuda.synchronize()
        want = torch.full((V, 8), -1, dtype=torch.int32)
        ref.adjacency_update(want, tree, logits.cpu())
        assert torch.equal(table.table.cpu(), want)
        assert (table._owner == kern_update.INT32_MAX).all()


def test_prune_and_checkpoints_on_device():
    tree, _, _ = batch(6, 64, 300, seed=9, keep=None)
    ck = treeops.PruneCheckpoints(thresholds=(0.5, 0.25, 0.125))
    keep = ck.start(6, DEV)
    keep_cpu = ck.start(6)
    g = torch.Generator().manual_seed(0)
    for step in range(7):
        best = torch.rand(6, generator=g)
        stop = ck.check(step, best.to(DEV), keep)
        stop_cpu = ck.check(step, best, keep_cpu)
        assert torch.equal(keep.cpu(), keep_cpu) and torch.equal(stop.cpu(), stop_cpu)
    same_tree(prune(tree.to(DEV), keep), prune(tree, keep_cpu))


@pytest.mark.parametrize("N", [8, 64, 200])
def test_prune_matches_reference(N):
    """One launch per call (int and tensor keep); the reference on CPU; ``anc`` of 1-7 words."""
    tree, _, rng = batch(9, N, 300, seed=N, keep=None)
    keep = torch.tensor([rng.choice([0, 1, 7, 40, N, NO_PRUNE]) for _ in range(9)],
                        dtype=torch.int32)  # fmt: skip
    dev_tree = tree.to(DEV)
    same_tree(prune(dev_tree, keep.to(DEV)), ref.prune(tree, keep))
    for k in (0, 5, N - 1, NO_PRUNE):
        same_tree(prune(dev_tree, k), ref.prune(tree, k))


def test_prune_and_checkpoints_are_graph_capturable():
    if DEV != "cuda":
        pytest.skip("CUDA graphs need CUDA")
    B, N = 8, 64
    tree, _, _ = batch(B, N, 300, seed=11, keep=None)
    src = tree.to(DEV)
    ck = treeops.PruneCheckpoints(thresholds=(0.5, 0.25, 0.125))
    keep, best = ck.start(B, DEV), torch.zeros(B, device=DEV)

    def step():
        stops = [ck.check(s, best, keep) for s in range(3)]
        return stops, prune(src, keep)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up: compiles
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        stops, out = step()
    gen = torch.Generator().manual_seed(3)
    for seed in (12, 13):
        t2, _, _ = batch(B, N, 300, seed=seed, keep=None)
        for f in FIELDS:
            getattr(src, f).copy_(getattr(t2, f))
        b2 = torch.rand(B, generator=gen)
        best.copy_(b2)
        keep.fill_(NO_PRUNE)
        g.replay()
        torch.cuda.synchronize()
        k_ref = ck.start(B)
        want = [ck.check(s, b2, k_ref) for s in range(3)]
        assert torch.equal(keep.cpu(), k_ref)
        for got, w in zip(stops, want):
            assert torch.equal(got.cpu(), w)
        same_tree(out, ref.prune(t2, k_ref))
