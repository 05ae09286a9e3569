"""Graft's pruning kernels (``treeops.kernels.prune``, run by the interpreter) against the
references: ``prune`` and ``PruneCheckpoints.check``, integer outputs exact; the public functions
through the CUDA backends (the direct path forced open to CPU tensors); strides and host syncs.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import treeops
from strategies import TREE_KINDS, make_tree, parents_of
from treeops import NO_PRUNE, PruneCheckpoints, _library, prune
from treeops.kernels import prune as kp
from treeops.reference import graft as ref
from treeops.testing import NoHostSync

FIELDS = treeops.Tree.FIELDS


@st.composite
def ragged_trees(draw, capacities=(1, 2, 5, 8, 33, 40, 64, 70)):
    """A ragged batch at any capacity (not only powers of two: ``anc`` rows of 1-3 words)."""
    N = draw(st.sampled_from(capacities))
    B = draw(st.integers(1, 4))
    rng = random.Random(draw(st.integers(0, 2**31 - 1)))
    rows = []
    for _ in range(B):
        kind = draw(st.sampled_from(TREE_KINDS))
        n = 0 if kind == "inactive" else (1 if kind == "single" else draw(st.integers(1, N)))
        rows.append(parents_of(kind, n, rng))
    return make_tree(rows, N, max(64, N), rng, ties=draw(st.booleans()))


def poisoned(tree: treeops.Tree) -> treeops.Tree:
    """Output buffers full of garbage: the kernel must write every element."""
    out = []
    for t in tree.tensors():
        o = torch.empty_like(t)
        o.fill_(float("nan") if t.is_floating_point() else 77)
        out.append(o)
    return treeops.Tree(*out)


def run_kernel(tree: treeops.Tree, keep) -> treeops.Tree:
    out = poisoned(tree)
    if isinstance(keep, torch.Tensor):
        kp.prune(tree.tensors(), keep, 0, out.tensors())
    else:
        kp.prune(tree.tensors(), None, keep, out.tensors())
    return out


def assert_same(got: treeops.Tree, want: treeops.Tree) -> None:
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(want, f)), f


KEEPS = [0, 1, 2, 3, 8, 39, 40, 63, 64, 1000, NO_PRUNE, 2**31 - 1]


@given(ragged_trees(), st.integers(0, 2**31 - 1), st.sampled_from(["int", "tensor"]))
def test_prune_kernel_matches_reference(tree, seed, kind):
    rng = random.Random(seed)
    B = tree.batch_size
    if kind == "tensor":
        keep = torch.tensor([rng.choice(KEEPS) for _ in range(B)], dtype=torch.int32)
    else:
        keep = rng.choice(KEEPS + [2**40])
    want = ref.prune(tree, keep)
    got = run_kernel(tree, keep)
    assert_same(got, want)
    got.validate()


@given(ragged_trees(capacities=(5, 33, 70)), st.integers(0, 2**31 - 1))
def test_prune_kernel_tiles(tree, seed):
    """Trees larger than one tile: the node and ``anc`` loops run several tiles."""
    rng = random.Random(seed)
    keep = torch.tensor([rng.choice(KEEPS) for _ in range(tree.batch_size)], dtype=torch.int32)
    saved = kp.MAX_BLOCK
    kp.MAX_BLOCK = rng.choice([2, 4, 16])
    try:
        got = run_kernel(tree, keep)
    finally:
        kp.MAX_BLOCK = saved
    assert_same(got, ref.prune(tree, keep))


def test_prune_kernel_reads_only_the_kept_prefix():
    """Slots past the kept prefix are padding in the output whatever the input holds there (the
    kernel does not read them: garbage in the input's padding changes nothing)."""
    rng = random.Random(1)
    tree = make_tree([parents_of("random", 20, rng), parents_of("chain", 7, rng)], 24, 64, rng)
    dirty = tree.clone()
    for f in ("tokens", "parents", "depth", "anc", "first_child", "next_sibling", "scores"):
        t = getattr(dirty, f)
        t[0, 6:] = 5
        t[1, 7:] = 5
    keep = torch.tensor([5, NO_PRUNE], dtype=torch.int32)
    assert_same(run_kernel(dirty, keep), ref.prune(tree, keep))


@pytest.fixture
def cuda_backends(monkeypatch):
    """The public functions on CPU tensors through the ops' CUDA backends (the kernels, run by
    the interpreter) instead of the CPU references."""
    monkeypatch.setattr(_library, "DIRECT", 2)


@given(ragged_trees(capacities=(1, 8, 40)), st.integers(0, 2**31 - 1))
def test_public_prune_through_the_kernel(tree, seed):
    rng = random.Random(seed)
    keep_t = torch.tensor([rng.choice(KEEPS) for _ in range(tree.batch_size)], dtype=torch.int32)
    keep_i = rng.choice(KEEPS)
    want_t, want_i = prune(tree, keep_t), prune(tree, keep_i)  # the CPU reference (dispatcher)
    saved = _library.DIRECT
    _library.DIRECT = 2
    try:
        assert_same(prune(tree, keep_t), want_t)
        assert_same(prune(tree, keep_i), want_i)
    finally:
        _library.DIRECT = saved


@given(ragged_trees(capacities=(1, 8, 40)), st.integers(0, 2**31 - 1), st.booleans())
def test_public_prune_into_out(tree, seed, kernel):
    """``out=``: the same tree as a fresh result, written into the caller's buffers (full of
    garbage before: every element is written) and returned as that object; through the CPU
    reference and through the kernel."""
    rng = random.Random(seed)
    keep = rng.choice([torch.tensor([rng.choice(KEEPS) for _ in range(tree.batch_size)],
                                    dtype=torch.int32), rng.choice(KEEPS)])  # fmt: skip
    want = ref.prune(tree, keep)
    saved = _library.DIRECT
    if kernel:
        _library.DIRECT = 2
    try:
        for _ in range(2):  # the second call of a signature is the memoised (replayed) one
            out = poisoned(tree)
            assert prune(tree, keep, out=out) is out
            assert_same(out, want)
    finally:
        _library.DIRECT = saved


def test_prune_out_is_checked():
    rng = random.Random(4)
    tree = make_tree([parents_of("random", 6, rng)] * 2, 8, 64, rng)
    with pytest.raises(ValueError, match="Invalid out: it shares memory with tree"):
        prune(tree, 3, out=tree)
    with pytest.raises(ValueError, match=r"Invalid shape of out: expected a tree of shape \[2, 8"):
        prune(tree, 3, out=treeops.Tree.empty(2, 4))
    out = treeops.Tree.empty(2, 8)
    prune(tree, 3, out=out)  # a signature whose checks passed: aliasing is still refused
    with pytest.raises(ValueError, match="Invalid out: it shares memory with tree"):
        prune(tree, 3, out=treeops.Tree(*tree.tensors()))


@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 3, 31, 32, 33, 100]))
def test_checkpoint_kernel_matches_reference(seed, B):
    rng = random.Random(seed)
    ck = PruneCheckpoints(thresholds=(0.5, 0.25, 0.125))
    k_ref, k_got = ck.start(B), ck.start(B)
    k_ref[: B // 3] = 8  # some requests marked before
    k_got.copy_(k_ref)
    saved = kp.MAX_BLOCK
    kp.MAX_BLOCK = rng.choice([32, 1024])  # several programs or one
    try:
        for step in range(7):
            best = torch.tensor([rng.choice([0.0, 0.125, 0.25, 0.5, 1.0]) for _ in range(B)])
            stop = torch.ones(B, dtype=torch.bool) if step % 2 else torch.zeros(B, dtype=torch.bool)
            if step in ck.steps:
                c = ck.steps.index(step)
                want = ref.prune_checkpoint(k_ref, best, c, ck.keeps, ck.thresholds)
                kp.checkpoint(k_got, best, ck.keeps[c], float(ck.thresholds[c]), stop)
            else:
                want = k_ref < NO_PRUNE
                kp.checkpoint(k_got, best, 0, float("-inf"), stop)
            assert torch.equal(k_got, k_ref) and torch.equal(stop, want)
    finally:
        kp.MAX_BLOCK = saved


def test_public_check_through_the_kernel(cuda_backends):
    ck = PruneCheckpoints(steps=(0, 1, 5), keeps=(8, 24, 40), thresholds=(0.3, 0.2, 0.05))
    keep = ck.start(4)
    stop = ck.check(0, torch.tensor([0.1, 0.5, 0.5, 0.5]), keep)
    assert stop.tolist() == [True, False, False, False] and keep[0] == 8
    stop = ck.check(1, torch.tensor([0.01, 0.1, 0.5, float("nan")]), keep)
    assert keep.tolist() == [8, 24, NO_PRUNE, NO_PRUNE]
    assert stop.tolist() == [True, True, False, False]
    stop2 = ck.check(3, torch.zeros(4), keep)  # not a checkpoint: stop only, a fresh tensor
    assert stop2.tolist() == [True, True, False, False] and stop2 is not stop
    assert keep.tolist() == [8, 24, NO_PRUNE, NO_PRUNE]
    stop = ck.check(5, torch.tensor([0.0, 0.0, 0.04, 0.05]), keep)
    assert keep.tolist() == [8, 24, 40, NO_PRUNE] and stop.tolist() == [True, True, True, False]


def test_prune_and_check_have_no_host_sync(cuda_backends):
    """The calls a CUDA graph would capture (after a warm-up): no host read, no value-dependent
    shape, no host data copied in, through the CUDA backends."""
    rng = random.Random(2)
    tree = make_tree([parents_of("random", 12, rng), []], 16, 64, rng)
    ck = PruneCheckpoints()
    keep, best = ck.start(2), torch.tensor([0.1, 0.9])
    out = treeops.Tree.empty(2, 16)
    calls = [
        lambda: ck.check(0, best, keep),
        lambda: ck.check(3, best, keep),
        lambda: prune(tree, keep),
        lambda: prune(tree, 4),
        lambda: prune(tree, 4, out=out),
    ]
    for call in calls:
        first = call()
        with NoHostSync() as check:
            again = call()
        assert check.ops_checked > 0
        if isinstance(first, treeops.Tree):
            assert_same(again, first)
        else:
            assert torch.equal(again, first)


def test_strided_keep_and_best_score_are_rejected():
    rng = random.Random(3)
    tree = make_tree([parents_of("random", 6, rng)] * 2, 8, 64, rng)
    keep = torch.full((2, 2), 3, dtype=torch.int32)[:, 0]  # stride 2
    with pytest.raises(ValueError, match="Invalid stride of keep"):
        prune(tree, keep)
    ck = PruneCheckpoints()
    with pytest.raises(ValueError, match="Invalid stride of keep"):
        ck.check(0, torch.zeros(2), keep)
    with pytest.raises(ValueError, match="Invalid stride of best_score"):
        ck.check(0, torch.zeros(2, 2)[:, 1], ck.start(2))
    with pytest.raises(ValueError, match="Invalid dtype of keep"):
        prune(tree, keep.long())
    with pytest.raises(ValueError, match="Invalid value of keep"):
        prune(tree, -2)
