"""Graft: templates, the adjacency table, retrieval, pruning, checkpoints and graft_merge.

References are checked against independent computations (brute-force trie semantics, a sorted
top-k, rank-path enumeration); the Triton kernels (run by the interpreter) against the
references with exact integer equality.
"""

from __future__ import annotations

import random
from unittest.mock import patch

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import treeops
from helpers import tree_from_lists
from strategies import logits_like, make_tree, parents_of, trees
from treeops import (
    NO_PRUNE,
    AdjacencyTable,
    PruneCheckpoints,
    RankTemplate,
    Retrieved,
    calibrate_thresholds,
    graft,
    graft_merge,
    prune,
)
from treeops.reference import graft as ref

# ----------------------------------------------------------------------------- helpers


@st.composite
def templates(draw, max_rank: int = 3, max_size: int = 24) -> RankTemplate:
    """Random rank-path templates (plus the named ones), ranks < max_rank + 1."""
    kind = draw(st.sampled_from(["random", "random", "chain", "balanced", "default_small"]))
    if kind == "chain":
        return RankTemplate.chain(draw(st.integers(0, 6)))
    if kind == "balanced":
        return RankTemplate.balanced(
            draw(st.integers(1, min(3, max_rank + 1))), draw(st.integers(1, 3))
        )
    if kind == "default_small":
        probs = [0.6, 0.2, 0.1, 0.05][: max_rank + 1]
        return RankTemplate.from_rank_probs(
            probs, size=draw(st.integers(1, max_size)), max_depth=draw(st.integers(1, 6))
        )
    rng = random.Random(draw(st.integers(0, 2**31 - 1)))
    paths = {()}
    for _ in range(draw(st.integers(0, max_size - 1))):
        base = rng.choice(sorted(paths))
        if len(base) < 6:
            paths.add(base + (rng.randrange(max_rank + 1),))
    return RankTemplate.from_paths(sorted(paths))


def random_table(
    V: int, k: int, rng: random.Random, empty: float = 0.2, tree: treeops.Tree | None = None
) -> torch.Tensor:
    """A [V, k] table with empty entries; with ``tree``, some rows also point at the tree's own
    children so that retrieved nodes coincide with draft nodes (the trie merge reuses them)."""
    tab = torch.tensor(
        [[rng.randrange(V) if rng.random() > empty else -1 for _ in range(k)] for _ in range(V)],
        dtype=torch.int32,
    )
    if tree is not None:
        for b in range(tree.batch_size):
            for i in range(1, int(tree.num_nodes[b])):
                if rng.random() < 0.5:
                    p = int(tree.parents[b, i])
                    tab[int(tree.tokens[b, p]), rng.randrange(k)] = int(tree.tokens[b, i])
    return tab


def table_of(tab: torch.Tensor) -> AdjacencyTable:
    t = AdjacencyTable(tab.shape[0], tab.shape[1])
    t.table.copy_(tab)
    return t


def token_paths(tokens: list[int], parents: list[int], n: int) -> list[tuple[int, ...]]:
    """Root-to-node token sequences (root token excluded) of nodes 0..n-1."""
    out: list[tuple[int, ...]] = []
    for i in range(n):
        path = []
        j = i
        while j > 0:
            path.append(tokens[j])
            j = parents[j]
        out.append(tuple(reversed(path)))
    return out


def brute_retrieve(tab: torch.Tensor, root: int, template: RankTemplate, limit: int):
    """Enumerate template nodes recursively (depth-first), then keep them in template order."""
    V = tab.shape[0]
    par, rk = template.parents.tolist(), template.ranks.tolist()
    kids: dict[int, list[int]] = {}
    for j in range(1, template.size):
        kids.setdefault(par[j], []).append(j)
    found: dict[int, int] = {0: root}

    def walk(j: int) -> None:
        t = found[j]
        for c in kids.get(j, []):
            if 0 <= t < V:
                s = int(tab[t, rk[c]])
                if 0 <= s < V:
                    found[c] = s
                    walk(c)

    walk(0)
    order = sorted(found)
    kept = [0] + order[1 : 1 + limit]
    return [found[j] for j in kept], kept


def sorted_topk(row: torch.Tensor, k: int) -> list[int]:
    vals = row.double().tolist()
    ids = sorted(range(len(vals)), key=lambda i: (-vals[i], i))[:k]
    return ids + [-1] * (k - len(ids))


# ----------------------------------------------------------------------------- templates


def test_default_template_shape():
    t = RankTemplate.default()
    assert t.size == 80 and t.max_depth == 9
    par, rk, dep = t.parents.tolist(), t.ranks.tolist(), t.depth.tolist()
    assert dep == sorted(dep)  # breadth-first
    assert all(0 <= par[j] < j for j in range(1, 80))
    # rank-0 chains deeper, higher ranks narrower: the deepest node holding rank r, and the
    # number of nodes of rank r, never increase with r
    deepest = [max((dep[j] for j in range(1, 80) if rk[j] == r), default=0) for r in range(8)]
    count = [sum(1 for j in range(1, 80) if rk[j] == r) for r in range(8)]
    assert deepest == sorted(deepest, reverse=True) and deepest[0] == 9
    assert count == sorted(count, reverse=True)
    # the pure rank-0 chain reaches the bottom
    j = max(range(80), key=lambda j: (dep[j], -j))
    while j > 0:
        assert rk[j] == 0
        j = par[j]


def test_from_rank_probs_takes_most_probable_paths():
    probs = [0.5, 0.3, 0.1]
    t = RankTemplate.from_rank_probs(probs, size=12, max_depth=4)
    paths = []
    for j in range(t.size):
        p, i = [], j
        while i > 0:
            p.append(int(t.ranks[i]))
            i = int(t.parents[i])
        paths.append(tuple(reversed(p)))

    def prob(p):
        out = 1.0
        for r in p:
            out *= probs[r]
        return out

    every = [()]
    frontier = [()]
    for _ in range(4):
        frontier = [p + (r,) for p in frontier for r in range(3)]
        every += frontier
    cutoff = sorted((prob(p) for p in every), reverse=True)[11]
    assert all(prob(p) >= cutoff for p in paths)
    assert len(set(paths)) == 12


def _paths(t: RankTemplate) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for j in range(1, t.size):
        out.append(out[int(t.parents[j])] + (int(t.ranks[j]),))
    return out


@settings(max_examples=60, deadline=None)
@given(template=templates(max_rank=9, max_size=40), n=st.integers(1, 45))
def test_most_probable_is_the_likeliest_subtree(template, n):
    """``most_probable(n)``: min(n, size) of the template's own paths, the root among them,
    every prefix present (a subtree the merge can fill), and none left out more probable than
    one kept (ranks past the probability list priced at its last value)."""
    probs = (0.6, 0.12, 0.06, 0.035, 0.02, 0.015, 0.01, 0.008)

    def prob(p):
        out = 1.0
        for r in p:
            out *= probs[min(r, len(probs) - 1)]
        return out

    got = template.most_probable(n, probs)
    kept, every = set(_paths(got)), set(_paths(template))
    assert got.size == min(n, template.size) and () in kept and kept <= every
    assert all(p[:-1] in kept for p in kept if p)
    if kept != every:
        assert min(prob(p) for p in kept) >= max(prob(p) for p in every - kept)


