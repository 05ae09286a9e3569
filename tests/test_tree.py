"""The Tree: from_parents against an independent walk, validate's messages, drawing, positions."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import treeops
from helpers import tree_from_lists
from strategies import make_tree, parents_of, trees


def brute_ancestors(par: list[int], i: int) -> set[int]:
    out = set()
    while i >= 0:
        out.add(i)
        i = par[i]
    return out


@given(trees(max_batch=4, capacities=(1, 4, 31, 32, 33, 64, 100)))
def test_from_parents_matches_brute_force(case):
    t = case.tree
    t.validate()
    B, N = t.parents.shape
    assert t.anc.shape == (B, N, (N + 31) // 32)
    mask = t.ancestor_mask()
    for b, par in enumerate(case.parents):
        n = len(par)
        assert int(t.num_nodes[b]) == n
        for i in range(N):
            want = brute_ancestors(par, i) if i < n else set()
            got = {j for j in range(N) if mask[b, i, j]}
            assert got == want
            want_depth = len(want) - 1 if i < n else 0
            assert int(t.depth[b, i]) == want_depth
            kids = [j for j in range(1, n) if par[j] == i] if i < n else []
            assert int(t.first_child[b, i]) == (kids[0] if kids else -1)
            for a, c in zip(kids, kids[1:] + [-1]):
                assert int(t.next_sibling[b, a]) == c
        assert (t.parents[b, n:] == -1).all() and (t.tokens[b, n:] == 0).all()


def test_bit_31_is_the_sign_bit():
    t = tree_from_lists([[-1] + list(range(40))])  # a chain of 41 nodes crosses word 0's bit 31
    assert int(t.anc[0, 31, 0]) == -1  # all 32 bits of word 0 set
    assert int(t.anc[0, 31, 1]) == 0
    assert int(t.anc[0, 40, 1]) == (1 << 9) - 1
    t.validate()


def test_positions_and_padding_rows():
    t = tree_from_lists([[-1, 0, 1, 0], [], [-1]], capacity=5)
    pos = t.positions(torch.tensor([10, 0, 3], dtype=torch.int32))
    assert pos.dtype == torch.int64
    assert pos.tolist() == [[10, 11, 12, 11, 10], [0, 0, 0, 0, 0], [3, 3, 3, 3, 3]]
    assert t.num_nodes.tolist() == [4, 0, 1]


def test_from_parents_ignores_garbage_in_padding():
    par = torch.tensor([[-1, 0, 7, 99]], dtype=torch.int32)
    t = treeops.Tree.from_parents(par, torch.tensor([2], dtype=torch.int32))
    t.validate()
    assert t.parents.tolist() == [[-1, 0, -1, -1]]


def test_empty_and_to_and_clone():
    t = treeops.Tree.empty(3, 8)
    t.validate()
    assert t.to("cpu").num_nodes.tolist() == [0, 0, 0]
    c = t.clone()
    c.num_nodes[0] = 1
    assert int(t.num_nodes[0]) == 0


def test_draw_shows_structure():
    t = tree_from_lists([[-1, 0, 0, 1]], tokens=[[5, 6, 7, 8]], scores=[[1, 0.5, 0.25, 0.125]])
    text = t.draw(0, vocab=[f"t{i}" for i in range(10)])
    assert text.splitlines() == [
        "request 0: 4 nodes",
        "[0] 't5'  score=1",
        "├─ [1] 't6'  score=0.5",
        "│  └─ [3] 't8'  score=0.125",
        "└─ [2] 't7'  score=0.25",
    ]
    assert treeops.Tree.empty(1, 4).draw(0) == "request 0: inactive"


def _good():
    return tree_from_lists(
        [[-1, 0, 0, 1]], tokens=[[5, 6, 7, 8]], scores=[[1, 0.5, 0.25, 0.125]], capacity=6
    )


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda t: t.num_nodes.fill_(7), r"num_nodes\[0\] = 7 not in \[0, 6\]"),
        (lambda t: t.parents[0].__setitem__(0, 0), r"root parent is 0"),
        (lambda t: t.parents[0].__setitem__(2, 2), r"parents\[2\] = 2, expected 0 <= p < 2"),
        (lambda t: t.depth[0].__setitem__(3, 1), r"depth\[3\] = 1, expected 2"),
        (lambda t: t.anc[0, 2].__setitem__(0, 7), r"anc\[2\] bit 1"),
        (lambda t: t.first_child[0].__setitem__(0, 2), r"first_child\[0\] = 2, expected 1"),
        (lambda t: t.next_sibling[0].__setitem__(1, -1), r"next_sibling\[1\] = -1, expected 2"),
        (lambda t: t.tokens[0].__setitem__(2, 6), r"siblings 1 and 2 both carry token 6"),
        (lambda t: t.scores[0].__setitem__(3, 0.75), r"scores\[3\] = 0.75 exceeds scores\[2\]"),
        (lambda t: t.scores[0].__setitem__(0, 0.5), r"scores\[0\] = 0.5, expected 1 \(the root\)"),
        (lambda t: t.scores[0].__setitem__(1, float("nan")), r"scores\[1\] = nan"),
        (lambda t: t.scores[0].__setitem__(1, -0.5), r"scores\[1\] = -0.5"),
        (lambda t: t.tokens[0].__setitem__(5, 3), r"padding of tokens at nodes >= 4"),
        (lambda t: t.anc[0, 4].__setitem__(0, 1), r"padding of anc at nodes >= 4"),
    ],
)
def test_validate_names_each_violation(corrupt, message):
    t = _good()
    t.validate()
    corrupt(t)
    with pytest.raises(ValueError, match=message):
        t.validate()


def test_field_checks():
    t = _good()
    t.parents = t.parents.long()
    with pytest.raises(
        ValueError, match=r"Invalid dtype of tree.parents: expected torch.int32, got torch.int64"
    ):
        t.validate()
    t = _good()
    t.depth = t.depth[:, :3]
    with pytest.raises(
        ValueError, match=r"Invalid shape of tree.depth: expected \[1, 6\], got \[1, 3\]"
    ):
        t.check_fields()
    with pytest.raises(ValueError, match="Invalid dtype of parents"):
        treeops.Tree.from_parents(torch.tensor([[-1, 0]]), torch.tensor([2], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"Invalid shape of num_nodes: expected \[1\], got \[2\]"):
        treeops.Tree.from_parents(
            torch.tensor([[-1, 0]], dtype=torch.int32), torch.tensor([2, 2], dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="Invalid dtype of seq_lens"):
        _good().positions(torch.tensor([1.0]))


@given(
    st.sampled_from(["chain", "star", "binary", "random"]), st.integers(1, 70), st.integers(0, 99)
)
def test_named_shapes_validate(kind, n, seed):
    rng = random.Random(seed)
    t = make_tree([parents_of(kind, n, rng)], max(n, 1), 128, rng)
    t.validate()
    if kind == "chain":
        assert t.depth[0, :n].tolist() == list(range(n))
    if kind == "star":
        assert t.depth[0, 1:n].eq(1).all()


def _from_parents_loop(parents: torch.Tensor, num_nodes: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The former ``Tree.from_parents`` algorithm (one round of small tensor ops per node, in
    index order): parents, depth and anc, the fields pointer doubling now computes."""
    B, N = parents.shape
    W = (N + 31) // 32
    idx = torch.arange(N, dtype=torch.int32)
    valid = idx[None, :] < num_nodes[:, None]
    par = torch.where(valid, parents, torch.full_like(parents, -1))
    par[:, 0] = -1
    depth = torch.zeros(B, N, dtype=torch.int32)
    anc = torch.zeros(B, N, W, dtype=torch.int32)
    rows = torch.arange(B)
    for i in range(N):
        p = par[:, i].clamp(min=0).long()
        has_parent = valid[:, i] & (par[:, i] >= 0)
        depth[:, i] = torch.where(has_parent, depth[rows, p] + 1, 0)
        row = torch.where(has_parent[:, None], anc[rows, p], 0)
        row[:, i // 32] |= treeops.tree.bit_value(i)
        anc[:, i] = torch.where(valid[:, i, None], row, 0)
    return par, depth, anc


@given(
    st.integers(1, 128),
    st.lists(st.tuples(st.sampled_from(["random", "chain", "star", "binary"]), st.floats(0, 1)),
             min_size=1, max_size=4),
    st.integers(0, 2**31 - 1),
)  # fmt: skip
def test_from_parents_equals_loop_algorithm(N, rows, seed):
    """Pointer doubling gives exactly the former per-node loop's fields, incl. inactive rows,
    num_nodes < N, N not a multiple of 32 and garbage parents in the padding."""
    rng = random.Random(seed)
    B = len(rows)
    par = torch.tensor([[rng.randrange(-3, 2 * N) for _ in range(N)] for _ in range(B)])
    par = par.to(torch.int32)
    sizes = []
    for b, (kind, frac) in enumerate(rows):
        n = round(frac * N)
        p = parents_of(kind, n, rng)
        par[b, :n] = torch.tensor(p, dtype=torch.int32)
        sizes.append(n)
    num = torch.tensor(sizes, dtype=torch.int32)
    t = treeops.Tree.from_parents(par, num)
    want_par, want_depth, want_anc = _from_parents_loop(par, num)
    for name, got, want in [
        ("parents", t.parents, want_par), ("depth", t.depth, want_depth), ("anc", t.anc, want_anc)
    ]:  # fmt: skip
        assert got.dtype == want.dtype == torch.int32, name
        assert torch.equal(got, want), name
    assert int(t.depth.max()) <= N - 1  # (chains of N nodes need every round)


def test_fields_and_tensors_follow_the_declaration_order():
    t = treeops.Tree.from_parents(torch.tensor([[-1, 0, 0]], dtype=torch.int32),
                                  torch.tensor([3], dtype=torch.int32),
                                  torch.tensor([[4, 5, 6]]))  # fmt: skip
    assert treeops.Tree.FIELDS == tuple(f.name for f in dataclasses.fields(treeops.Tree))
    assert all(a is getattr(t, f) for a, f in zip(t.tensors(), treeops.Tree.FIELDS, strict=True))
    rebuilt = treeops.Tree(*t.tensors())
    assert all(a is b for a, b in zip(rebuilt.tensors(), t.tensors(), strict=True))
