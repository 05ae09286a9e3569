"""KV compaction (docs/design.md op 8): reference and Triton kernel (interpreted) against an
independent expectation, with every slot outside [s, s + accept_len) poisoned and checked."""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import treeops
from helpers import small_step
from strategies import make_tree, paged_kv, parents_of
from treeops.kernels.compact_kv import compact_kv_launch
from treeops.reference.compact_kv import compact_kv as ref_compact

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1",
        reason="CPU tensors need the Triton interpreter; on a GPU run tests/test_accept_gpu.py",
    ),
]

POISON = 1234.5


def random_path(par: list[int], rng: random.Random) -> list[int]:
    path = [0]
    while True:
        kids = [j for j in range(1, len(par)) if par[j] == path[-1]]
        if not kids or rng.random() < 0.15:
            return path
        path.append(rng.choice(kids))


def make_case(
    rng: random.Random,
    B: int,
    N: int,
    L: int,
    H: int,
    D: int,
    page_size,
    dtype,
    stacked: bool,
    strided: bool = False,
):
    kinds = ["chain", "random", "star", "binary", "single", "inactive"]
    rows = [parents_of(rng.choice(kinds), rng.randint(1, N), rng) for _ in range(B)]
    tree = make_tree(rows, N, 64, rng)
    seq = [rng.randint(0, 40) for _ in range(B)]
    acc = torch.full((B, N), -1, dtype=torch.int32)
    alen = torch.zeros(B, dtype=torch.int32)
    for b, par in enumerate(rows):
        if par:
            p = random_path(par, rng)
            acc[b, : len(p)] = torch.tensor(p, dtype=torch.int32)
            alen[b] = len(p)
    # one paged layout (block table) shared by every layer, as in an engine
    base = paged_kv([s + N for s in seq], page_size, H, D, dtype, rng, strided=strided)
    ks, vs = [], []
    for _ in range(L):
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        ks.append(torch.randn(base.k_cache.shape, generator=g).to(dtype))
        vs.append(torch.randn(base.v_cache.shape, generator=g).to(dtype))
    if strided:  # K and V interleaved in one buffer per layer: non-contiguous views
        ks2, vs2 = [], []
        for k, v in zip(ks, vs):
            buf = torch.stack([k, v], dim=3)
            ks2.append(buf[:, :, :, 0])
            vs2.append(buf[:, :, :, 1])
        ks, vs = ks2, vs2
    if stacked:
        kc, vc = torch.stack(ks), torch.stack(vs)
        if strided:
            buf = torch.stack([kc, vc], dim=4)
            kc, vc = buf[..., 0, :], buf[..., 1, :]
    else:
        kc, vc = ks, vs
    return tree, kc, vc, base.block_table, torch.tensor(seq, dtype=torch.int32), acc, alen


def layers(c):
    return list(c.unbind(0)) if isinstance(c, torch.Tensor) else list(c)