def test_most_probable_of_the_default_fills_the_rank0_chain_first():
    t = RankTemplate.default()
    assert _paths(t.most_probable(5)) == [(), (0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]
    assert (1,) in _paths(t.most_probable(6))  # 0.12 after 0.6**4 = 0.13
    assert RankTemplate([-1], [-1]).most_probable(9).size == 1  # a root-only template stays
    with pytest.raises(ValueError, match="n"):
        t.most_probable(0)
    for bad in ((), (0.5, 1.0), (0.0,)):  # both constructors from probabilities check them
        with pytest.raises(ValueError, match=r"probs: expected numbers in \(0, 1\)"):
            t.most_probable(3, bad)
        with pytest.raises(ValueError, match=r"probs: expected numbers in \(0, 1\)"):
            RankTemplate.from_rank_probs(bad, size=4)


@pytest.mark.parametrize(
    "parents,ranks,msg",
    [
        ([0, 0], [-1, 0], "parents[0] = 0, expected -1"),
        ([-1, 1], [-1, 0], "parents[1] = 1, expected 0 <= p < 1"),
        ([-1, 0, 0], [-1, 1, 1], "node 2 repeats rank 1 among the children of 0"),
        ([-1, 0, 1, 0], [-1, 0, 0, 1], "node 3 at depth 1 after a node at depth 2"),
        ([-1, 0], [-1, -2], "ranks[1] = -2, expected >= 0"),
        ([], [], "expected 1 to 256 nodes, got 0"),
    ],
)
def test_template_rejects(parents, ranks, msg):
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        RankTemplate(parents, ranks)


def test_template_from_paths_needs_prefixes():
    with pytest.raises(ValueError, match=r"path \(0, 1\) given without its prefix \(0,\)"):
        RankTemplate.from_paths([(0, 1)])


# ----------------------------------------------------------------------------- update


def chain_tree(seq: list[int], capacity: int) -> treeops.Tree:
    return tree_from_lists([[-1] + list(range(len(seq) - 1))], [seq], capacity=capacity)


def test_table_learns_a_sequence_and_retrieves_its_continuation():
    V, k = 50, 8
    seq = [7, 3, 19, 42, 5, 11, 30, 2, 8]
    rng = random.Random(1)
    table = AdjacencyTable(V, k)
    # verify the sequence as a chain: the target's logits at node i peak at seq[i + 1]
    tree = chain_tree(seq[:-1], capacity=10)
    logits = logits_like((1, 10, V), rng)
    for i in range(len(seq) - 1):
        logits[0, i, seq[i + 1]] = 100.0
    table.update(tree, logits)
    r = table.retrieve(torch.tensor([seq[0]]), RankTemplate.chain(8))
    assert r.tokens[0, : int(r.num_nodes[0])].tolist() == seq
    # through the default template the rank-0 chain is the continuation too
    r = table.retrieve(torch.tensor([seq[0]]), RankTemplate.default())
    n = int(r.num_nodes[0])
    paths = token_paths(r.tokens[0].tolist(), r.parents[0].tolist(), n)
    assert tuple(seq[1:]) in paths
    # and grafting it onto a root-only tree yields the sequence as the tree's deepest path
    root = tree_from_lists([[-1]], [[seq[0]]], capacity=64)
    hybrid = graft(root, table, RankTemplate.default(), budget=60)
    hybrid.validate()
    hp = token_paths(
        hybrid.tokens[0].tolist(), hybrid.parents[0].tolist(), int(hybrid.num_nodes[0])
    )
    assert tuple(seq[1:]) in hp


@given(st.integers(0, 2**31 - 1), st.booleans(), st.sampled_from([1, 3, 8]))
def test_update_matches_sorted_topk_and_lowest_index_wins(seed, ties, k):
    rng = random.Random(seed)
    B, N, V = rng.randint(1, 3), rng.choice([1, 4, 8]), rng.choice([8, 16, 40])
    # few distinct tokens, so that many nodes share one
    rows = [
        parents_of(rng.choice(["random", "chain", "star", "inactive"]), rng.randint(0, N), rng)
        for _ in range(B)
    ]
    tree = make_tree(rows, N, V, rng)
    tree.tokens.copy_(torch.where(tree.tokens >= 0, tree.tokens % 4, tree.tokens))
    logits = logits_like((B, N, V), rng, ties=ties)
    table = AdjacencyTable(V, k)
    before = table.table.clone()
    table.update(tree, logits)
    want = before.clone()
    owner: dict[int, tuple[int, int]] = {}
    for b in range(B):
        for i in range(int(tree.num_nodes[b])):
            owner.setdefault(int(tree.tokens[b, i]), (b, i))
    for tok, (b, i) in owner.items():
        want[tok] = torch.tensor(sorted_topk(logits[b, i], k), dtype=torch.int32)
    assert torch.equal(table.table, want)
    # deterministic: the same update on a fresh table gives the same table
    again = AdjacencyTable(V, k)
    again.update(tree, logits)
    assert torch.equal(again.table, table.table)


def test_update_from_topk_ids_pads_and_truncates():
    tree = tree_from_lists([[-1, 0, 0], [-1, 0]], [[1, 2, 1], [2, 3]], capacity=3)
    ids = torch.tensor([[[5, 6], [7, 8], [9, 9]], [[1, 1], [4, -1], [0, 0]]], dtype=torch.int32)
    table = AdjacencyTable(10, 3)
    table.update(tree, topk_ids=ids)
    want = torch.full((10, 3), -1, dtype=torch.int32)
    want[1] = torch.tensor([5, 6, -1])  # node (0, 0); node (0, 2) carries 1 too but comes later
    want[2] = torch.tensor([7, 8, -1])  # node (0, 1) beats node (1, 0)
    want[3] = torch.tensor([4, -1, -1])
    assert torch.equal(table.table, want)
    table2 = AdjacencyTable(10, 1)
    table2.update(tree, topk_ids=ids)
    assert table2.table[:, 0].tolist() == [-1, 5, 7, 4, -1, -1, -1, -1, -1, -1]


def test_warm_start_last_occurrence_wins():
    V = 12
    prompt = torch.tensor([[1, 2, 1, 3], [2, 5, 0, 0]])
    lengths = torch.tensor([4, 2], dtype=torch.int32)
    ids = torch.arange(2 * 4 * 2, dtype=torch.int32).reshape(2, 4, 2) % V
    table = AdjacencyTable(V, 2)
    table.warm_start(prompt, lengths=lengths, topk_ids=ids)
    assert table.table[1].tolist() == ids[0, 2].tolist()
    assert table.table[2].tolist() == ids[1, 0].tolist()  # b*L + t = 4 beats 1
    assert table.table[5].tolist() == ids[1, 1].tolist()
    assert table.table[0].tolist() == [-1, -1]  # (1, 2) and (1, 3) are past the length
    logits = logits_like((2, 4, V), random.Random(3))
    t2 = AdjacencyTable(V, 3)
    t2.warm_start(prompt, logits, lengths)
    assert t2.table[1].tolist() == sorted_topk(logits[0, 2], 3)


# ----------------------------------------------------------------------------- retrieve


@given(st.integers(0, 2**31 - 1), templates(), st.sampled_from([None, 0, 3, "tensor"]))
def test_retrieve_matches_recursive_enumeration(seed, template, count):
    rng = random.Random(seed)
    V, k, B = rng.choice([3, 8, 20]), 4, rng.randint(1, 3)
    tab = random_table(V, k, rng, empty=rng.choice([0.0, 0.3, 0.7]))
    roots = torch.tensor([rng.randrange(-1, V + 1) for _ in range(B)], dtype=torch.int64)
    cnt = (
        torch.tensor([rng.randrange(0, 10) for _ in range(B)], dtype=torch.int32)
        if count == "tensor"
        else count
    )
    r = table_of(tab).retrieve(roots, template, cnt)
    r.validate()
    assert r.tokens.shape == (B, template.size) and r.max_depth == template.max_depth
    for b in range(B):
        limit = template.size if cnt is None else int(cnt[b]) if count == "tensor" else cnt
        toks, kept = brute_retrieve(tab, int(roots[b]), template, limit)
        n = int(r.num_nodes[b])
        assert r.tokens[b, :n].tolist() == toks
        assert r.depth[b, :n].tolist() == [int(template.depth[j]) for j in kept]
        want_par = [-1] + [kept.index(int(template.parents[j])) for j in kept[1:]]
        assert r.parents[b, :n].tolist() == want_par
        assert (r.tokens[b, n:] == 0).all() and (r.parents[b, n:] == -1).all()
        assert (r.depth[b, n:] == 0).all()


# ----------------------------------------------------------------------------- prune


@given(trees(max_batch=3, capacities=(1, 8, 16, 64)), st.integers(0, 2**31 - 1))
def test_prune_keeps_top_scores_ancestor_closed(case, seed):
    rng = random.Random(seed)
    tree = case.tree
    B, N = tree.parents.shape
    keep = torch.tensor(
        [rng.choice([0, 1, 3, 8, 40, NO_PRUNE]) for _ in range(B)], dtype=torch.int32
    )
    out = prune(tree, keep)
    out.validate()
    assert torch.equal(out.num_nodes, ref.prune(tree, keep).num_nodes)
    # the kernel against the reference: tests/test_prune.py
    for b in range(B):
        n0, n = int(tree.num_nodes[b]), int(out.num_nodes[b])
        assert n == (0 if n0 == 0 else min(n0, int(keep[b]) + 1))
        if n0 == 0:
            continue
        # the kept draft nodes are the top keep by (score desc, index asc) and ancestor-closed
        sc = tree.scores[b, 1:n0].tolist()
        top = sorted(range(1, n0), key=lambda i: (-sc[i - 1], i))[: n - 1]
        assert sorted(top) == list(range(1, n))
        par = tree.parents[b].tolist()
        assert all(par[i] in range(n) for i in range(1, n))
        assert torch.equal(out.tokens[b, :n], tree.tokens[b, :n])
        assert torch.equal(out.anc[b, :n], tree.anc[b, :n])


# ----------------------------------------------------------------------------- checkpoints


def test_checkpoints_first_firing_decides_and_stop():
    ck = PruneCheckpoints(steps=(0, 1, 5), keeps=(8, 24, 40), thresholds=(0.3, 0.2, 0.05))
    keep = ck.start(4)
    assert keep.tolist() == [NO_PRUNE] * 4
    stop = ck.check(0, torch.tensor([0.1, 0.5, 0.5, 0.5]), keep)
    assert stop.tolist() == [True, False, False, False] and keep[0] == 8
    stop = ck.check(1, torch.tensor([0.01, 0.1, 0.5, 0.5]), keep)
    assert keep.tolist()[:2] == [8, 24] and stop.tolist() == [True, True, False, False]
    stop = ck.check(3, torch.tensor([0.0, 0.0, 0.0, 0.0]), keep)  # not a checkpoint
    assert stop.tolist() == [True, True, False, False]
    stop = ck.check(5, torch.tensor([0.0, 0.0, 0.04, 0.05]), keep)
    assert keep.tolist() == [8, 24, 40, NO_PRUNE] and stop.tolist() == [True, True, True, False]


@given(st.integers(0, 2**31 - 1))
def test_checkpoints_device_rule_matches_reference(seed):
    rng = random.Random(seed)
    B = rng.randint(1, 6)
    ck = PruneCheckpoints(thresholds=(0.5, 0.25, 0.125))
    k1, k2 = ck.start(B), ck.start(B)
    for step in range(7):
        best = torch.tensor([rng.choice([0.0, 0.125, 0.25, 0.5, 1.0]) for _ in range(B)])
        s1 = ck.check(step, best, k1)
        if step in ck.steps:  # the CUDA branch, written out on CPU tensors
            c = ck.steps.index(step)
            hit = (k2 >= NO_PRUNE) & (best < ck.thresholds[c])
            k2.copy_(torch.where(hit, torch.full_like(k2, ck.keeps[c]), k2))
        assert torch.equal(k1, k2) and torch.equal(s1, k2 < NO_PRUNE)


def test_calibrate_thresholds():
    scores = torch.tensor([[0.1, 0.1, 0.1], [0.2, 0.2, 0.2], [0.3, 0.3, 0.3], [0.9, 0.9, 0.9]])
    acc = torch.tensor([3, 30, 5, 50])
    th = calibrate_thresholds(scores, acc, keeps=(8, 24, 40), max_loss=0.0)
    # keep 8: step 0.2 would lose (30 > 8) -> prune only below 0.2 (just above 0.1)
    assert 0.1 < th[0] <= 0.2
    # keep 24: 0.2 loses too
    assert 0.1 < th[1] <= 0.2
    # keep 40: only 0.9 loses -> threshold just above 0.3
    assert 0.3 < th[2] <= 0.9
    th = calibrate_thresholds(scores, acc, keeps=(8, 24, 40), max_loss=0.5)
    assert th[0] > 0.3  # 1 of 3 lost at 0.3: allowed
    assert calibrate_thresholds(scores, torch.tensor([99] * 4), max_loss=0.0) == (0.0,) * 3
    with pytest.raises(ValueError, match=r"Invalid shape of best_scores: expected \[S, 3\]"):
        calibrate_thresholds(scores[:, :2], acc)


# ----------------------------------------------------------------------------- graft_merge


def check_hybrid(pruned: treeops.Tree, retrieved: Retrieved, budget, hybrid: treeops.Tree):
    """Properties of graft_merge, checked independently of the reference's loop."""
    hybrid.validate()
    B, N = pruned.parents.shape
    for b in range(B):
        cap = budget if isinstance(budget, int) else int(budget[b])
        cap = min(cap, N)
        n0 = min(int(pruned.num_nodes[b]), cap)
        n = int(hybrid.num_nodes[b])
        assert n <= max(cap, 0)  # within budget
        # the (budget-truncated) pruned tree is contained unchanged
        for f in ("tokens", "parents", "scores", "depth"):
            assert torch.equal(getattr(hybrid, f)[b, :n0], getattr(pruned, f)[b, :n0]), f
        if n0 == 0:
            assert n == 0
            continue
        assert (hybrid.scores[b, n0:n] == 0).all()
        hp = token_paths(hybrid.tokens[b].tolist(), hybrid.parents[b].tolist(), n)
        rn = int(retrieved.num_nodes[b])
        rp = set(token_paths(retrieved.tokens[b].tolist(), retrieved.parents[b].tolist(), rn))
        dp = set(token_paths(pruned.tokens[b].tolist(), pruned.parents[b].tolist(), n0))
        # every grafted node is a retrieved path that the pruned tree lacked
        for i in range(n0, n):
            assert hp[i] in rp and hp[i] not in dp
        assert len(set(hp)) == n  # a trie: no path twice (siblings distinct)
        if n < cap:  # budget left: every retrieved path made it
            assert rp <= set(hp)
        # grafted nodes come in retrieval order (breadth-first): depth never decreases
        d = hybrid.depth[b, n0:n].tolist()
        assert d == sorted(d)


@given(
    trees(max_batch=3, capacities=(1, 8, 16, 64), vocab=12),
    templates(),
    st.integers(0, 2**31 - 1),
    st.booleans(),
)
def test_graft_merge_properties(case, template, seed, tensor_budget):
    rng = random.Random(seed)
    tree = case.tree
    B, N = tree.parents.shape
    keep = torch.tensor([rng.choice([0, 2, 8, NO_PRUNE]) for _ in range(B)], dtype=torch.int32)
    pruned = prune(tree, keep)
    tab = random_table(case.vocab, 4, rng, tree=pruned)
    table = table_of(tab)
    if tensor_budget:
        budget = torch.tensor([rng.randrange(0, N + 3) for _ in range(B)], dtype=torch.int32)
    else:
        budget = rng.randrange(1, N + 3)
    r = table.retrieve(pruned.tokens[:, 0], template)
    hybrid = graft_merge(pruned, r, budget)
    check_hybrid(pruned, r, budget, hybrid)
    fused = graft(pruned, table, template, budget)
    for f in treeops.Tree.FIELDS:
        assert torch.equal(getattr(fused, f), getattr(hybrid, f)), f


def test_graft_merge_reuses_existing_children_and_drops_past_budget():
    # root 1 with children 2 (node 1) and 3 (node 2); node 1 has child 4 (node 3)
    tree = tree_from_lists([[-1, 0, 0, 1]], [[1, 2, 3, 4]], [[1.0, 0.5, 0.25, 0.125]], capacity=8)
    # retrieved: 1 -> {3, 5}, 3 -> {4}, 5 -> {6, 7}; 3 reuses node 2, 4 under it is new
    r = Retrieved(
        tokens=torch.tensor([[1, 3, 5, 4, 6, 7, 0, 0]]),
        parents=torch.tensor([[-1, 0, 0, 1, 2, 2, -1, -1]], dtype=torch.int32),
        depth=torch.tensor([[0, 1, 1, 2, 2, 2, 0, 0]], dtype=torch.int32),
        num_nodes=torch.tensor([6], dtype=torch.int32),
        max_depth=2,
    )
    h = graft_merge(tree, r, budget=7)
    h.validate()
    assert int(h.num_nodes[0]) == 7
    assert h.tokens[0].tolist() == [1, 2, 3, 4, 5, 4, 6, 0]
    assert h.parents[0].tolist() == [-1, 0, 0, 1, 0, 2, 4, -1]
    assert h.scores[0].tolist() == [1.0, 0.5, 0.25, 0.125, 0, 0, 0, 0]
    h = graft_merge(tree, r, budget=torch.tensor([2], dtype=torch.int32))  # truncates the draft
    assert h.num_nodes.tolist() == [2] and h.tokens[0, :2].tolist() == [1, 2]


def test_graft_merge_retrieved_duplicates_merge_with_each_other():
    tree = tree_from_lists([[-1]], [[1]], capacity=8)
    r = Retrieved(
        tokens=torch.tensor([[1, 5, 5, 6, 7, 6]]),
        parents=torch.tensor([[-1, 0, 0, 1, 2, 2]], dtype=torch.int32),
        depth=torch.tensor([[0, 1, 1, 2, 2, 2]], dtype=torch.int32),
        num_nodes=torch.tensor([6], dtype=torch.int32),
        max_depth=2,
    )
    h = graft_merge(tree, r, budget=8)
    h.validate()
    assert h.tokens[0, : int(h.num_nodes[0])].tolist() == [1, 5, 6, 7]
    assert h.parents[0, :4].tolist() == [-1, 0, 1, 1]


# ----------------------------------------------------------------------------- bad input


def test_bad_input_messages():
    tree = tree_from_lists([[-1, 0]], [[1, 2]], capacity=4)
    table = AdjacencyTable(8, 2)
    tpl = RankTemplate.chain(2)
    with pytest.raises(ValueError, match="Invalid dtype of root_tokens: expected torch.int64"):
        table.retrieve(torch.tensor([1], dtype=torch.int32), tpl)
    with pytest.raises(ValueError, match="rank 2 needs k > 2, but the table has k = 2"):
        table.retrieve(torch.tensor([1]), RankTemplate.balanced(3, 1))
    with pytest.raises(ValueError, match="Invalid type of template: expected treeops.RankTemplate"):
        table.retrieve(torch.tensor([1]), [0, 1])
    with pytest.raises(ValueError, match=r"Invalid shape of target_logits: expected \[1, 4, 8\]"):
        table.update(tree, torch.zeros(1, 4, 9))
    with pytest.raises(ValueError, match="update: expected exactly one of the logits and topk_ids"):
        table.update(tree)
    with pytest.raises(ValueError, match="Invalid dtype of topk_ids: expected torch.int32"):
        table.update(tree, topk_ids=torch.zeros(1, 4, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="Invalid stride of target_logits"):
        table.update(tree, torch.zeros(1, 8, 4).transpose(1, 2))
    with pytest.raises(ValueError, match=r"Invalid value in tokens: expected < 8, got 9"):
        bad = tree_from_lists([[-1, 0]], [[1, 9]], capacity=4)
        table.update(bad, torch.zeros(1, 4, 8), validate=True)
    with pytest.raises(ValueError, match=r"Invalid value of budget: expected an int >= 1"):
        graft(tree, table, tpl, budget=0)
    with pytest.raises(ValueError, match=r"Invalid shape of budget: expected \[1\], got \[2\]"):
        graft(tree, table, tpl, budget=torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="Invalid dtype of budget: expected torch.int32"):
        graft(tree, table, tpl, budget=torch.ones(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="Invalid value of count: expected an int >= 0"):
        graft(tree, table, tpl, budget=4, count=-1)
    with pytest.raises(ValueError, match="Invalid type of table: expected treeops.AdjacencyTable"):
        graft(tree, table.table, tpl, budget=4)
    r = table.retrieve(torch.tensor([1]), tpl)
    with pytest.raises(ValueError, match="Invalid type of retrieved: expected treeops.Retrieved"):
        graft_merge(tree, (r.tokens, r.parents), 4)
    bad_r = Retrieved(r.tokens, r.parents.clone(), r.depth, r.num_nodes, r.max_depth)
    bad_r.parents[0, 1] = 1
    bad_r.num_nodes[0] = 2
    with pytest.raises(ValueError, match=r"parents\[1\] = 1, expected 0 <= p < 1"):
        graft_merge(tree, bad_r, 4, validate=True)
    with pytest.raises(ValueError, match="Invalid value of keep: expected an int >= 0"):
        prune(tree, -1)
    with pytest.raises(ValueError, match="Invalid type of tree: expected treeops.Tree"):
        prune(tree.parents, 1)
    with pytest.raises(ValueError, match="Invalid checkpoints: 3 steps, 2 keeps and 3 thresholds"):
        PruneCheckpoints(keeps=(8, 24))
    with pytest.raises(ValueError, match="Invalid value of vocab_size: expected a positive int"):
        AdjacencyTable(0)
    with pytest.raises(ValueError, match="Invalid dtype of lengths: expected torch.int32"):
        table.warm_start(
            torch.zeros(1, 3, dtype=torch.int64), torch.zeros(1, 3, 8), lengths=torch.tensor([3])
        )


# ----------------------------------------------------------------------------- kernels

from treeops.kernels import graft as kern  # noqa: E402
from treeops.kernels import graft_tail as kern_tail  # noqa: E402
from treeops.kernels import graft_update as kern_update  # noqa: E402

TREE_FIELDS = treeops.Tree.FIELDS


def assert_same_tree(got: treeops.Tree, want: treeops.Tree) -> None:
    for f in TREE_FIELDS:
        assert torch.equal(getattr(got, f), getattr(want, f)), f


@given(
    trees(max_batch=3, capacities=(1, 8, 16, 64), vocab=12),
    templates(),
    st.integers(0, 2**31 - 1),
    st.sampled_from(["int", "tensor"]),
    st.sampled_from([None, 5, "tensor"]),
    st.sampled_from([2, 32]),
)
def test_graft_kernel_matches_reference(case, template, seed, budget_kind, count, level_width):
    """level_width 2 makes every depth span several tiles (the loops over tiles of a depth)."""
    rng = random.Random(seed)
    tree = case.tree
    B, N = tree.parents.shape
    keep = torch.tensor([rng.choice([0, 2, 8, NO_PRUNE]) for _ in range(B)], dtype=torch.int32)
    pruned = prune(tree, keep)
    tab = random_table(case.vocab, 4, rng, tree=pruned)
    if budget_kind == "tensor":
        budget = torch.tensor([rng.randrange(-1, N + 3) for _ in range(B)], dtype=torch.int32)
    else:
        budget = rng.randrange(1, N + 3)
    cnt = (
        torch.tensor([rng.randrange(0, 12) for _ in range(B)], dtype=torch.int32)
        if count == "tensor"
        else count
    )
    want = ref.graft(pruned, tab, template, budget, cnt)
    par, rank, dep = template.tensors("cpu")
    got = treeops.Tree(
        *kern.graft_fused(
            pruned,
            budget,
            table=tab,
            t_parents=par,
            t_ranks=rank,
            t_depth=dep,
            max_depth=template.max_depth,
            count=cnt,
            level_width=level_width,
        )
    )
    assert_same_tree(got, want)
    # two steps: retrieve, then merge the packed paths
    r = ref.adjacency_retrieve(tab, pruned.tokens[:, 0], template, cnt)
    tok, rpar, rdep, num = kern.retrieve(
        tab, pruned.tokens[:, 0], par, rank, dep, template.max_depth, cnt
    )
    for a, b_ in zip((tok, rpar, rdep, num), (r.tokens, r.parents, r.depth, r.num_nodes)):
        assert torch.equal(a, b_)
    got = treeops.Tree(
        *kern.graft_fused(
            pruned,
            budget,
            r_tokens=r.tokens,
            r_parents=r.parents,
            r_depth=r.depth,
            r_num=r.num_nodes,
            max_depth=r.max_depth,
            level_width=level_width,
        )
    )
    assert_same_tree(got, ref.graft_merge(pruned, r, budget))


def test_graft_kernel_default_template_budget_60():
    """The production shape: N = 64, budget 60, default template, a warm table, B = 4."""
    rng = random.Random(7)
    rows = [
        parents_of(k, n, rng)
        for k, n in (("random", 64), ("random", 9), ("chain", 25), ("single", 1))
    ]
    tree = make_tree(rows, 64, 64, rng)
    pruned = prune(tree, torch.tensor([40, 8, 24, NO_PRUNE], dtype=torch.int32))
    tab = random_table(64, 8, rng, empty=0.1, tree=pruned)
    tpl = RankTemplate.default()
    want = ref.graft(pruned, tab, tpl, 60)
    want.validate()
    assert int(want.num_nodes.max()) == 60  # the budget fills
    par, rank, dep = tpl.tensors("cpu")
    for lw in (tpl.max_width, 4):
        got = treeops.Tree(
            *kern.graft_fused(
                pruned,
                60,
                table=tab,
                t_parents=par,
                t_ranks=rank,
                t_depth=dep,
                max_depth=tpl.max_depth,
                level_width=lw,
            )
        )
        assert_same_tree(got, want)
    out = treeops.Tree.empty(4, 64)
    kern.graft_fused(
        pruned,
        60,
        table=tab,
        t_parents=par,
        t_ranks=rank,
        t_depth=dep,
        max_depth=tpl.max_depth,
        out=tuple(getattr(out, f) for f in TREE_FIELDS),
    )
    assert_same_tree(out, want)


def run_update_kernel(table, tokens, num, logits=None, ids=None, last_wins=False):
    owner = torch.full((table.shape[0],), kern_update.INT32_MAX, dtype=torch.int32)
    kern_update.adjacency_update(table, owner, {}, tokens, num, logits, ids, last_wins)
    assert (owner == kern_update.INT32_MAX).all()  # every claim released


@given(
    st.integers(0, 2**31 - 1),
    st.sampled_from([torch.float32, torch.bfloat16]),
    st.booleans(),
    st.sampled_from([1, 3, 8]),
    st.sampled_from([7, 40, 600]),
)
def test_update_kernel_matches_reference(seed, dtype, ties, k, V):
    rng = random.Random(seed)
    B, N = rng.randint(1, 3), rng.choice([1, 4, 8])
    rows = [
        parents_of(rng.choice(["random", "star", "inactive"]), rng.randint(0, N), rng)
        for _ in range(B)
    ]
    tree = make_tree(rows, N, max(V, N), rng)
    tree.tokens.copy_(tree.tokens % min(V, 5))  # many duplicates
    logits = logits_like((B, N, V), rng, ties=ties, dtype=dtype)
    if rng.random() < 0.3:
        logits[..., rng.randrange(V)] = float("-inf")
    want = torch.full((V, k), -1, dtype=torch.int32)
    ref.adjacency_update(want, tree, logits, None)
    got = torch.full((V, k), -1, dtype=torch.int32)
    run_update_kernel(got, tree.tokens, tree.num_nodes, logits=logits)
    assert torch.equal(got, want)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, V, (B, N, rng.choice([1, k, k + 2])), generator=g, dtype=torch.int32)
    want.fill_(-1)
    got.fill_(-1)
    ref.adjacency_update(want, tree, None, ids)
    run_update_kernel(got, tree.tokens, tree.num_nodes, ids=ids)
    assert torch.equal(got, want)
    # warm start: prompts are [B, L] token rows with lengths; the last occurrence wins
    lengths = torch.tensor([rng.randint(0, N) for _ in range(B)], dtype=torch.int32)
    want.fill_(-1)
    got.fill_(-1)
    ref.adjacency_warm_start(want, tree.tokens, logits, lengths, None)
    run_update_kernel(got, tree.tokens, lengths, logits=logits, last_wins=True)
    assert torch.equal(got, want)


_SPECIALS = [0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, float("inf"), float("-inf"), float("nan")]


@given(
    st.integers(0, 2**31 - 1),
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    st.integers(1, 9),
    st.sampled_from([16, 32, 64]),
    st.integers(1, 300),
    st.sampled_from([1, 2, 5, 8, 16]),
    st.sampled_from(["randn", "ties", "specials", "masked"]),
    st.sampled_from([0, 1, 2, 4]),
    st.sampled_from(["passes", "bitonic"]),
    st.sampled_from([0, 0, 1, 4, 16]),
    st.booleans(),
    st.booleans(),
)
def test_update_kernel_splits_and_special_values(
    seed, dtype, splits, block_v, V, k, kind, group, merge, block_max, rank32, rank_all
):
    """Any split/block (V rarely their multiple; k >= V), ties, ±0, ±inf, NaN, rows of -inf and
    NaN with a few values ("masked": fewer than k blocks may hold a value above -inf, where the
    block-maxima method ranks the whole row), every top-k method (block_max > 0: block maxima,
    ranked on int64 keys or, ``rank32`` with bf16 logits, int32 ones, by the winner alone or,
    ``rank_all``, by every node of a shared token (4 distinct tokens); group and merge unused;
    else group 0: the running list, or group maxima where a block holds KB groups) and either
    merge of the splits' lists: the reference's."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    B, N = rng.randint(1, 2), rng.choice([1, 3, 6])
    tree = make_tree([parents_of("random", rng.randint(0, N), rng) for _ in range(B)], N, 300, rng)
    tree.tokens.copy_(tree.tokens % min(V, 4))
    logits = {
        "randn": lambda: torch.randn(B, N, V, generator=g) * 3,
        "ties": lambda: torch.randint(-2, 2, (B, N, V), generator=g).float(),
        "specials": lambda: torch.tensor(_SPECIALS)[torch.randint(0, 9, (B, N, V), generator=g)],
        "masked": lambda: torch.where(
            torch.rand(B, N, V, generator=g) < 0.03,
            torch.randn(B, N, V, generator=g),
            torch.where(torch.rand(B, N, V, generator=g) < 0.5, float("-inf"), float("nan")),
        ),
    }[kind]().to(dtype)
    lengths = torch.tensor([rng.randint(0, N) for _ in range(B)], dtype=torch.int32)
    with (
        patch.object(kern_update, "_splits", lambda n, v, b, d: splits),
        patch.object(kern_update, "update_tiling", lambda n, v, d: (block_v, 1)),
        patch.dict(
            kern_update.UPDATE_TUNING,
            {
                "group": group,
                "merge": merge,
                "block_max": block_max,
                "rank32": rank32,
                "rank_all": rank_all,
            },  # fmt: skip
        ),
    ):
        for num, last in ((tree.num_nodes, False), (lengths, True)):
            want = torch.full((V, k), -1, dtype=torch.int32)
            got = want.clone()
            if last:
                ref.adjacency_warm_start(want, tree.tokens, logits, lengths)
            else:
                ref.adjacency_update(want, tree, logits)
            run_update_kernel(got, tree.tokens, num, logits=logits, last_wins=last)
            assert torch.equal(got, want)


def test_out_buffers():
    tree = tree_from_lists([[-1, 0, 0]], [[1, 2, 3]], capacity=8)
    table = AdjacencyTable(8, 2)
    table.table[1] = torch.tensor([4, 2], dtype=torch.int32)
    out = treeops.Tree.empty(1, 8)
    res = graft(tree, table, RankTemplate.balanced(2, 1), 8, out=out)
    assert res is out
    assert out.tokens[0, : int(out.num_nodes[0])].tolist() == [1, 2, 3, 4]
    out.validate()
    with pytest.raises(ValueError, match="Invalid out: it shares memory with tree"):
        graft(tree, table, RankTemplate.balanced(2, 1), 8, out=tree)
    with pytest.raises(ValueError, match=r"Invalid shape of out: expected a tree of shape \[1, 8"):
        graft(tree, table, RankTemplate.balanced(2, 1), 8, out=treeops.Tree.empty(1, 4))


def test_update_kernel_rejects_strided_ids_before_claiming():
    """A topk_ids whose last dim is strided is refused before the claim launch, so the owner
    buffer stays all INT32_MAX and a later update is not blocked by a stale claim."""
    from treeops.kernels.graft_update import adjacency_update

    V, k = 50, 4
    table = torch.full((V, k), -1, dtype=torch.int32)
    owner = torch.full((V,), 2**31 - 1, dtype=torch.int32)
    tokens = torch.tensor([[3, 7, 3]])
    num_nodes = torch.tensor([3], dtype=torch.int32)
    ids = torch.arange(3 * 2 * k, dtype=torch.int32).view(1, 3, 2 * k)[..., ::2]  # stride 2
    with pytest.raises(ValueError, match="topk_ids"):
        adjacency_update(table, owner, {}, tokens, num_nodes, None, ids, False)
    assert torch.equal(owner, torch.full((V,), 2**31 - 1, dtype=torch.int32))
    assert torch.equal(table, torch.full((V, k), -1, dtype=torch.int32))


# ------------------------------------------------------------------ torch.ops.treeops (opcheck)
def _opcheck(op, args):
    res = torch.library.opcheck(op, args)
    assert set(res.values()) == {"SUCCESS"}, (op, res)


def _opcheck_inputs():
    """Two trees (a random 12-node one and a chain) of capacity 16 over V = 50, a warm table."""
    rng = random.Random(5)
    V, N = 50, 16
    tree = make_tree([parents_of("random", 12, rng), parents_of("chain", 5, rng)], N, V, rng)
    tab = random_table(V, 4, rng, tree=tree)
    return rng, V, tree, tab


def test_opcheck_adjacency_ops():
    """``adjacency_update`` / ``adjacency_warm_start`` from logits and from top-k ids, and
    ``adjacency_retrieve`` with every kind of count (None stands as the template's size - 1)."""
    ops = torch.ops.treeops
    rng, V, tree, tab = _opcheck_inputs()
    B, N = tree.parents.shape
    logits = logits_like((B, N, V), rng)
    ids = torch.randint(-1, V, (B, N, 6), dtype=torch.int32)
    for lg, ii in ((logits, None), (None, ids)):
        _opcheck(ops.adjacency_update.default, (tab.clone(), None, None, None,
                                                *tree.tensors(), lg, ii))  # fmt: skip
        lengths = torch.tensor([N, 3], dtype=torch.int32)
        _opcheck(ops.adjacency_warm_start.default, (tab.clone(), None, None, None, tree.tokens,
                                                    lg, lengths, ii))  # fmt: skip
    tpl = RankTemplate.default()
    par, rank, dep = tpl.tensors("cpu")
    roots = tree.tokens[:, 0].contiguous()
    table8 = random_table(V, 8, rng)
    for count, count_int in ((None, tpl.size - 1), (None, 5), (torch.tensor([3, 40]), 0)):
        count = None if count is None else count.to(torch.int32)
        _opcheck(ops.adjacency_retrieve.default,
                 (table8, roots, par, rank, dep, tpl.max_depth, count, count_int))  # fmt: skip
    # the public methods run the ops
    t = table_of(tab)
    t.update(tree, topk_ids=ids)
    want = tab.clone()
    ref.adjacency_update(want, tree, None, ids)
    assert torch.equal(t.table, want)


def test_opcheck_graft_and_prune_ops():
    """``graft``, ``graft_merge``, ``graft_tail``, ``prune`` (int and tensor budget / keep /
    count) and ``prune_checkpoint``; the out tree is a fresh buffer, as the public functions
    allocate."""
    ops = torch.ops.treeops
    rng, V, tree, tab = _opcheck_inputs()
    B, N = tree.parents.shape
    for keep, keep_int in ((None, 4), (None, NO_PRUNE), (torch.tensor([2, 0]), 0)):
        keep = None if keep is None else keep.to(torch.int32)
        out = treeops.Tree.empty(B, N)
        _opcheck(ops.prune.default, (*tree.tensors(), keep, keep_int, *out.tensors()))
    pruned = prune(tree, torch.tensor([6, NO_PRUNE], dtype=torch.int32))
    tpl = RankTemplate.balanced(2, 3)
    par, rank, dep = tpl.tensors("cpu")
    budgets = ((None, 12), (torch.tensor([16, 9], dtype=torch.int32), 0))
    for budget, budget_int in budgets:
        for count, count_int in (
            (None, tpl.size - 1),
            (torch.tensor([2, 9], dtype=torch.int32), 0),
        ):
            out = treeops.Tree.empty(B, N)
            _opcheck(ops.graft.default, (*pruned.tensors(), tab, par, rank, dep, tpl.max_depth,
                                         tpl.max_width, budget, budget_int, count, count_int,
                                         *out.tensors()))  # fmt: skip
        for count, count_int in ((None, 3), (torch.tensor([2, 9], dtype=torch.int32), 0)):
            out = treeops.Tree.empty(B, N)
            _opcheck(ops.graft_tail.default, (*pruned.tensors(), tab, count, count_int, budget,
                                              budget_int, 9, *out.tensors()))  # fmt: skip
        r = ref.adjacency_retrieve(tab, pruned.tokens[:, 0], tpl)
        out = treeops.Tree.empty(B, N)
        _opcheck(ops.graft_merge.default, (*pruned.tensors(), r.tokens, r.parents, r.depth,
                                           r.num_nodes, r.max_depth, budget, budget_int,
                                           *out.tensors()))  # fmt: skip
    keep = PruneCheckpoints().start(B)
    stop = torch.empty(2, dtype=torch.bool)
    _opcheck(ops.prune_checkpoint.default, (keep, torch.tensor([0.1, 0.9]), 8, 0.3, stop))
    # the public functions run the ops: the reference's trees
    assert_same_tree(graft(pruned, table_of(tab), tpl, 12), ref.graft(pruned, tab, tpl, 12))
    assert_same_tree(prune(tree, 3), ref.prune(tree, 3))
    assert_same_tree(treeops.graft_tail(pruned, table_of(tab), 3, 12),
                     ref.graft_tail(pruned, tab, 3, 12))  # fmt: skip


@pytest.mark.parametrize(
    "n_flat, V, tuning, want",
    [
        (64, 32000, {}, (1024, 2)),  # B 1: 32 programs a node, each one 1,024-logit block
        (128, 32000, {}, (1024, 2)),  # B 2: as many splits as 1,024-logit blocks
        (512, 32000, {}, (512, 1)),  # B 8: 8 splits of several blocks each
        (64, 128256, {}, (512, 1)),  # V 128,256: the split cap (64) leaves blocks to stream
        (64, 32000, {"block_max": 0}, (512, 1)),  # the top-k lists keep their blocks
        (64, 32000, {"block_v": 512}, (512, 1)),  # a configured block is kept
    ],
)
def test_update_tiling_takes_two_warp_blocks_where_each_program_streams_one(
    monkeypatch, n_flat, V, tuning, want
):
    """Stage 1's default tiling on a 132-SM GPU (the H100's and H200's count): 1,024-logit
    blocks over two warps exactly where every program would stream a single one of them."""
    monkeypatch.setattr(kern_update, "interpreted", lambda: False)
    monkeypatch.setattr(kern_update._runtime, "sm_count", lambda device: 132)
    for name, value in tuning.items():
        monkeypatch.setitem(kern_update.UPDATE_TUNING, name, value)
    assert kern_update.update_tiling(n_flat, V, torch.device("cuda")) == want


@pytest.mark.parametrize(
    "n_flat, rank_all, want",
    [(64, None, True), (132, None, True), (133, None, False), (4096, None, False),
     (4096, True, True), (64, False, False)],
)  # fmt: skip
def test_update_ranks_every_node_where_each_has_an_sm(monkeypatch, n_flat, rank_all, want):
    """Stage 2 of the block maxima ranks every valid node's row (not only the winner's) exactly
    where the launch's programs are at most the SMs (132 here), unless configured."""
    monkeypatch.setattr(kern_update._runtime, "sm_count", lambda device: 132)
    monkeypatch.setitem(kern_update.UPDATE_TUNING, "rank_all", rank_all)
    assert kern_update._rank_all(n_flat, torch.device("cuda")) is want
    assert kern_update._rank_all(n_flat, torch.device("cpu")) is (rank_all is True)


@pytest.mark.parametrize(
    "n_flat, rank_warps, want",
    [(64, None, 4), (132, None, 4), (133, None, 2), (4096, None, 2), (4096, 8, 8), (64, 2, 2)],
)  # fmt: skip
def test_update_ranks_with_two_warps_where_nodes_outnumber_the_sms(
    monkeypatch, n_flat, rank_warps, want
):
    """Stage 2's programs take 4 warps where each has an SM (132 here) and 2 where they queue
    for them, unless configured."""
    monkeypatch.setattr(kern_update._runtime, "sm_count", lambda device: 132)
    monkeypatch.setitem(kern_update.UPDATE_TUNING, "rank_warps", rank_warps)
    assert kern_update._rank_warps(n_flat, torch.device("cuda")) == want
    assert kern_update._rank_warps(n_flat, torch.device("cpu")) == (rank_warps or 4)


@pytest.mark.parametrize("block_max", [0, 16])
def test_update_op_workspace_key_is_the_launchers(block_max, monkeypatch):
    """The launcher caches its workspace under ``update_workspace_key`` (which the public
    update uses to pass it to the op), sized by it, for either method."""
    monkeypatch.setitem(kern_update.UPDATE_TUNING, "block_max", block_max)
    for V, k, n in ((50, 4, (2, 8)), (700, 3, (1, 3)), (7, 8, (3, 1))):
        ws: dict = {}
        tokens = torch.zeros(n, dtype=torch.int64)
        table = torch.full((V, k), -1, dtype=torch.int32)
        owner = torch.full((V,), kern_update.INT32_MAX, dtype=torch.int32)
        num = torch.full((n[0],), n[1], dtype=torch.int32)
        kern_update.adjacency_update(table, owner, ws, tokens, num, torch.randn(*n, V), None, False)
        key = kern_update.update_workspace_key(n[0] * n[1], V, k, table.device)
        assert list(ws) == [key]
        assert [t.numel() for t in ws[key]] == [key[0] * key[1], key[0] * key[2]]
    for V in (65537, 128256, 300000):  # bf16 order keys hold a split's ids in 16 bits
        S = kern_update.update_splits(1, V, torch.device("cpu"))
        block_v = kern_update.update_tiling(1, V, torch.device("cpu"))[0]
        assert kern_update._chunk(V, S, block_v) <= 1 << 16


# ----------------------------------------------------------------------------- graft_tail


def brute_tail(tree: treeops.Tree, tab: torch.Tensor, count: list[int], budget: list[int]):
    """graft_tail by its definition, on token paths: the best leaf's path, extended."""
    out = []
    V = tab.shape[0]
    for b in range(tree.batch_size):
        n = int(tree.num_nodes[b])
        toks, pars = tree.tokens[b].tolist(), tree.parents[b].tolist()
        paths = set(token_paths(toks, pars, n))
        cap = max(0, min(budget[b], tree.capacity))
        if n == 0 or n > cap:
            out.append((paths, None))
            continue
        kids = {pars[i] for i in range(1, n)}
        scores = tree.scores[b].tolist()
        a = max((i for i in range(n) if i not in kids), key=lambda i: (scores[i], -i))
        path, i = [], a  # (token_paths' form: the root's token left out)
        while i > 0:
            path.append(toks[i])
            i = pars[i]
        path, last = path[::-1], toks[a]
        for _ in range(min(count[b], cap - n)):
            nxt = int(tab[last, 0]) if 0 <= last < V else -1
            if not 0 <= nxt < V:
                break
            path, last = path + [nxt], nxt
            paths.add(tuple(path))
        out.append((paths, tuple(path)))
    return out


@given(
    trees(max_batch=3, capacities=(1, 8, 16, 64), vocab=12),
    st.integers(0, 2**31 - 1),
    st.sampled_from(["int", "tensor"]),
    st.sampled_from(["int", "tensor"]),
)
def test_graft_tail_kernel_matches_reference_and_definition(case, seed, count_kind, budget_kind):
    """The kernel (interpreter) equals the reference field for field, the result is a valid tree
    holding the input's nodes unchanged, and its token paths are the input's plus the best
    leaf's path extended one table successor at a time (brute force on paths)."""
    rng = random.Random(seed)
    tree = case.tree
    B, N = tree.parents.shape
    keep = torch.tensor([rng.choice([0, 2, 8, NO_PRUNE]) for _ in range(B)], dtype=torch.int32)
    pruned = prune(tree, keep)
    tab = random_table(case.vocab, 3, rng, empty=0.15)
    counts = [rng.randrange(0, 6) for _ in range(B)]
    budgets = [rng.randrange(-1, N + 3) for _ in range(B)]
    if count_kind == "tensor":
        count, max_count = torch.tensor(counts, dtype=torch.int32), 6
    else:
        counts = [counts[0]] * B
        count, max_count = counts[0], counts[0]
    if budget_kind == "tensor":
        budget = torch.tensor(budgets, dtype=torch.int32)
    else:
        budgets = [max(1, budgets[0])] * B
        budget = budgets[0]
    want = ref.graft_tail(pruned, tab, count, budget)
    got = treeops.Tree(*kern_tail.graft_tail(pruned, tab, count, budget, max_count))
    assert_same_tree(got, want)
    want.validate()
    n0 = pruned.num_nodes.tolist()
    for b in range(B):
        n = n0[b]
        for f in ("tokens", "parents", "depth", "scores"):
            assert torch.equal(getattr(got, f)[b, :n], getattr(pruned, f)[b, :n]), f
    for b, (paths, _) in enumerate(brute_tail(pruned, tab, counts, budgets)):
        n = int(got.num_nodes[b])
        assert set(token_paths(got.tokens[b].tolist(), got.parents[b].tolist(), n)) == paths


def test_graft_tail_extends_the_best_leaf():
    """A root with a deep branch (scores 0.9, 0.8) and a shallow one (0.3): the chain hangs
    below the deep branch's leaf, follows rank-0 successors, and stops at an empty entry."""
    tree = tree_from_lists([[-1, 0, 1, 0]], tokens=[[5, 6, 7, 9]], scores=[[1.0, 0.9, 0.8, 0.3]],
                           capacity=8)  # fmt: skip
    tab = torch.full((12, 2), -1, dtype=torch.int32)
    tab[7, 0], tab[10, 0], tab[11, 0] = 10, 11, -1
    tab[7, 1] = 3  # rank 1: never followed
    out = treeops.graft_tail(tree, table_of(tab), 4, budget=8, validate=True)
    assert out.num_nodes.tolist() == [6]
    assert out.tokens[0, :6].tolist() == [5, 6, 7, 9, 10, 11]
    assert out.parents[0, :6].tolist() == [-1, 0, 1, 0, 2, 4]
    assert out.depth[0, :6].tolist() == [0, 1, 2, 1, 3, 4]
    assert out.scores[0, 4:6].tolist() == [0.0, 0.0]
    out.validate()
    # the budget caps it (root included), and a full tree is left as it is
    assert treeops.graft_tail(tree, table_of(tab), 4, budget=5).num_nodes.tolist() == [5]
    assert treeops.graft_tail(tree, table_of(tab), 4, budget=3).num_nodes.tolist() == [4]


def test_graft_tail_counts_above_max_count_act_as_it():
    """A [B] count above ``max_count``: the op (the reference on CPU) and the kernel both cut
    each chain at ``max_count`` nodes."""
    tree = tree_from_lists([[-1, 0], [-1]], tokens=[[1, 2], [3]], capacity=8)
    tab = torch.tensor([[1, -1], [2, -1], [3, -1], [0, -1]], dtype=torch.int32)
    count = torch.tensor([5, 1], dtype=torch.int32)
    got = treeops.graft_tail(tree, table_of(tab), count, 8, max_count=2)
    assert got.num_nodes.tolist() == [4, 2]
    kern_got = treeops.Tree(*kern_tail.graft_tail(tree, tab, count, 8, 2))
    assert_same_tree(kern_got, got)


def test_graft_tail_bad_input_is_a_value_error():
    tree = tree_from_lists([[-1, 0]], tokens=[[1, 2]], capacity=4)
    table = table_of(torch.zeros(4, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="count"):
        treeops.graft_tail(tree, table, -1, budget=4)
    with pytest.raises(ValueError, match="count"):
        treeops.graft_tail(tree, table, None, budget=4)
    with pytest.raises(ValueError, match="budget"):
        treeops.graft_tail(tree, table, 2, budget=0)
    with pytest.raises(ValueError, match="max_count"):
        treeops.graft_tail(tree, table, 3, budget=4, max_count=2)
    with pytest.raises(ValueError, match="table"):
        treeops.graft_tail(tree, torch.zeros(4, 2, dtype=torch.int32), 2, budget=4)
    with pytest.raises(ValueError, match="out"):
        treeops.graft_tail(tree, table, 2, budget=4, out=tree)
