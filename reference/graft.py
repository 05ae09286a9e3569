"""Graft (docs/design.md op 6), written the obvious way: Python loops over requests and nodes.

This module is the specification the Triton kernels in ``treeops.kernels.graft`` are tested
against. Every function has the signature of its public counterpart in ``treeops.graft`` (the
``AdjacencyTable`` methods take the table tensor as their first argument here).

- ``adjacency_update``: for every verified node, the row of its token becomes the top-k tokens
  of the target's logits there (ties: lowest id), or the given ``topk_ids``; when one token sits
  at several nodes, the lowest flattened index ``b*N + i`` wins.
- ``adjacency_warm_start``: the same from a prompt's prefill logits; the *last* occurrence of a
  token in the prompt (highest ``b*L + t``) wins, since it is the most recent context.
- ``adjacency_retrieve``: walk a rank-path template breadth-first from each root token.
- ``graft_merge``: trie-insert the retrieved paths into the (pruned) tree up to the budget.
- ``graft_tail``: extend each request's best leaf with the table's rank-0 successor chain.
- ``prune`` and ``prune_checkpoint``: keep the top draft nodes when confidence is low.
"""

from __future__ import annotations

import torch

from treeops._graft_types import NO_PRUNE, RankTemplate, Retrieved
from treeops.tree import Tree


def _topk_ids(logits: torch.Tensor, k: int) -> list[int]:
    """Top-k ids of one logits row by value descending, ties by lowest id (-1 padded)."""
    order = torch.sort(-logits.double(), stable=True).indices[:k].tolist()
    return order + [-1] * (k - len(order))


def adjacency_update(
    table: torch.Tensor,
    tree: Tree,
    target_logits: torch.Tensor | None = None,
    topk_ids: torch.Tensor | None = None,
) -> None:
    """In place: ``table[tree.tokens[b, i]] = top-k(target_logits[b, i])`` for ``i < num_nodes[b]``.

    ``target_logits`` [B, N, V] float or ``topk_ids`` [B, N, k'] int32 (first k taken, -1 padded
    to k). Lowest flattened index ``b*N + i`` wins among nodes that carry the same token; nodes
    whose token is outside ``[0, V)`` are ignored.
    """
    B = tree.parents.shape[0]
    nodes = [(b, i) for b in range(B) for i in range(int(tree.num_nodes[b]))]
    _write_rows(table, tree.tokens, nodes, target_logits, topk_ids)


def adjacency_warm_start(
    table: torch.Tensor,
    prompt_tokens: torch.Tensor,
    prefill_logits: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    topk_ids: torch.Tensor | None = None,
) -> None:
    """In place: for ``t < lengths[b]``, the row of ``prompt_tokens[b, t]`` becomes
    ``top-k(prefill_logits[b, t])``.

    ``prompt_tokens`` [B, L] int64, ``prefill_logits`` [B, L, V] or ``topk_ids`` [B, L, k'],
    ``lengths`` [B] int32 (default L). The last occurrence (highest ``b*L + t``) wins.
    """
    B, L = prompt_tokens.shape
    lens = [L if lengths is None else int(lengths[b]) for b in range(B)]
    positions = [(b, t) for b in reversed(range(B)) for t in reversed(range(lens[b]))]
    _write_rows(table, prompt_tokens, positions, prefill_logits, topk_ids)


def _write_rows(table, tokens, positions, logits, topk_ids) -> None:
    """Visit ``positions`` (b, i) in order; the first visit of each token id in ``[0, V)`` sets
    its row to top-k(``logits[b, i]``), or to ``topk_ids[b, i, :k]`` padded with -1."""
    V, k = table.shape
    done: set[int] = set()
    for b, i in positions:
        tok = int(tokens[b, i])
        if tok in done or not 0 <= tok < V:
            continue
        done.add(tok)
        if logits is not None:
            row = _topk_ids(logits[b, i], k)
        else:
            assert topk_ids is not None
            row = topk_ids[b, i, :k].tolist()
            row = row + [-1] * (k - len(row))
        table[tok] = torch.tensor(row, dtype=torch.int32)


