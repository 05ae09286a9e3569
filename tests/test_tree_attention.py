"""Tree-masked paged attention: reference against an independent float64 softmax, the Triton
kernel (under the interpreter) against the reference, and the public op's input checks."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import treeops
from helpers import TOLERANCES, assert_close, small_step, tree_from_lists
from strategies import make_tree, paged_kv, parents_of, trees
from treeops.kernels import tree_attention as K
from treeops.kernels import tree_attention_config as KC
from treeops.reference import tree_attention as R


def brute_force(q, kv, seq_lens, parents, q_start=None, q_len=None, scale=None):
    """float64, one (request, node, head) at a time; tree visibility from walking ``parents``
    (not from ``anc``), slot -> page by plain integer arithmetic. Returns out, lse."""
    B, N, H_q, D = q.shape
    H_kv = kv.k_cache.shape[2]
    ps = kv.k_cache.shape[1]
    scale = 1 / math.sqrt(D) if scale is None else scale
    out = torch.zeros(B, N, H_q, D, dtype=torch.float64)
    lse = torch.full((B, N, H_q), float("-inf"), dtype=torch.float64)
    for b in range(B):
        par, s, n = parents[b], int(seq_lens[b]), len(parents[b])
        lo = 0 if q_start is None else int(q_start[b])
        hi = N if q_len is None else lo + int(q_len[b])
        for i in range(max(lo, 0), min(hi, n)):
            anc, j = set(), i
            while j >= 0:
                anc.add(j)
                j = par[j]
            slots = list(range(s)) + [s + j for j in sorted(anc)]
            for h in range(H_q):
                kvh = h // (H_q // H_kv)
                keys = torch.stack(
                    [kv.k_cache[int(kv.block_table[b, p // ps]), p % ps, kvh] for p in slots]
                ).double()
                vals = torch.stack(
                    [kv.v_cache[int(kv.block_table[b, p // ps]), p % ps, kvh] for p in slots]
                ).double()
                logits = keys @ q[b, i, h].double() * scale
                m = logits.max()
                w = torch.exp(logits - m)
                out[b, i, h] = (w[:, None] * vals).sum(0) / w.sum()
                lse[b, i, h] = m + torch.log(w.sum())
    return out, lse


def _lse_close(actual, expected, what):
    inf = torch.isinf(expected)
    assert bool(torch.isinf(actual[inf]).all() and (actual[inf] < 0).all()), f"{what}: -inf rows"
    assert bool(torch.isfinite(actual[~inf]).all()), f"{what}: inf where finite expected"
    # an lse's error is absolute (d log s = ds / s: the sum's relative error), so the tolerance
    # scale is at least 1; scaled by |lse| alone, an lse near 0 (one key, logit ~ 0) turned fp32
    # rounding of 6e-8 into a "relative" 3e-6 (found by the thorough hypothesis profile)
    a, e = actual[~inf].double().cpu(), expected[~inf].double().cpu()
    if e.numel():
        err = (a - e).abs() / max(float(e.abs().max()), 1.0)
        tmax, trms = TOLERANCES[torch.float32]
        max_err, rms_err = float(err.max()), float(err.pow(2).mean().sqrt())
        assert max_err <= tmax and rms_err <= trms, (
            f"{what}: lse max err {max_err:.3e} (tol {tmax:.0e}), rms {rms_err:.3e} ({trms:.0e})"
        )


@given(tc=trees(max_batch=3, capacities=(1, 4, 8, 16)), data=st.data())
def test_reference_matches_float64_softmax(tc, data):
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    B, N = tc.tree.batch_size, tc.tree.capacity
    H_kv = data.draw(st.sampled_from([1, 2]))
    H_q = H_kv * data.draw(st.sampled_from([1, 2, 4]))
    D = 8
    seq = [data.draw(st.integers(0, 20)) for _ in range(B)]
    kv = paged_kv(
        [s + N for s in seq], data.draw(st.sampled_from([1, 4, None])), H_kv, D, torch.float32, rng
    )
    q = torch.randn(B, N, H_q, D, dtype=torch.float32)
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    qs = ql = None
    if data.draw(st.booleans()):
        qs = torch.tensor([rng.randrange(N + 1) for _ in range(B)], dtype=torch.int32)
        ql = torch.tensor([rng.randrange(N + 1) for _ in range(B)], dtype=torch.int32)
    out, lse = R.tree_attention(
        q, kv.k_cache, kv.v_cache, kv.block_table, seq_lens, tc.tree, qs, ql, return_lse=True
    )
    exp_out, exp_lse = brute_force(q, kv, seq_lens, tc.parents, qs, ql)
    assert_close(out, exp_out, torch.float32, "reference out")
    _lse_close(lse, exp_lse, "reference lse")


def run_kernel(
    q,
    kv,
    seq_lens,
    tree,
    q_start=None,
    q_len=None,
    num_splits=None,
    override=None,
    workspace=None,
    scale=None,
):
    B, N, H_q, D = q.shape
    out = torch.empty_like(q)  # poisoned by conftest: every element must be written
    lse = torch.empty(B, N, H_q, dtype=torch.float32)
    K.tree_attention_fwd(
        q,
        kv.k_cache,
        kv.v_cache,
        kv.block_table,
        seq_lens,
        tree.num_nodes,
        tree.anc,
        q_start,
        q_len,
        scale or 1 / math.sqrt(D),
        out,
        lse,
        workspace,
        num_splits,
        override,
    )
    return out, lse


def check_kernel(q, kv, seq_lens, tree, q_start=None, q_len=None, what="", **kw):
    out, lse = run_kernel(q, kv, seq_lens, tree, q_start, q_len, **kw)
    ref, ref_lse = R.tree_attention(
        q,
        kv.k_cache,
        kv.v_cache,
        kv.block_table,
        seq_lens,
        tree,
        q_start,
        q_len,
        return_lse=True,
        sm_scale=kw.get("scale"),
    )
    assert_close(out, ref, q.dtype, f"out {what}")
    _lse_close(lse, ref_lse, f"lse {what}")
    dead = torch.isinf(ref_lse)
    assert bool((out[dead] == 0).all()), f"{what}: rows that see nothing must be exactly 0"
    return out, lse


@given(tc=trees(max_batch=3, capacities=(1, 4, 8, 16, 32)), data=st.data())
def test_kernel_matches_reference(tc, data):
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    B, N = tc.tree.batch_size, tc.tree.capacity
    group = data.draw(st.sampled_from([1, 4, 8]))
    H_kv = data.draw(st.sampled_from([1, 2])) if group < 8 else 1
    dtype = data.draw(st.sampled_from([torch.float16, torch.float32]))
    page = data.draw(st.sampled_from([1, 16, 64, None]))
    seq = [data.draw(st.sampled_from([0, 1, 31, 64, 100])) for _ in range(B)]
    kv = paged_kv(
        [s + N for s in seq], page, H_kv, 64, dtype, rng, strided=data.draw(st.booleans())
    )
    q = torch.randn(B, N, H_kv * group, 64).to(dtype)
    if data.draw(st.booleans()):  # a strided q: [B, H_q, N, D] storage seen as [B, N, H_q, D]
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    qs = ql = None
    if data.draw(st.booleans()):
        qs = torch.tensor([rng.randrange(N + 1) for _ in range(B)], dtype=torch.int32)
        ql = torch.tensor([rng.randrange(N + 1) for _ in range(B)], dtype=torch.int32)
    splits = data.draw(st.sampled_from([None, 1, 3]))
    override = {"prefetch": data.draw(st.booleans()), "block_n": 32}
    check_kernel(
        q,
        kv,
        seq_lens,
        tc.tree,
        qs,
        ql,
        num_splits=splits,
        override=override,
        what=f"page={page} group={group} {dtype} splits={splits}",
    )


@pytest.mark.parametrize("D,H_q,H_kv,page", [(128, 8, 2, 16), (256, 4, 1, None)])
def test_kernel_large_head_dims(D, H_q, H_kv, page):
    rng = random.Random(D)
    tree = make_tree([parents_of("random", 11, rng), parents_of("chain", 16, rng)], 16, 64, rng)
    seq = [70, 5]
    kv = paged_kv([s + 16 for s in seq], page, H_kv, D, torch.float16, rng)
    q = torch.randn(2, 16, H_q, D).to(torch.float16)
    check_kernel(q, kv, torch.tensor(seq, dtype=torch.int32), tree, what=f"D={D}")


def test_kernel_one_larger_case_with_splits_and_workspace():
    """Longer prefixes, GQA 4, page 16, split-KV through a caller-supplied workspace."""
    rng = random.Random(5)
    N = 64
    tree = make_tree([parents_of("random", 64, rng), parents_of("binary", 40, rng)], N, 64, rng)
    seq = [300, 157]
    kv = paged_kv([s + N for s in seq], 16, 1, 64, torch.float16, rng)
    q = torch.randn(2, N, 4, 64).to(torch.float16)
    cfg = K.pick_config(2, N, 4, 1, 64, kv.block_table.shape[1] * 16, 4, True, num_splits=4)
    ws = torch.zeros(K.workspace_numel(2, N, 4, 64, cfg), dtype=torch.float32)
    check_kernel(
        q,
        kv,
        torch.tensor(seq, dtype=torch.int32),
        tree,
        num_splits=4,
        workspace=ws,
        override={"prefetch": True},
    )
    assert bool((ws != 0).any()), "the caller's workspace was not used"


def test_requests_below_the_split_length_are_not_split():
    """One launch where a request splits or not by its own key count (``_splits_used``): 16 and
    36 keys stay whole (below split_min_len = 64: the forward writes them, the merge must leave
    them), 76 keys split in 2 (chunks of >= 32), 166 and 416 in 4 (the cap). The output is
    poisoned first (conftest), so a row neither kernel writes fails, as does a merge of unwritten
    partials over a whole request."""
    rng = random.Random(21)
    N = 16
    seq = [0, 20, 60, 150, 400]
    tree = make_tree([parents_of("random", N, rng) for _ in seq], N, 64, rng)
    kv = paged_kv([s + N for s in seq], 16, 1, 64, torch.float32, rng)
    q = torch.randn(len(seq), N, 2, 64)
    ov = {"split_min_len": 64, "min_chunk": 32}
    cfg = K.pick_config(len(seq), N, 2, 1, 64, kv.block_table.shape[1] * 16, 4, True, 4, ov)
    assert (cfg.num_splits, cfg.split_min_len, cfg.split_chunk) == (4, 64, 32)
    ws = torch.full((K.workspace_numel(len(seq), N, 2, 64, cfg),), float("nan"))
    seq_t = torch.tensor(seq, dtype=torch.int32)
    check_kernel(q, kv, seq_t, tree, num_splits=4, override=ov, workspace=ws)
    qs = torch.tensor([0, 3, 1, 0, 5], dtype=torch.int32)
    ql = torch.tensor([16, 4, 7, 1, 9], dtype=torch.int32)
    check_kernel(q, kv, seq_t, tree, qs, ql, num_splits=4, override=ov, workspace=ws)


@pytest.mark.parametrize("splits", [2, 3, 4])
def test_fused_merge_matches_reference(splits):
    """``fused_merge``: each split tile is merged by the last of its chunks' programs (arrival
    counters) instead of by ``_merge_splits``. Mixed lengths (split and unsplit requests), a
    query range with rows that see nothing, a negative q_start, a request with no nodes; output
    and LSE against the reference, and every counter back at zero."""
    from treeops.kernels import _counters as kc

    rng = random.Random(30 + splits)
    N = 16
    seq = [0, 20, 60, 150, 400, 7]
    rows = [parents_of("random", N, rng) for _ in seq[:-1]] + [[]]
    tree = make_tree(rows, N, 64, rng)
    kv = paged_kv([s + N for s in seq], 16, 1, 64, torch.float32, rng)
    q = torch.randn(len(seq), N, 2, 64)
    ov = {"split_min_len": 64, "min_chunk": 32, "fused_merge": True}
    seq_t = torch.tensor(seq, dtype=torch.int32)
    check_kernel(q, kv, seq_t, tree, num_splits=splits, override=ov)
    qs = torch.tensor([0, 3, -2, 0, 5, 0], dtype=torch.int32)
    ql = torch.tensor([16, 4, 7, 1, 9, 3], dtype=torch.int32)
    check_kernel(q, kv, seq_t, tree, qs, ql, num_splits=splits, override=ov)
    assert all(int(c.abs().sum()) == 0 for c in kc._COUNTERS.values())


def test_auto_split_count_is_a_cap_lowered_by_each_request():
    """The automatic count carries the device-side bound (none by default; with a
    ``split_min_len`` override, chunks of at least MIN_CHUNK); an explicit count splits as asked;
    an unsplit launch carries neutral values."""
    auto = K.pick_config(1, 64, 32, 8, 128, 4096, 132, False)
    assert auto.num_splits > 1
    assert (auto.split_min_len, auto.split_chunk) == (K.MIN_SPLIT_LEN, 1) == (0, 1)
    ov = {"split_min_len": 512}
    bounded = K.pick_config(1, 64, 32, 8, 128, 4096, 132, False, override=ov)
    assert (bounded.split_min_len, bounded.split_chunk) == (512, K.MIN_CHUNK)
    forced = K.pick_config(1, 64, 32, 8, 128, 4096, 132, False, num_splits=4)
    assert (forced.num_splits, forced.split_min_len, forced.split_chunk) == (4, 0, 1)
    whole = K.pick_config(64, 64, 32, 8, 128, 4096, 132, False)
    assert (whole.num_splits, whole.split_min_len, whole.split_chunk) == (1, 0, 1)


@pytest.mark.parametrize("splits", [1, 2])
def test_rows_that_see_nothing_are_exact_zero(splits):
    """Inactive request, empty query range, padding nodes and q_start past num_nodes."""
    rng = random.Random(6)
    tree = tree_from_lists([[], [-1, 0, 1], [-1, 0], [-1]], capacity=8)
    seq = torch.tensor([5, 0, 9, 3], dtype=torch.int32)
    kv = paged_kv([13, 8, 17, 11], 4, 1, 64, torch.float32, rng)
    q = torch.randn(4, 8, 2, 64)
    qs = torch.tensor([0, 1, 1, 3], dtype=torch.int32)
    ql = torch.tensor([8, 0, 8, 2], dtype=torch.int32)
    out, lse = check_kernel(q, kv, seq, tree, qs, ql, num_splits=splits)
    live = torch.zeros(4, 8, dtype=torch.bool)
    live[2, 1] = True  # request 2: node 1 is the only queried node that exists
    assert bool((out[~live] == 0).all())
    assert bool(torch.isneginf(lse[~live]).all())
    assert bool(torch.isfinite(lse[live]).all())


@pytest.mark.parametrize("splits", [1, 3])
def test_negative_q_start_queries_from_node_0(splits):
    """q_start < 0 (accepted with validate=False): rows [0, min(q_start + q_len, num_nodes, N)),
    as the reference. The kernel clamps q_start at 0: tiles used to start at q_start, leaving the
    last rows unwritten, and the split-KV relative row could reach N (the next request's
    partials)."""
    rng = random.Random(11)
    N = 16
    tree = make_tree(
        [parents_of("random", 16, rng), parents_of("chain", 9, rng), parents_of("binary", 16, rng)],
        N,
        64,
        rng,
    )
    seq = [37, 0, 70]
    kv = paged_kv([s + N for s in seq], 16, 1, 64, torch.float32, rng)
    q = torch.randn(3, N, 2, 64)
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    qs = torch.tensor([-5, -3, -40], dtype=torch.int32)
    ql = torch.tensor([N + 10, 6, 50], dtype=torch.int32)
    out, lse = check_kernel(q, kv, seq_lens, tree, qs, ql, num_splits=splits)
    live = torch.zeros(3, N, dtype=torch.bool)
    live[0, :] = True  # [0, min(5 + 16, 16, 16))
    live[1, :3] = True  # [0, -3 + 6)
    live[2, :10] = True  # [0, -40 + 50)
    assert bool(torch.isfinite(lse[live]).all())
    assert bool(torch.isneginf(lse[~live]).all()) and bool((out[~live] == 0).all())
    ref, ref_lse = brute_force(
        q, kv, seq_lens, [[int(p) for p in r] for r in _parents(tree)], qs, ql
    )
    assert_close(out, ref.float(), torch.float32, "out vs brute force")
    _lse_close(lse, ref_lse.float(), "lse vs brute force")


def _parents(tree):
    return [tree.parents[b, : int(tree.num_nodes[b])].tolist() for b in range(tree.batch_size)]


@pytest.mark.parametrize("splits", [1, 2])
def test_num_nodes_past_capacity_is_clamped(splits):
    """num_nodes > N (accepted with validate=False): the kernel attends to the N tree nodes only,
    as the reference with num_nodes clamped to N. Block-table entries past the seq + N covered
    slots point at a NaN page and anc has one word per row (N = 32), so a read past the covered
    pages or past an anc row would show up as NaN / wrong visibility."""
    rng = random.Random(12)
    N = 32
    tree = make_tree([parents_of("random", 32, rng), parents_of("binary", 20, rng)], N, 64, rng)
    seq = [16, 48]
    kv = paged_kv([s + N for s in seq], 16, 1, 64, torch.float32, rng)
    pages = [(s + N) // 16 for s in seq]
    owned = {int(kv.block_table[b, p]) for b in range(2) for p in range(pages[b])}
    spare = next(p for p in range(kv.k_cache.shape[0]) if p not in owned)
    kv.k_cache[spare] = float("nan")
    kv.v_cache[spare] = float("nan")
    bt = torch.full((2, max(pages) + 4), spare, dtype=torch.int32)
    for b in range(2):
        bt[b, : pages[b]] = kv.block_table[b, : pages[b]]
    kv = dataclasses.replace(kv, block_table=bt)
    q = torch.randn(2, N, 4, 64)
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    big = dataclasses.replace(tree, num_nodes=torch.tensor([N + 8, N + 100], dtype=torch.int32))
    clamped = dataclasses.replace(tree, num_nodes=torch.tensor([N, N], dtype=torch.int32))
    out, lse = run_kernel(q, kv, seq_lens, big, num_splits=splits)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
    ref, ref_lse = R.tree_attention(
        q, kv.k_cache, kv.v_cache, kv.block_table, seq_lens, clamped, return_lse=True
    )
    assert_close(out, ref, torch.float32, "out")
    _lse_close(lse, ref_lse, "lse")


def test_empty_prefix_root_sees_itself():
    """seq_len 0: the root's only key is itself, so its output is its own V row."""
    rng = random.Random(7)
    tree = tree_from_lists([[-1, 0, 0]], capacity=4)
    kv = paged_kv([4], 16, 1, 64, torch.float32, rng)
    q = torch.randn(1, 4, 1, 64)
    out, lse = check_kernel(q, kv, torch.tensor([0], dtype=torch.int32), tree)
    page = int(kv.block_table[0, 0])
    assert_close(out[0, 0, 0], kv.v_cache[page, 0, 0], torch.float32, "root output")


