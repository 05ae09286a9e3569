"""Graft's shared types: the rank template retrieval follows and the retrieved paths it yields.

Shared by the public Graft ops, their kernels' callers and the reference.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ._checks import check_positive_int, check_same_device, check_tensor

__all__ = ["DEFAULT_RANK_PROBS", "MAX_TEMPLATE", "NO_PRUNE", "RankTemplate", "Retrieved"]

NO_PRUNE = 1 << 30
"""``keep`` value of a request that no checkpoint has marked (prune keeps everything)."""

MAX_TEMPLATE = 256
"""Largest template (nodes, root included) the fused kernel takes: it holds [T, T] tiles."""

DEFAULT_RANK_PROBS = (0.6, 0.12, 0.06, 0.035, 0.02, 0.015, 0.01, 0.008)
"""Model of how often the target's rank-r successor is the right next token (r = 0..7), used to
choose the default template; rank-0 dominates, as the target's top-1 does in real text."""


def _check_probs(probs: Sequence[float]) -> None:
    if not probs or any(not 0.0 < p < 1.0 for p in probs):
        raise ValueError(f"Invalid value of probs: expected numbers in (0, 1), got {probs!r}")


class RankTemplate:
    """A static rank-path tree: node j (j >= 1) stands for "the ``ranks[j]``-th successor of the
    token at node ``parents[j]``"; node 0 is the root (the tree's root token).

    Fields (CPU tensors; ``tensors(device)`` caches device copies):
        parents: [T] int32, -1 for the root, ``0 <= parents[j] < j``.
        ranks: [T] int32, -1 for the root, distinct among siblings.
        depth: [T] int32, non-decreasing (breadth-first order).
    ``size`` = T, ``max_depth`` = depth of the deepest node, ``max_rank`` = largest rank,
    ``max_width`` = the most nodes at one depth.

    The default (``RankTemplate.default()``, 80 nodes over depths 0..9) is
    ``from_rank_probs(DEFAULT_RANK_PROBS, size=80, max_depth=9)``: the 79 rank paths of highest
    probability when the target's rank-r successor is right with probability ``probs[r]``
    independently at every step. For such a model it is the static tree of T nodes with the
    largest expected accepted length (the expected length is the sum of the path probabilities,
    and a best-first expansion takes the T largest, which are ancestor-closed because each
    probability is < 1). It is unbalanced as Token Recycling's hand-made tree is: the rank-0
    chain reaches depth 9, rank 1 reaches 6 levels, ranks >= 4 sit near the top only. Fit
    ``probs`` to measured rank acceptance of a model pair and rebuild for a better tree;
    ``balanced`` and ``chain`` give the usual alternatives for comparison.

    Measured (``python bench/bench_graft.py --template-coverage``: a byte-level table learnt
    from 3.2 MB of CPython's standard library, retrieval walked along the true continuation of
    4000 held-out positions), mean accepted length of retrieval alone: default 2.14,
    same-size template from flatter probabilities 1.81, rank-0 chain of 9 1.45, balanced 8x2
    (73 nodes) 1.32, balanced 4x3 (85 nodes) 1.26. With the example decoder's tiny trained pair
    (``python bench/template_acceptance.py``, README) the default is best on neither measure: on
    its BPE tokens balanced 8x2 and the flatter template cover more (0.68 and 0.66 tokens against
    0.61), and in decoding, where a pruned request has room for a few grafted nodes filled in
    template order, the rank-0 chain yields the most tokens per step. No alternative wins both.
    """

    def __init__(self, parents: Sequence[int], ranks: Sequence[int]):
        par = [int(p) for p in parents]
        rk = [int(r) for r in ranks]
        T = len(par)
        if not 1 <= T <= MAX_TEMPLATE:
            raise ValueError(f"Invalid template: expected 1 to {MAX_TEMPLATE} nodes, got {T}")
        if len(rk) != T:
            raise ValueError(f"Invalid template: {T} parents but {len(rk)} ranks")
        if par[0] != -1:
            raise ValueError(f"Invalid template: parents[0] = {par[0]}, expected -1")
        depth = [0] * T
        seen: set[tuple[int, int]] = set()
        for j in range(1, T):
            if not 0 <= par[j] < j:
                raise ValueError(
                    f"Invalid template: parents[{j}] = {par[j]}, expected 0 <= p < {j}"
                )
            if rk[j] < 0:
                raise ValueError(f"Invalid template: ranks[{j}] = {rk[j]}, expected >= 0")
            if (par[j], rk[j]) in seen:
                raise ValueError(
                    f"Invalid template: node {j} repeats rank {rk[j]} among the children of "
                    f"{par[j]}"
                )
            seen.add((par[j], rk[j]))
            depth[j] = depth[par[j]] + 1
            if depth[j] < depth[j - 1]:
                raise ValueError(
                    f"Invalid template: node {j} at depth {depth[j]} after a node at depth "
                    f"{depth[j - 1]}, expected breadth-first order"
                )
        rk[0] = -1
        self.parents = torch.tensor(par, dtype=torch.int32)
        self.ranks = torch.tensor(rk, dtype=torch.int32)
        self.depth = torch.tensor(depth, dtype=torch.int32)
        self.size = T
        self.max_depth = max(depth)
        self.max_rank = max(rk)
        self.max_width = max(depth.count(d) for d in range(self.max_depth + 1))
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def tensors(
        self, device: torch.device | str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(parents, ranks, depth)`` on ``device`` (copied once, then cached)."""
        got = self._on.get(device)  # a torch.device as the ops pass it: no conversion
        if got is not None:
            return got
        dev = torch.device(device)
        if dev not in self._on:
            self._on[dev] = (self.parents.to(dev), self.ranks.to(dev), self.depth.to(dev))
        return self._on[dev]

    def __repr__(self) -> str:
        widths = torch.bincount(self.depth).tolist()
        return f"RankTemplate(size={self.size}, max_depth={self.max_depth}, widths={widths})"

    # -------------------------------------------------------------- constructors
    @staticmethod
    def from_paths(paths: Sequence[Sequence[int]]) -> RankTemplate:
        """From rank paths (tuples of ranks from the root; ``()`` is the root, added if absent).
        Every prefix of a path must be present; nodes are put in breadth-first order, siblings
        by rank."""
        ps = {tuple(int(r) for r in p) for p in paths} | {()}
        for p in ps:
            if p and p[:-1] not in ps:
                raise ValueError(f"Invalid template: path {p} given without its prefix {p[:-1]}")
        order = sorted(ps, key=lambda p: (len(p), p))
        # breadth-first: children of earlier nodes first, then by rank
        index: dict[tuple[int, ...], int] = {(): 0}
        out: list[tuple[int, ...]] = [()]
        for d in range(1, max(len(p) for p in order) + 1):
            level = [p for p in order if len(p) == d]
            level.sort(key=lambda p: (index[p[:-1]], p[-1]))
            for p in level:
                index[p] = len(out)
                out.append(p)
        return RankTemplate(
            [-1] + [index[p[:-1]] for p in out[1:]], [-1] + [p[-1] for p in out[1:]]
        )

    @staticmethod
    def from_rank_probs(probs: Sequence[float], size: int = 80, max_depth: int = 9) -> RankTemplate:
        """The ``size`` most probable rank paths (root included) of depth <= ``max_depth`` when
        rank r is right with probability ``probs[r]`` (ties: shorter, then lexicographic)."""
        check_positive_int("size", size)
        _check_probs(probs)
        heap: list[tuple[float, int, tuple[int, ...]]] = [(-1.0, 0, ())]
        paths: list[tuple[int, ...]] = []
        while heap and len(paths) < size:
            negp, _, path = heapq.heappop(heap)
            paths.append(path)
            if len(path) < max_depth:
                for r, p in enumerate(probs):
                    heapq.heappush(heap, (negp * p, len(path) + 1, path + (r,)))
        return RankTemplate.from_paths(paths)

    @staticmethod
    def default() -> RankTemplate:
        """80 nodes over depths 0..9 (see the class docstring)."""
        return RankTemplate.from_rank_probs(DEFAULT_RANK_PROBS, size=80, max_depth=9)

    @staticmethod
    def balanced(width: int, depth: int) -> RankTemplate:
        """Every node has ranks 0..width-1 as children, down to ``depth``."""
        check_positive_int("width", width)
        paths: list[tuple[int, ...]] = [()]
        level: list[tuple[int, ...]] = [()]
        for _ in range(depth):
            level = [p + (r,) for p in level for r in range(width)]
            paths += level
        return RankTemplate.from_paths(paths)

    def most_probable(self, n: int, probs: Sequence[float] = DEFAULT_RANK_PROBS) -> RankTemplate:
        """The root and this template's ``n`` - 1 most probable other nodes (at most ``size``),
        when rank r is right with probability ``probs[r]`` (ranks past the list: its last value)
        independently at every step; ties: shorter, then lexicographic. A child is less probable
        than its parent, so the nodes form a subtree: the template a budget of ``n`` nodes should
        fill (for the default, the rank-0 chain first: 0.6, 0.36, 0.22, 0.13, then rank 1)."""
        check_positive_int("n", n)
        _check_probs(probs)
        par, rk = self.parents.tolist(), self.ranks.tolist()
        paths: list[tuple[int, ...]] = [()]
        prob = [1.0]
        for j in range(1, self.size):
            paths.append(paths[par[j]] + (rk[j],))
            prob.append(prob[par[j]] * probs[min(rk[j], len(probs) - 1)])
        best = sorted(range(self.size), key=lambda j: (-prob[j], len(paths[j]), paths[j]))[:n]
        return RankTemplate.from_paths([paths[j] for j in best])

    @staticmethod
    def chain(depth: int) -> RankTemplate:
        """The rank-0 chain of ``depth`` nodes below the root (greedy continuation)."""
        return RankTemplate.from_paths([(0,) * d for d in range(depth + 1)])


@dataclass
class Retrieved:
    """Retrieved paths of a batch, packed in template (breadth-first) order, capacity T.

    Nodes are in breadth-first order (depth never decreases), the order graft_merge inserts in.

    Fields:
        tokens: [B, T] int64, index 0 = the root token; padding 0.
        parents: [B, T] int32, index into the same row (``parents[b, j] < j``), -1 for the root
            and padding.
        depth: [B, T] int32, root 0; padding 0.
        num_nodes: [B] int32, retrieved nodes per request, root included (>= 1).
        max_depth: host int, an upper bound of ``depth`` (the template's), which bounds the
            merge's breadth-first loop.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    num_nodes: torch.Tensor
    max_depth: int = field(default=0)

    def to(self, device: torch.device | str) -> Retrieved:
        return Retrieved(
            self.tokens.to(device),
            self.parents.to(device),
            self.depth.to(device),
            self.num_nodes.to(device),
            self.max_depth,
        )

    def check_fields(self) -> None:
        """Shapes, dtypes, strides (contiguous: the kernel indexes them densely) and devices."""
        sizes: dict[str, int] = {}
        check_tensor(
            "retrieved.tokens",
            self.tokens,
            shape=("B", "T"),
            dtype=torch.int64,
            sizes=sizes,
            contiguous=True,
        )
        check_tensor(
            "retrieved.parents",
            self.parents,
            shape=("B", "T"),
            dtype=torch.int32,
            sizes=sizes,
            contiguous=True,
        )
        check_tensor(
            "retrieved.depth",
            self.depth,
            shape=("B", "T"),
            dtype=torch.int32,
            sizes=sizes,
            contiguous=True,
        )
        check_tensor(
            "retrieved.num_nodes",
            self.num_nodes,
            shape=("B",),
            dtype=torch.int32,
            sizes=sizes,
            contiguous=True,
        )
        if sizes["T"] > MAX_TEMPLATE:
            raise ValueError(
                f"Invalid shape of retrieved.tokens: expected at most {MAX_TEMPLATE} columns, "
                f"got {sizes['T']}"
            )
        if not isinstance(self.max_depth, int) or self.max_depth < 0:
            raise ValueError(
                "Invalid value of retrieved.max_depth: expected an int >= 0, got "
                f"{self.max_depth!r}"
            )
        check_same_device(
            **{
                "retrieved.tokens": self.tokens,
                "retrieved.parents": self.parents,
                "retrieved.depth": self.depth,
                "retrieved.num_nodes": self.num_nodes,
            }
        )

    def validate(self) -> None:
        """Host-side: ``1 <= num_nodes <= T``, parents point backwards, depth consistent, at most
        ``max_depth`` and non-decreasing (breadth-first order)."""
        self.check_fields()
        r = self.to("cpu")
        B, T = r.tokens.shape
        for b in range(B):
            n = int(r.num_nodes[b])
            if not 1 <= n <= T:
                raise ValueError(f"Invalid retrieved: num_nodes[{b}] = {n} not in [1, {T}]")
            for j in range(1, n):
                p = int(r.parents[b, j])
                if not 0 <= p < j:
                    raise ValueError(
                        f"Invalid retrieved: request {b}: parents[{j}] = {p}, expected 0 <= p < {j}"
                    )
                d = int(r.depth[b, j])
                if d != int(r.depth[b, p]) + 1 or d > self.max_depth:
                    raise ValueError(
                        f"Invalid retrieved: request {b}: depth[{j}] = {d}, expected "
                        f"{int(r.depth[b, p]) + 1} <= max_depth {self.max_depth}"
                    )
                if d < int(r.depth[b, j - 1]):
                    raise ValueError(
                        f"Invalid retrieved: request {b}: node {j} at depth {d} after a node at "
                        f"depth {int(r.depth[b, j - 1])}, expected breadth-first order"
                    )
            if n and int(r.depth[b, 0]) != 0:
                raise ValueError(f"Invalid retrieved: request {b}: depth[0] must be 0")
