"""Shared hypothesis strategies: trees in rank order, paged KV caches, logits with ties.

Sizes that become Triton constexprs are drawn from powers of two so that hypothesis does not
force a recompile on every example.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

import treeops

TREE_KINDS = ("random", "chain", "star", "binary", "single", "inactive")


def parents_of(kind: str, n: int, rng: random.Random) -> list[int]:
    """Parent list of one request's tree of ``n`` nodes, in rank order (``parent[i] < i``)."""
    if kind == "inactive" or n == 0:
        return []
    if kind == "single" or n == 1:
        return [-1]
    if kind == "chain":
        return [-1] + list(range(n - 1))
    if kind == "star":
        return [-1] + [0] * (n - 1)
    if kind == "binary":
        return [-1] + [(i - 1) // 2 for i in range(1, n)]
    # random: biased towards recent nodes so that deep trees appear as well as bushy ones
    out = [-1]
    for i in range(1, n):
        out.append(rng.randrange(i) if rng.random() < 0.5 else rng.randrange(max(0, i - 3), i))
    return out


def tokens_for(parents: list[int], vocab: int, rng: random.Random) -> list[int]:
    """Random tokens, distinct among siblings (needs vocab >= the widest fan-out)."""
    toks: list[int] = []
    used: dict[int, set[int]] = {}
    for _i, p in enumerate(parents):
        s = used.setdefault(p, set())
        t = rng.randrange(vocab)
        while t in s:
            t = rng.randrange(vocab)
        s.add(t)
        toks.append(t)
    return toks


def scores_for(parents: list[int], rng: random.Random, ties: bool = False) -> list[float]:
    """Rank-order scores: root 1, then non-increasing with index (dyadic values when ``ties``,
    so equal scores appear)."""
    n = len(parents)
    if n == 0:
        return []
    if ties:
        vals = sorted((rng.randrange(1, 9) / 16 for _ in range(n - 1)), reverse=True)
    else:
        vals = sorted((rng.random() for _ in range(n - 1)), reverse=True)
    return [1.0] + vals


@dataclass
class TreeCase:
    tree: treeops.Tree
    parents: list[list[int]]
    vocab: int


def make_tree(
    parents: list[list[int]], capacity: int, vocab: int, rng: random.Random, ties: bool = False
) -> treeops.Tree:
    B = len(parents)
    par = torch.full((B, capacity), -1, dtype=torch.int32)
    tok = torch.zeros(B, capacity, dtype=torch.int64)
    sc = torch.zeros(B, capacity, dtype=torch.float32)
    for b, p in enumerate(parents):
        n = len(p)
        if n:
            par[b, :n] = torch.tensor(p, dtype=torch.int32)
            tok[b, :n] = torch.tensor(tokens_for(p, vocab, rng))
            sc[b, :n] = torch.tensor(scores_for(p, rng, ties))
    nn = torch.tensor([len(p) for p in parents], dtype=torch.int32)
    return treeops.Tree.from_parents(par, nn, tok, sc)


@st.composite
def trees(
    draw,
    max_batch: int = 4,
    capacities=(1, 4, 8, 16, 32, 64),
    vocab: int = 64,
    kinds=TREE_KINDS,
    allow_inactive: bool = True,
    ties: bool | None = None,
) -> TreeCase:
    """A ragged batch of trees: each row its own kind and size; capacity a power of two."""
    N = draw(st.sampled_from(capacities))
    B = draw(st.integers(1, max_batch))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = random.Random(seed)
    use_ties = draw(st.booleans()) if ties is None else ties
    rows = []
    for _ in range(B):
        kind = draw(st.sampled_from([k for k in kinds if allow_inactive or k != "inactive"]))
        n = 0 if kind == "inactive" else (1 if kind == "single" else draw(st.integers(1, N)))
        rows.append(parents_of(kind, n, rng))
    if not any(rows):
        rows[0] = [-1]
    return TreeCase(make_tree(rows, N, max(vocab, N), rng, use_ties), rows, max(vocab, N))


@dataclass
class PagedKV:
    k_cache: torch.Tensor  # [num_pages, page_size, H_kv, D] (possibly strided views)
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [B, max_pages] int32
    page_size: int


def paged_kv(
    lengths: list[int],
    page_size: int | None,
    h_kv: int,
    d: int,
    dtype: torch.dtype,
    rng: random.Random,
    strided: bool = False,
    device: str = "cpu",
) -> PagedKV:
    """Random K/V caches covering ``lengths[b]`` slots per request, pages shuffled.

    ``page_size=None`` gives one page per request (a contiguous cache). ``strided`` stores K and
    V interleaved in one buffer, so both are non-contiguous views.
    """
    B = len(lengths)
    if page_size is None:
        page_size = max(1, max(lengths))
    pages_per = [max(1, -(-L // page_size)) for L in lengths]
    max_pages = max(pages_per)
    total = sum(pages_per) + 1  # one spare page that no request owns
    order = list(range(total))
    rng.shuffle(order)
    bt = torch.zeros(B, max_pages, dtype=torch.int32)
    k = 0
    for b in range(B):
        for p in range(pages_per[b]):
            bt[b, p] = order[k]
            k += 1
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    if strided:
        buf = torch.randn(total, page_size, h_kv, 2, d, generator=g).to(dtype)
        kc, vc = buf[:, :, :, 0], buf[:, :, :, 1]
    else:
        kc = torch.randn(total, page_size, h_kv, d, generator=g).to(dtype)
        vc = torch.randn(total, page_size, h_kv, d, generator=g).to(dtype)
    return PagedKV(kc.to(device), vc.to(device), bt.to(device), page_size)


def logits_like(
    shape: tuple[int, ...],
    rng: random.Random,
    ties: bool = False,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Random logits; with ``ties`` drawn from a handful of values so equal maxima are common."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    if ties:
        x = torch.randint(0, 4, shape, generator=g).to(torch.float32)
    else:
        x = torch.randn(shape, generator=g) * 3
    return x.to(dtype)