def adjacency_retrieve(
    table: torch.Tensor,
    root_tokens: torch.Tensor,
    template: RankTemplate,
    count: torch.Tensor | int | None = None,
) -> Retrieved:
    """Fill ``template`` breadth-first from each root token by table look-ups.

    Template node j (j >= 1) holds ``table[token of its parent, rank[j]]``; an empty entry (-1),
    or a node whose parent is not retrieved, is skipped with its subtree. At most ``count[b]``
    nodes (root excluded) are retrieved per request, the first ones in template order. Tokens
    outside ``[0, V)`` (in the table or as a root) read as empty. Output:
    retrieved nodes packed in template (breadth-first) order after the root at index 0.
    """
    V = table.shape[0]
    B = root_tokens.shape[0]
    T = template.size
    par_t = template.parents.tolist()
    rank_t = template.ranks.tolist()
    dep_t = template.depth.tolist()
    tokens = torch.zeros(B, T, dtype=torch.int64)
    parents = torch.full((B, T), -1, dtype=torch.int32)
    depth = torch.zeros(B, T, dtype=torch.int32)
    num = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        if count is None:
            limit = T - 1
        elif isinstance(count, int):
            limit = count
        else:
            limit = int(count[b])
        where = [-1] * T  # template node -> packed index (-1: not retrieved)
        tok_of = [0] * T
        where[0], tok_of[0] = 0, int(root_tokens[b])
        tokens[b, 0] = tok_of[0]
        n = 1
        for j in range(1, T):
            p = par_t[j]
            if where[p] < 0 or n - 1 >= limit:
                continue
            if not 0 <= tok_of[p] < V:
                continue
            t = int(table[tok_of[p], rank_t[j]])
            if not 0 <= t < V:
                continue
            where[j], tok_of[j] = n, t
            tokens[b, n], parents[b, n], depth[b, n] = t, where[p], dep_t[j]
            n += 1
        num[b] = n
    dev = root_tokens.device
    return Retrieved(
        tokens.to(dev), parents.to(dev), depth.to(dev), num.to(dev), template.max_depth
    )


def graft_merge(tree: Tree, retrieved: Retrieved, budget: torch.Tensor | int) -> Tree:
    """Insert the retrieved paths into ``tree`` as into a trie, up to ``budget`` nodes per request.

    Request b keeps its first ``min(num_nodes[b], budget[b])`` nodes (rank order makes any prefix
    ancestor-closed), then takes retrieved nodes 1.. in order: node j goes under the merged node
    of its retrieved parent; if that parent has a child with j's token, j reuses it, otherwise j
    becomes a new node (score 0) while the request has fewer than ``budget[b]`` nodes, and is
    dropped, with its subtree, when it is full. Retrieved node 0 stands for the tree's root;
    retrieved nodes come in breadth-first order (depth never decreasing), as retrieve gives them.
    """
    B, N = tree.parents.shape
    par = torch.full((B, N), -1, dtype=torch.int32)
    tok = torch.zeros(B, N, dtype=torch.int64)
    sc = torch.zeros(B, N, dtype=torch.float32)
    num = torch.zeros(B, dtype=torch.int32)
    t = tree.to("cpu")
    r = retrieved.to("cpu")
    for b in range(B):
        cap = budget if isinstance(budget, int) else int(budget[b])
        cap = max(0, min(cap, N))
        n = min(int(t.num_nodes[b]), cap)
        par[b, :n] = t.parents[b, :n]
        tok[b, :n] = t.tokens[b, :n]
        sc[b, :n] = t.scores[b, :n]
        if n == 0:
            continue
        children: dict[int, dict[int, int]] = {}
        for i in range(1, n):
            children.setdefault(int(par[b, i]), {}).setdefault(int(tok[b, i]), i)
        where = {0: 0}  # retrieved index -> merged index
        for j in range(1, int(r.num_nodes[b])):
            p = int(r.parents[b, j])
            if p not in where:
                continue
            m = where[p]
            tj = int(r.tokens[b, j])
            kids = children.setdefault(m, {})
            if tj in kids:
                where[j] = kids[tj]
            elif n < cap:
                par[b, n], tok[b, n] = m, tj
                kids[tj] = n
                where[j] = n
                n += 1
        num[b] = n
    dev = tree.device
    return Tree.from_parents(par.to(dev), num.to(dev), tok.to(dev), sc.to(dev))