def logical(cache: torch.Tensor, bt: torch.Tensor, b: int, slot: int) -> torch.Tensor:
    ps = cache.shape[1]
    return cache[int(bt[b, slot // ps]), slot % ps]


def poison_outside(caches, bt, seq, alen):
    """Set every physical slot that is not in any request's [s, s + accept_len) to POISON;
    return the set of (page, offset) pairs inside."""
    ps = layers(caches)[0].shape[1]
    inside = set()
    for b in range(bt.shape[0]):
        for slot in range(int(seq[b]), int(seq[b]) + int(alen[b])):
            inside.add((int(bt[b, slot // ps]), slot % ps))
    for c in layers(caches):
        for p in range(c.shape[0]):
            for o in range(c.shape[1]):
                if (p, o) not in inside:
                    c[p, o] = POISON
    return inside


def check_result(before, after, bt, seq, acc, alen, inside, poisoned: bool):
    """Inside: slot s + d holds what slot s + accepted[d] held before. Outside: untouched."""
    for c0, c1 in zip(layers(before), layers(after)):
        for b in range(bt.shape[0]):
            s = int(seq[b])
            for d in range(int(alen[b])):
                want = logical(c0, bt, b, s + int(acc[b, d]))
                assert torch.equal(logical(c1, bt, b, s + d), want), (b, d)
        for p in range(c1.shape[0]):
            for o in range(c1.shape[1]):
                if (p, o) not in inside:
                    if poisoned:
                        assert bool((c1[p, o] == POISON).all()), (p, o)
                    assert torch.equal(c1[p, o], c0[p, o]), (p, o)


def clone(c):
    return c.clone() if isinstance(c, torch.Tensor) else [t.clone() for t in c]


@pytest.mark.parametrize("page_size", [1, 16, None], ids=["ps1", "ps16", "contiguous"])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "list"])
def test_compact_poison(page_size, stacked):
    rng = random.Random(17 + (page_size or 0) + stacked)
    B, N = 4, 12
    tree, kc, vc, bt, seq, acc, alen = make_case(
        rng, B, N, 3, 2, 8, page_size, torch.bfloat16, stacked
    )
    alen_eff = alen.clone()
    # the slots [s, s + N) that compaction may read must hold real data, not poison: poison only
    # what lies outside every request's tree region as well, then check the tree region beyond
    # accept_len separately (it may be overwritten only by the copy's in-range destinations)
    full = alen.clone()
    full[tree.num_nodes > 0] = N
    inside = poison_outside(kc, bt, seq, full)
    poison_outside(vc, bt, seq, full)
    for impl in ("reference", "kernel"):
        k1, v1 = clone(kc), clone(vc)
        if impl == "kernel":
            new = compact_kv_launch(k1, v1, bt, seq, acc, alen)
        else:
            new = ref_compact(k1, v1, bt, seq, tree, acc, alen)
        assert new.dtype == torch.int32 and new.tolist() == (seq + alen_eff).tolist()
        check_result(kc, k1, bt, seq, acc, alen, inside, poisoned=True)
        check_result(vc, v1, bt, seq, acc, alen, inside, poisoned=True)
        # tree slots past accept_len are untouched too
        for c0, c1 in ((kc, k1), (vc, v1)):
            for l0, l1 in zip(layers(c0), layers(c1)):
                for b in range(B):
                    s = int(seq[b])
                    for slot in range(s + int(alen[b]), s + int(full[b])):
                        assert torch.equal(logical(l1, bt, b, slot), logical(l0, bt, b, slot))


@given(
    seed=st.integers(0, 2**20),
    page_size=st.sampled_from([1, 4, 16, None]),
    stacked=st.booleans(),
    strided=st.booleans(),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    D=st.sampled_from([8, 12]),
)
def test_compact_kernel_equals_reference(seed, page_size, stacked, strided, dtype, D):
    rng = random.Random(seed)
    tree, kc, vc, bt, seq, acc, alen = make_case(
        rng,
        rng.randint(1, 4),
        rng.choice([4, 8, 16]),
        rng.randint(1, 3),
        rng.choice([1, 2]),
        D,
        page_size,
        dtype,
        stacked,
        strided,
    )
    k1, v1, k2, v2 = clone(kc), clone(vc), clone(kc), clone(vc)
    out = torch.full_like(seq, -7)
    new1 = compact_kv_launch(k1, v1, bt, seq, acc, alen, out=out)
    new2 = ref_compact(k2, v2, bt, seq, tree, acc, alen)
    assert new1 is out and torch.equal(new1, new2)
    for a, b in zip(layers(k1) + layers(v1), layers(k2) + layers(v2)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rows_per_step", [1, 2, 8])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "list"])
def test_compact_long_paths_in_place(rows_per_step, stacked):
    """Paths whose destinations are earlier sources (i_d = 2d, and i_d = d + 3), copied in
    several chunks: a chunk must read all its sources before writing, and chunks go in
    increasing depth."""
    rng = random.Random(rows_per_step)
    B, N = 3, 24
    tree, kc, vc, bt, seq, _, _ = make_case(rng, B, N, 2, 2, 8, 4, torch.float32, stacked)
    acc = torch.full((B, N), -1, dtype=torch.int32)
    paths = [[2 * d for d in range(12)], [0] + [d + 3 for d in range(1, 21)], [0, 1, 5, 6]]
    for b, p in enumerate(paths):
        acc[b, : len(p)] = torch.tensor(p, dtype=torch.int32)
    alen = torch.tensor([len(p) for p in paths], dtype=torch.int32)
    k1, v1, k2, v2 = clone(kc), clone(vc), clone(kc), clone(vc)
    compact_kv_launch(k1, v1, bt, seq, acc, alen, rows_per_step=rows_per_step)
    ref_compact(k2, v2, bt, seq, tree, acc, alen)
    for a, b in zip(layers(k1) + layers(v1), layers(k2) + layers(v2)):
        assert torch.equal(a, b)
    ps = layers(kc)[0].shape[1]
    for b, p in enumerate(paths):  # and against the original cache, independently
        for d, i in enumerate(p):
            for c0, c1 in zip(layers(kc), layers(k1)):
                assert torch.equal(
                    logical(c1, bt, b, int(seq[b]) + d), logical(c0, bt, b, int(seq[b]) + i)
                )
    assert ps == 4


def test_pointer_table_says_whether_layers_are_aligned():
    """A list of layers reaches the kernel through a table of their addresses; the kernel is
    told they are 16-byte aligned (vector copies) only when every one is."""
    from treeops.kernels import compact_kv as kc_mod

    fresh = [torch.zeros(4, 16, 2, 8, dtype=torch.bfloat16) for _ in range(2)]
    flat = torch.zeros(2 * 4 * 16 * 2 * 8 + 1, dtype=torch.bfloat16)
    off = [flat[1:][i * 1024 : (i + 1) * 1024].view(4, 16, 2, 8) for i in range(2)]
    tab, aligned = kc_mod._pointer_table(fresh)
    assert aligned and tab.tolist() == [t.data_ptr() for t in fresh]
    tab, aligned = kc_mod._pointer_table([fresh[0], off[1]])  # one layer 2 bytes off
    assert not aligned and tab.tolist() == [fresh[0].data_ptr(), off[1].data_ptr()]


def test_compact_after_acceptance_end_to_end():
    """accept_greedy -> compact_kv: the cache then holds root + accepted path contiguously."""
    rng = random.Random(4)
    tree = make_tree([parents_of("chain", 6, rng), parents_of("binary", 7, rng)], 8, 32, rng)
    lg = torch.randn(2, 8, 32)
    for b in range(2):
        for i in range(1, int(tree.num_nodes[b])):
            lg[b, int(tree.parents[b, i]), int(tree.tokens[b, i])] += 20.0 if i % 2 else 0.0
    r = treeops.accept_greedy(tree, lg)
    kv = paged_kv([10 + 8, 3 + 8], 4, 2, 8, torch.float32, rng)
    seq = torch.tensor([10, 3], dtype=torch.int32)
    k0 = kv.k_cache.clone()
    new = treeops.compact_kv(
        kv.k_cache[None],
        kv.v_cache[None],
        kv.block_table,
        seq,
        tree,
        r.accepted,
        r.accept_len,
        validate=True,
    )
    assert new.tolist() == (seq + r.accept_len).tolist()
    for b in range(2):
        for d in range(int(r.accept_len[b])):
            src = int(seq[b]) + int(r.accepted[b, d])
            assert torch.equal(
                logical(kv.k_cache, kv.block_table, b, int(seq[b]) + d),
                logical(k0, kv.block_table, b, src),
            )


# ------------------------------------------------------------------------------ bad input
def _good():
    rng = random.Random(0)
    tree, kc, vc, bt, seq, acc, alen = make_case(rng, 2, 4, 2, 2, 8, 4, torch.float16, True)
    acc = torch.tensor([[0, 1, -1, -1], [0, -1, -1, -1]], dtype=torch.int32)
    tree = make_tree([[-1, 0, 1, 2], [-1, 0]], 4, 16, rng)
    alen = torch.tensor([2, 1], dtype=torch.int32)
    return dict(
        k_caches=kc,
        v_caches=vc,
        block_table=bt,
        seq_lens=seq,
        tree=tree,
        accepted=acc,
        accept_len=alen,
    )


@pytest.mark.parametrize(
    "change,msg",
    [
        (lambda a: a.update(k_caches=a["k_caches"][0]), "Invalid shape of k_caches"),
        (lambda a: a.update(k_caches="x"), "Invalid type of k_caches"),
        (lambda a: a.update(k_caches=a["k_caches"].int()), "Invalid dtype of k_caches"),
        (lambda a: a.update(v_caches=a["v_caches"].float()), "Invalid dtype of v_caches"),
        (lambda a: a.update(v_caches=a["v_caches"][:, :, :, :, :4]), "Invalid shape of v_caches"),
        (lambda a: a.update(v_caches=a["v_caches"][:1]), "Invalid number of layers in v_caches"),
        (
            lambda a: a.update(
                k_caches=list(a["k_caches"]), v_caches=[a["v_caches"][0], a["v_caches"][1][:, :2]]
            ),
            "Invalid shape of v_caches[1]",
        ),
        (
            lambda a: a.update(
                k_caches=[
                    a["k_caches"][0],
                    a["k_caches"][1].transpose(1, 2).contiguous().transpose(1, 2),
                ],
                v_caches=list(a["v_caches"]),
            ),
            "Invalid strides of k_caches[1]",
        ),
        (lambda a: a.update(block_table=a["block_table"].long()), "Invalid dtype of block_table"),
        (lambda a: a.update(block_table=a["block_table"][:1]), "Invalid shape of block_table"),
        (lambda a: a.update(seq_lens=a["seq_lens"].float()), "Invalid dtype of seq_lens"),
        (
            lambda a: a.update(accepted=a["accepted"][:, :3]),
            "Invalid shape of accepted: expected [2, 4]",
        ),
        (lambda a: a.update(accept_len=a["accept_len"].long()), "Invalid dtype of accept_len"),
        (lambda a: a.update(tree=None), "Invalid type of tree"),
        (lambda a: a.update(out=torch.zeros(2, dtype=torch.int64)), "Invalid dtype of out"),
        (
            lambda a: a.update(validate=True, accept_len=torch.tensor([5, 1], dtype=torch.int32)),
            "Invalid value in accept_len: expected < 5",
        ),
        (
            lambda a: a.update(
                validate=True,
                accepted=torch.tensor([[0, 2, -1, -1], [0, -1, -1, -1]], dtype=torch.int32),
            ),
            "Invalid value in accepted: accepted[b, d] must be a node at depth d",
        ),
        (
            lambda a: a.update(validate=True, seq_lens=torch.tensor([1000, 0], dtype=torch.int32)),
            "Invalid value in seq_lens: the block table covers",
        ),
    ],
)
def test_bad_input(change, msg):
    args = _good()
    change(args)
    with pytest.raises(ValueError) as e:
        treeops.compact_kv(**args)
    assert msg in str(e.value)


@pytest.mark.parametrize("stacked", [False, True])
def test_opcheck_compact_kv(stacked):
    s = small_step()
    t = s["tree"]
    layers = [s["k_cache"], s["k_cache"].clone()]
    v_layers = [s["v_cache"], s["v_cache"].clone()]
    if stacked:
        layers, v_layers = [torch.stack(layers)], [torch.stack(v_layers)]
    accepted = torch.tensor([[0, 1, 3, -1], [0, 1, -1, -1]], dtype=torch.int32)
    accept_len = torch.tensor([3, 2], dtype=torch.int32)
    torch.library.opcheck(
        torch.ops.treeops.compact_kv.default,
        (layers, v_layers, s["block_table"], s["seq_lens"], *t.tensors(), accepted, accept_len,
         torch.zeros(2, dtype=torch.int32)),
    )  # fmt: skip
