"""bench_graft's PyTorch peers compute what the reference computes (so its comparison is fair),
on the CPU: ``torch_graft`` against ``treeops.reference.graft``, ``TorchTable`` and
``stable_topk_table`` against ``treeops.reference.graft.adjacency_update``."""

from __future__ import annotations

import random

import pytest
import torch
from bench_graft import TorchTable, stable_topk_table, torch_graft, tree_equal

from treeops import RankTemplate, Tree, prune
from treeops.reference import graft as ref


def random_trees(B: int, N: int, V: int, rng: random.Random) -> Tree:
    """B trees of capacity N (some rows inactive, sizes ragged), sibling tokens distinct."""
    par = torch.full((B, N), -1, dtype=torch.int32)
    tok = torch.zeros(B, N, dtype=torch.int64)
    num = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        n = 0 if rng.random() < 0.2 else rng.randint(1, N)
        used: dict[int, set] = {}
        tok[b, 0] = rng.randrange(V)
        for i in range(1, n):
            p = rng.randrange(i)
            free = [t for t in range(V) if t not in used.setdefault(p, set())]
            if not free:
                n = i
                break
            t = rng.choice(free)
            used[p].add(t)
            par[b, i], tok[b, i] = p, t
        num[b] = n
    if int(num.max()) == 0:
        num[0] = 1
    scores = torch.sort(torch.rand(B, N), dim=1, descending=True).values
    return Tree.from_parents(par, num, tok, scores)


def random_table(V: int, k: int, rng: random.Random, tree: Tree) -> torch.Tensor:
    """[V, k] with empty entries, some rows pointing at the tree's own children (the trie merge
    reuses them)."""
    tab = torch.tensor(
        [[rng.randrange(V) if rng.random() > 0.2 else -1 for _ in range(k)] for _ in range(V)],
        dtype=torch.int32,
    )
    for b in range(tree.batch_size):
        for i in range(1, int(tree.num_nodes[b])):
            if rng.random() < 0.5:
                p = int(tree.parents[b, i])
                tab[int(tree.tokens[b, p]), rng.randrange(k)] = int(tree.tokens[b, i])
    return tab


@pytest.mark.parametrize("seed", range(12))
def test_torch_peers_match_reference(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    B, N, V = rng.randint(1, 3), rng.choice([8, 64]), rng.choice([12, 64])
    tree = random_trees(B, N, V, rng)
    pruned = prune(tree, rng.choice([2, 8, 24]))
    tab = random_table(V, 8, rng, pruned)
    tpl = RankTemplate.default() if rng.random() < 0.5 else RankTemplate.balanced(3, 3)
    budget = rng.randrange(1, N + 2)
    assert tree_equal(torch_graft(pruned, tab, tpl, budget), ref.graft(pruned, tab, tpl, budget))
    # distinct logits per row: torch.topk's order is then exact
    logits = torch.stack([torch.randperm(V).float() for _ in range(B * N)]).view(B, N, V)
    tt = TorchTable(V, 3, "cpu")
    tt.update(tree.tokens, tree.num_nodes, logits)
    want = torch.full((V, 3), -1, dtype=torch.int32)
    ref.adjacency_update(want, tree, logits)
    assert torch.equal(tt.table[:V], want)
    empty = torch.full((V, 3), -1, dtype=torch.int32)
    got = stable_topk_table(tree.tokens, tree.num_nodes, logits, 3, V, empty)
    assert torch.equal(got, want)