def graft(
    tree: Tree,
    table: torch.Tensor,
    template: RankTemplate,
    budget: torch.Tensor | int,
    count: torch.Tensor | int | None = None,
) -> Tree:
    """Retrieve from each request's root token, then merge: ``graft_merge(tree, retrieve(...))``."""
    return graft_merge(tree, adjacency_retrieve(table, tree.tokens[:, 0], template, count), budget)


def graft_tail(
    tree: Tree, table: torch.Tensor, count: torch.Tensor | int, budget: torch.Tensor | int
) -> Tree:
    """Hang a chain of up to ``count[b]`` nodes below each request's best leaf: the leaf (a node
    without children) of the highest score, the lowest index on ties, and under it
    ``table[token, 0]`` of the node above, repeated. The chain stops at an empty entry (-1), a
    token outside ``[0, V)`` or when the request holds ``min(budget[b], N)`` nodes; a request
    with more nodes than that, or none, is left as it is. New nodes score 0."""
    B, N = tree.parents.shape
    V = table.shape[0]
    t = tree.to("cpu")
    tab = table.to("cpu")
    par = t.parents.clone()
    tok = t.tokens.clone()
    sc = t.scores.clone()
    num = t.num_nodes.clone()
    for b in range(B):
        n = int(num[b])
        cap = max(0, min(budget if isinstance(budget, int) else int(budget[b]), N))
        want = count if isinstance(count, int) else int(count[b])
        if n == 0 or n > cap:
            continue
        parents = {int(par[b, i]) for i in range(1, n)}
        leaves = [i for i in range(n) if i not in parents]
        a = max(leaves, key=lambda i: (float(sc[b, i]), -i))
        for _ in range(max(0, want)):
            if n >= cap:
                break
            prev = int(tok[b, a])
            nxt = int(tab[prev, 0]) if 0 <= prev < V else -1
            if not 0 <= nxt < V:
                break
            par[b, n], tok[b, n], sc[b, n] = a, nxt, 0.0
            a, n = n, n + 1
        num[b] = n
    dev = tree.device
    return Tree.from_parents(par.to(dev), num.to(dev), tok.to(dev), sc.to(dev))


def prune(tree: Tree, keep: torch.Tensor | int) -> Tree:
    """Keep the root and the first ``keep[b]`` draft nodes of each request (rank order: the top
    ``keep`` by score, ancestor-closed). ``keep >= NO_PRUNE`` keeps everything."""
    B, N = tree.parents.shape
    t = tree.to("cpu")
    num = t.num_nodes.clone()
    for b in range(B):
        kb = keep if isinstance(keep, int) else int(keep[b])
        if num[b] > 0:
            num[b] = min(int(num[b]), kb + 1)
    out = Tree.from_parents(t.parents, num, t.tokens, t.scores)
    return out.to(tree.device)


def prune_checkpoint(
    keep: torch.Tensor,
    best_score: torch.Tensor,
    index: int,
    keeps: tuple[int, ...],
    thresholds: tuple[float, ...],
) -> torch.Tensor:
    """Checkpoint ``index``: a request not yet pruned whose best path score is under the
    threshold is marked to keep ``keeps[index]`` draft nodes. Updates ``keep`` in place; returns
    ``stop`` [B] bool: the request has been marked (single-request decoding stops drafting)."""
    for b in range(keep.shape[0]):
        if int(keep[b]) >= NO_PRUNE and float(best_score[b]) < thresholds[index]:
            keep[b] = keeps[index]
    return keep < NO_PRUNE