def test_sm_scale_is_used():
    rng = random.Random(8)
    tree = tree_from_lists([[-1, 0, 1, 1]], capacity=4)
    kv = paged_kv([40], 16, 1, 64, torch.float32, rng)
    q = torch.randn(1, 4, 2, 64)
    seq = torch.tensor([36], dtype=torch.int32)
    check_kernel(q, kv, seq, tree, scale=0.5)


# ----------------------------------------------------------------------------- public op
def _inputs(B=2, N=8, H_q=4, H_kv=2, D=64, dtype=torch.float32):
    rng = random.Random(9)
    tree = make_tree([parents_of("random", N, rng) for _ in range(B)], N, 64, rng)
    kv = paged_kv([20 + N] * B, 16, H_kv, D, dtype, rng)
    q = torch.randn(B, N, H_q, D).to(dtype)
    return dict(
        q=q,
        k_cache=kv.k_cache,
        v_cache=kv.v_cache,
        block_table=kv.block_table,
        seq_lens=torch.full((B,), 20, dtype=torch.int32),
        tree=tree,
    )


def test_public_op_on_cpu_is_the_reference_and_fills_buffers():
    a = _inputs()
    out = torch.empty_like(a["q"])
    lse = torch.empty(2, 8, 4)
    res = treeops.tree_attention(**a, return_lse=True, out=out, lse=lse, validate=True)
    assert res[0] is out and res[1] is lse
    ref, ref_lse = R.tree_attention(**a, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert isinstance(treeops.tree_attention(**a), torch.Tensor)
    ws = treeops.tree_attention_workspace(a["q"], a["k_cache"], a["block_table"])
    assert ws.dtype == torch.float32 and ws.dim() == 1


def _bad(**changes):
    a = _inputs()
    a.update(changes)
    return a


@pytest.mark.parametrize(
    "args,message",
    [
        (lambda: _bad(q=torch.randn(2, 8, 4, 64).to(torch.int32)), "Invalid dtype of q"),
        (
            lambda: _bad(q=torch.randn(2, 8, 4, 32)),
            "Invalid head dim of q: expected one of (64, 128, 256), got 32",
        ),
        (
            lambda: _bad(q=torch.randn(3, 8, 4, 64)),
            "Invalid shape of q: expected [2, 8, H_q, D], got [3, 8, 4, 64]",
        ),
        (
            lambda: _bad(k_cache=torch.randn(3, 16, 2, 64).half()),
            "Invalid dtype of k_cache: expected torch.float32, got torch.float16",
        ),
        (lambda: _bad(v_cache=torch.randn(3, 16, 2, 128)), "Invalid shape of v_cache"),
        (lambda: _bad(q=torch.randn(2, 8, 3, 64)), "H_q = 3 must be a multiple of H_kv = 2"),
        (
            lambda: _bad(block_table=torch.zeros(2, 4, dtype=torch.int64)),
            "Invalid dtype of block_table: expected torch.int32, got torch.int64",
        ),
        (
            lambda: _bad(seq_lens=torch.zeros(3, dtype=torch.int32)),
            "Invalid shape of seq_lens: expected [2], got [3]",
        ),
        (lambda: _bad(tree="tree"), "Invalid type of tree: expected treeops.Tree, got str"),
        (
            lambda: _bad(seq_lens=torch.zeros(2, dtype=torch.int32, device="meta")),
            "Invalid device of seq_lens",
        ),
        (
            lambda: dict(_bad(), q_start=torch.zeros(2, dtype=torch.int64)),
            "Invalid dtype of q_start",
        ),
        (
            lambda: dict(_bad(), out=torch.zeros(2, 8, 4, 64, dtype=torch.float16)),
            "Invalid dtype of out",
        ),
        (lambda: dict(_bad(), lse=torch.zeros(2, 8, 5)), "Invalid shape of lse"),
        (
            lambda: dict(_bad(), workspace=torch.zeros(4, dtype=torch.int32)),
            "Invalid dtype of workspace",
        ),
        (lambda: dict(_bad(), sm_scale=-1.0), "Invalid value of sm_scale"),
    ],
)
def test_public_op_rejects_bad_input(args, message):
    with pytest.raises(ValueError) as e:
        treeops.tree_attention(**args())
    assert message in str(e.value)


def test_validate_checks_values():
    a = _inputs()
    bt = a["block_table"].clone()
    bt[0, 0] = 99
    with pytest.raises(ValueError, match="Invalid value in block_table: expected < 5, got 99"):
        treeops.tree_attention(**dict(a, block_table=bt), validate=True)
    with pytest.raises(ValueError, match="exceeds the block table's capacity of 32 slots"):
        treeops.tree_attention(
            **dict(a, seq_lens=torch.tensor([25, 0], dtype=torch.int32)), validate=True
        )
    with pytest.raises(ValueError, match="Invalid value in q_start: expected < 9, got 10"):
        treeops.tree_attention(**a, q_start=torch.tensor([10, 0], dtype=torch.int32), validate=True)
    t = a["tree"].clone()
    t.depth[0, 1] = 5
    with pytest.raises(ValueError, match="Invalid tree: request 0: depth"):
        treeops.tree_attention(**dict(a, tree=t), validate=True)


def test_split_count_depends_on_capacities_only():
    """Same shapes, different values: same config; more programs than SMs: no split."""
    c1 = K.pick_config(1, 64, 32, 8, 128, 4096, 132, False)
    c2 = K.pick_config(1, 64, 32, 8, 128, 4096, 132, False)
    assert c1 == c2 and c1.num_splits > 1
    assert K.pick_config(64, 64, 32, 8, 128, 4096, 132, False).num_splits == 1
    assert K.pick_config(1, 64, 32, 8, 128, 128, 132, False).num_splits == 1  # tiny capacity
    # a decode step at short context: no split below MIN_SPLIT_CAPACITY slots (the merge launch
    # would cost more than it saves), the usual split from it on
    below = K.MIN_SPLIT_CAPACITY - 16
    assert K.pick_config(1, 1, 10, 2, 64, below, 132, False).num_splits == 1
    at = K.pick_config(1, 1, 10, 2, 64, K.MIN_SPLIT_CAPACITY, 132, False)
    assert at.num_splits == min(K.MAX_SPLITS, K.MIN_SPLIT_CAPACITY // K.MIN_CHUNK) == 16


@settings(max_examples=8)
@given(
    tc=trees(max_batch=2, capacities=(64,), kinds=("random", "chain", "star", "binary")),
    data=st.data(),
)
def test_kernel_matches_reference_full_trees(tc, data):
    """Capacity 64 (two anc words), longer prefixes, GQA 8, forced splits and both loops; each
    request split or not by its own length (a drawn split_min_len), merged by ``_merge_splits``
    or by the tile's last chunk (``fused_merge``)."""
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    B, N = tc.tree.batch_size, tc.tree.capacity
    seq = [data.draw(st.integers(0, 300)) for _ in range(B)]
    kv = paged_kv(
        [s + N for s in seq],
        data.draw(st.sampled_from([1, 16, 64, None])),
        1,
        64,
        torch.float16,
        rng,
    )
    q = torch.randn(B, N, 8, 64).to(torch.float16)
    check_kernel(
        q,
        kv,
        torch.tensor(seq, dtype=torch.int32),
        tc.tree,
        num_splits=data.draw(st.sampled_from([1, 2, 5])),
        override={
            "prefetch": data.draw(st.booleans()),
            "block_n": 64,
            "split_min_len": data.draw(st.sampled_from([0, 100, 250])),
            "min_chunk": 32,
            "fused_merge": data.draw(st.booleans()),
            "partial_half": data.draw(st.booleans()),
        },
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
def test_partial_half_stores_16_bit_partials(dtype, fused):
    """``partial_half``: split partial outputs stored in the inputs' 16-bit dtype, merged by
    ``_merge_splits`` or by the tile's last chunk: the reference's output and LSE, and only the
    first half of the fp32 partials' bytes written (the rest of a NaN-poisoned workspace stays
    NaN). fp32 inputs and unsplit launches keep fp32 partials."""
    rng = random.Random(41)
    N = 16
    seq = [0, 20, 150, 400]
    tree = make_tree([parents_of("random", N, rng) for _ in seq], N, 64, rng)
    kv = paged_kv([s + N for s in seq], 16, 1, 64, dtype, rng)
    q = torch.randn(len(seq), N, 2, 64).to(dtype)
    ov = {"partial_half": True, "fused_merge": fused}
    cfg = K.pick_config(len(seq), N, 2, 1, 64, kv.block_table.shape[1] * 16, 4, True, 3, ov)
    assert cfg.partial_half and cfg.num_splits == 3
    ws = torch.full((K.workspace_numel(len(seq), N, 2, 64, cfg),), float("nan"))
    check_kernel(q, kv, torch.tensor(seq, dtype=torch.int32), tree, num_splits=3, override=ov,
                 workspace=ws)  # fmt: skip
    wo_numel = len(seq) * N * 2 * 3 * 64
    assert bool(ws[wo_numel // 2 : wo_numel].isnan().all())  # the 16-bit partials' half only
    assert not bool(ws[: wo_numel // 2].isnan().all())
    assert not K.pick_config(4, N, 2, 1, 64, 1024, 4, True, 3, ov, elem_bytes=4).partial_half
    assert not K.pick_config(4, N, 2, 1, 64, 1024, 4, True, 1, ov).partial_half


@pytest.mark.parametrize("with_lse", [False, True])
def test_opcheck_tree_attention(with_lse):
    s = small_step()
    B, N, H, D = s["q"].shape
    out = torch.zeros(B, N, H, D)
    lse = torch.zeros(B, N, H) if with_lse else None
    torch.library.opcheck(
        torch.ops.treeops.tree_attention.default,
        (s["q"], s["k_cache"], s["v_cache"], s["block_table"], s["seq_lens"],
         *s["tree"].tensors(), None, None, 0.125, out, lse, None),
    )  # fmt: skip


_CANDIDATES = [(d, name) for d, c in K.CANDIDATES.items() for name in c] + [
    (d, "small") for d in K.CANDIDATES
]


@settings(max_examples=20)
@given(
    cand=st.sampled_from(_CANDIDATES),
    tc=trees(max_batch=2, capacities=(1, 8, 16, 32)),
    data=st.data(),
)
def test_every_sweep_candidate_matches_reference(cand, tc, data):
    """Each launch configuration the GPU sweep times (CANDIDATES and the small-tree path), forced
    under the interpreter at its GPU tile sizes: the tl.range-pipelined prefix loop with 0, 1 and
    several full tiles, ragged tails, query ranges, forced splits."""
    D, name = cand
    override = {"small_tree": True} if name == "small" else K.CANDIDATES[D][name]
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    B, N = tc.tree.batch_size, tc.tree.capacity
    group = data.draw(st.sampled_from([1, 4, 8]))
    H_kv = data.draw(st.sampled_from([1, 2]))
    dtype = data.draw(st.sampled_from([torch.float16, torch.float32]))
    page = data.draw(st.sampled_from([1, 16, 64, None]))
    seq = [data.draw(st.sampled_from([0, 5, 64, 130, 300])) for _ in range(B)]
    kv = paged_kv([s + N for s in seq], page, H_kv, D, dtype, rng)
    q = torch.randn(B, N, H_kv * group, D).to(dtype)
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    qs = ql = None
    if data.draw(st.booleans()):
        qs = torch.tensor([rng.randrange(N + 1) for _ in range(B)], dtype=torch.int32)
        ql = torch.tensor([rng.randrange(N + 1) for _ in range(B)], dtype=torch.int32)
    splits = data.draw(st.sampled_from([None, 1, 3]))
    check_kernel(
        q, kv, seq_lens, tc.tree, qs, ql, num_splits=splits, override=override,
        what=f"D={D} {name} page={page} group={group} {dtype} splits={splits}",
    )  # fmt: skip


def test_candidates_pipeline_and_tuned_routes_only_unsplit_launches():
    """The candidates leave the loads to Triton's pipeliner or are the default. Where the Gluon
    tile does not apply (here: fp32), a default launch takes TUNED's candidate where that tile
    fills the GPU unsplit, the hand-prefetched built-in tiles elsewhere (or where a split count
    above 1 is asked for); SMALL_TREE stays off."""
    for d, cands in K.CANDIDATES.items():
        assert cands["default"] == {}
        for name, ov in cands.items():
            cfg = K.pick_config(4, 64, 32, 8, d, 4096, 132, False, override=ov)
            # every other candidate but the former built-in D 256 tile leaves the loads to
            # Triton's pipeliner (tl.range or stages)
            assert name in ("default", "m64_prefetch") or not cfg.prefetch, (d, name)
    assert KC.SMALL_TREE is False
    for d, name in K.TUNED.items():
        assert name in K.CANDIDATES[d] and name != "default"
    f32 = dict(elem_bytes=4)
    cfg = K.pick_config(1, 64, 32, 8, 128, 4096, 132, False, **f32)  # 16 programs: split
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages) == (128, 64, 8, 1)
    assert cfg.prefetch and cfg.pipe == 0 and cfg.num_splits > 1 and not cfg.gluon
    # D 256: no TUNED or GLUON entry; the built-in tile is two warpgroups of 64 rows in Triton's
    # two-stage loop at 16-bit dtypes, 64 rows with the hand prefetch at fp32 (shared memory)
    assert 256 not in K.TUNED and 256 not in KC.GLUON
    # (or on a GPU with 99 KiB of shared memory a block)
    for elem, shared, want in [
        (2, 232448, (128, 32, 8, 2, False)),
        (4, 232448, (64, 32, 8, 2, True)),
        (2, 101376, (64, 32, 8, 2, True)),
    ]:
        c = K.pick_config(32, 64, 16, 4, 256, 4096, 132, False, elem_bytes=elem, max_shared=shared)
        assert (c.block_m, c.block_n, c.num_warps, c.num_stages, c.prefetch) == want, elem
        assert not c.gluon
    for B, d in [(8, 128), (32, 64)]:  # the sweep's unsplit shapes
        routed = K.pick_config(B, 64, 32, 8, d, 4096, 132, False, **f32)
        tuned = K.CANDIDATES[d][K.TUNED[d]]
        assert routed == K.pick_config(B, 64, 32, 8, d, 4096, 132, False, override=tuned, **f32)
        assert routed.num_splits == 1 and routed.block_m == tuned["block_m"]
    # the boundary: 8 KV heads x 4 tiles of 16 nodes = 32 programs a request; 132 SMs
    assert K.pick_config(5, 64, 32, 8, 128, 4096, 132, False, **f32).pipe == 3  # 160: a wave
    assert K.pick_config(4, 64, 32, 8, 128, 4096, 132, False, **f32).pipe == 0  # 128: built-in
    forced = K.pick_config(8, 64, 32, 8, 128, 4096, 132, False, num_splits=2, **f32)
    assert forced.pipe == 0 and forced.num_splits == 2


def test_gluon_is_the_default_tile_where_it_applies():
    """16-bit inputs at head dim 64 or 128: a default launch, split or not, takes GLUON's
    candidate where its tile has 16 rows a warp; with fewer rows (an 8-node tree of 4 query
    heads: 32 rows for 4 warps), fp32, another head dim or under the interpreter it does not."""
    for d in (64, 128):
        gl = K.CANDIDATES[d][KC.GLUON[d]]
        for B, splits in [(1, None), (8, None), (32, None), (8, 2)]:
            routed = K.pick_config(B, 64, 32, 8, d, 4096, 132, False, num_splits=splits)
            assert routed.gluon, (d, B)
            assert routed == K.pick_config(
                B, 64, 32, 8, d, 4096, 132, False, num_splits=splits, override=gl
            )
        assert not K.pick_config(8, 64, 32, 8, d, 4096, 132, False, elem_bytes=4).gluon
        assert not K.pick_config(8, 64, 32, 8, d, 4096, 132, True).gluon
        # 16 nodes x 4 heads = 64 rows: enough for both head dims' 4-warp tiles
        assert K.pick_config(64, 16, 32, 8, d, 4096, 132, False).gluon
    few = K.pick_config(64, 8, 32, 8, 128, 4096, 132, False)
    assert not few.gluon
    assert few == K.pick_config(
        64, 8, 32, 8, 128, 4096, 132, False, override=K.CANDIDATES[128][K.TUNED[128]]
    )
    assert not K.pick_config(8, 64, 32, 8, 96, 4096, 132, False).gluon


def test_two_programs_an_sm_double_the_splits_of_an_underfilled_grid():
    """D 128's default tile sizes its split count for two programs an SM: where one program an
    SM leaves the GPU half empty (B 1: 8 KV heads x 4 query tiles = 32 unsplit programs on 132
    SMs) it takes twice the splits of the same tile at one an SM; a grid that fills the GPU
    unsplit stays unsplit."""
    one = K.CANDIDATES[128]["gluon_m64_n64"]
    two = K.CANDIDATES[128][KC.GLUON[128]]
    assert two.get("programs_per_sm") == 2
    for B, cap, want_one, want_two in [
        (1, 16384 + 64, 4, 8),
        (1, 1024 + 64, 4, 8),
        (8, 4160, 1, 1),
    ]:
        assert (
            K.pick_config(B, 64, 32, 8, 128, cap, 132, False, override=one).num_splits == want_one
        )
        got = K.pick_config(B, 64, 32, 8, 128, cap, 132, False)
        assert got.gluon and got.num_splits == want_two, (B, cap, got)


def test_small_tree_path_is_one_launch_from_capacities(monkeypatch):
    """Few nodes and a short block table: one query tile holding every node and head of the
    group, no split (so no merge launch); chosen from capacities only, ignored where it does not
    apply; SMALL_TREE and TUNED route the default launch."""
    small = {"small_tree": True}
    cfg = K.pick_config(1, 8, 32, 8, 128, 528, 132, False, override=small)
    assert cfg.num_splits == 1 and cfg.block_q >= 8 and cfg.pipe > 0
    assert K.pick_config(1, 8, 32, 8, 128, 528, 132, False).num_splits > 1  # default: splits
    big_n = K.pick_config(1, 64, 32, 8, 128, 528, 132, False, override=small)
    assert big_n == K.pick_config(1, 64, 32, 8, 128, 528, 132, False, override={})
    assert not K.small_tree_applies(8, 4, 128, 4096)  # long block table
    assert not K.small_tree_applies(16, 8, 256, 512)  # 128 rows at D = 256 would spill
    monkeypatch.setattr(KC, "SMALL_TREE", True)
    assert K.pick_config(1, 8, 32, 8, 128, 528, 132, False) == cfg
    monkeypatch.setattr(KC, "SMALL_TREE", False)
    monkeypatch.setattr(KC, "GLUON", {})  # TUNED routes where the Gluon tile does not
    monkeypatch.setattr(KC, "TUNED", {128: "m64_pipe2"})  # the routing, whatever TUNED holds
    tuned = K.pick_config(8, 64, 32, 8, 128, 4096, 132, False)
    assert tuned == K.pick_config(
        8, 64, 32, 8, 128, 4096, 132, False, override=K.CANDIDATES[128]["m64_pipe2"]
    )
    assert K.pick_config(8, 64, 32, 8, 128, 4096, 132, True).pipe == 0  # interpreter: its tiles


def test_gluon_candidates_only_where_the_gluon_forward_applies():
    """A "gluon" override takes tree_attention_gluon's forward in compiled runs of 16-bit inputs
    at D <= 128 whose query tile holds 16 rows a warp; the interpreter, fp32, D 256, 32-key tiles
    and small trees keep the Triton kernel at the same tiles. Never fused, never half partials,
    at least one tile copied ahead."""
    ov = K.CANDIDATES[64]["gluon_m64_n128"]
    on = K.pick_config(8, 64, 32, 8, 128, 4096, 132, False, override=ov)
    assert on.gluon and not on.p_smem and on.pipe >= 1 and (on.block_m, on.block_n) == (64, 128)
    assert not K.pick_config(8, 64, 32, 8, 128, 4096, 132, True, override=ov).gluon
    assert not K.pick_config(8, 64, 32, 8, 128, 4096, 132, False, override=ov, elem_bytes=4).gluon
    assert not K.pick_config(8, 64, 16, 4, 256, 4096, 132, False, override=ov).gluon
    assert not K.pick_config(
        8, 64, 32, 8, 128, 4096, 132, False, override={**ov, "block_n": 32}
    ).gluon
    assert not K.pick_config(1, 8, 32, 8, 128, 4096, 132, False, override=ov).gluon  # 32 rows
    ps = K.CANDIDATES[128]["gluon_m128_n64_ps"]
    one = K.pick_config(1, 64, 32, 8, 128, 4096, 132, False, override={**ps, "fused_merge": True,
                        "partial_half": True})  # fmt: skip
    assert one.gluon and one.p_smem and one.num_splits > 1
    assert not one.fused_merge and not one.partial_half


def test_gluon_forward_takes_only_calls_it_can_copy(monkeypatch):
    """``launchable``: a Hopper device (``device_ok``), 16-bit q and caches of one dtype, D 64 or
    128, unit last strides, 16-byte aligned pointers, other strides multiples of 8 elements."""
    from treeops.kernels import tree_attention_gluon as KG

    q = torch.zeros(2, 16, 8, 128, dtype=torch.bfloat16)
    kc = torch.zeros(10, 16, 2, 128, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    assert not KG.launchable(q, kc, kc, out)  # a CPU tensor
    monkeypatch.setattr(KG, "device_ok", lambda q: True)
    assert KG.launchable(q, kc, kc, out) == KG.AVAILABLE
    if not KG.AVAILABLE:
        return
    assert not KG.launchable(q.float(), kc.float(), kc.float(), out.float())
    assert not KG.launchable(q, kc.half(), kc, out)
    assert not KG.launchable(q[..., :96], kc[..., :96], kc[..., :96], out[..., :96])
    assert not KG.launchable(q.transpose(2, 3), kc, kc, out)  # non-unit last stride
    shifted = torch.zeros(kc.numel() + 8, dtype=kc.dtype)[4 : 4 + kc.numel()].view(kc.shape)
    assert not KG.launchable(q, shifted, kc, out)  # 8 bytes past a 16-byte boundary
    odd = torch.zeros(2, 16, 8, 132, dtype=torch.bfloat16)[..., :128]  # row stride 132
    assert not KG.launchable(odd, kc, kc, out)


def test_small_tree_path_through_the_launcher(monkeypatch):
    """SMALL_TREE routes a default launch through the small-tree path: same result as the
    reference, and no split workspace is needed."""
    rng = random.Random(11)
    N = 8
    tree = make_tree([parents_of("random", 8, rng), parents_of("chain", 5, rng)], N, 64, rng)
    seq = [500, 33]
    kv = paged_kv([s + N for s in seq], 16, 2, 64, torch.float16, rng)
    q = torch.randn(2, N, 8, 64).to(torch.float16)
    monkeypatch.setattr(KC, "SMALL_TREE", True)
    monkeypatch.setattr(KC, "interpreted", lambda: False)  # the compiled path's choice
    monkeypatch.setattr(KC._runtime, "sm_count", lambda device: 132)
    K._PLANS.clear()
    try:
        cfg = K.config_for(q, kv.k_cache, kv.block_table)
        assert cfg.num_splits == 1 and K.workspace_numel(2, N, 8, 64, cfg) == 0
        for module in (K, KC):  # the kernels must upcast, on the interpreter's tiles
            monkeypatch.setattr(module, "interpreted", lambda: True)
        check_kernel(
            q, kv, torch.tensor(seq, dtype=torch.int32), tree, override={"small_tree": True}
        )
    finally:
        K._PLANS.clear()
