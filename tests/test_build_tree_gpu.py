"""GPU tests of the tree build and CAST kernels (compiled, realistic vocabularies).

Run on the H200: ``TREEOPS_GPU_TESTS=1 python -m pytest tests/test_build_tree_gpu.py``. The
``memcheck`` cases use a fixed table of shapes so that ``compute-sanitizer --tool memcheck python
-m pytest tests/test_build_tree_gpu.py -k memcheck`` compiles each kernel once per shape.

GPU ``exp`` and division differ from the float64 reference by a few ulps, so candidate scores
can order differently where two are within rounding of each other. The checks are therefore:
top-k tokens and parents exact (they depend on logits only), scores close, and every ranking
(frontier, rerank) exact against the kernel's *own* scores, computed independently on the host;
decisions against the reference applied to the kernel's state.
"""

from __future__ import annotations

import pytest
import torch

import treeops
from helpers import assert_close
from treeops.build_tree import _launch_emit, _launch_expand
from treeops.reference import build_tree as RB

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _table(B, n_max=128):
    # docs/benchmarks.md's curve: flat to ~100 tokens, then linear; a one-layer draft much cheaper
    return treeops.CostTable.from_functions(
        lambda b, c, n: 130.0 + c / 4096 + max(0, b * n - 96) * 0.6,
        lambda b, c, n: 20.0 + c / 16384 + max(0, b * n - 256) * 0.05,
        batch_sizes=[1, 8, 64],
        L=1024,
        M=8,
        n_max=n_max,
        meta={"gpu": "synthetic"},
    )


def _policy(kind, W=10, K=10, D=8, N=64, B=8, C=(0.3, 0.05, 0.02), R=4):
    if kind == "eagle":
        return treeops.EagleStatic(depth=D, topk=W, budget=N)
    return treeops.Cast(
        C1=C[0], C2=C[1], C3=C[2], R=R, cost_table=_table(B, max(N, W)), topk=K, max_width=W,
        max_depth=D, capacity=N,
    )  # fmt: skip


def _cpu_state(st):
    return st.to("cpu")


def _host_frontier(cand_scores_layer, W):
    """Top-W of one layer's candidates by (score desc, index asc), from the kernel's floats."""
    s = cand_scores_layer.cpu()
    order = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :W]
    return order, s.gather(1, order)


def _run(policy, B, V, dtype, seed, active=None, seq=None, logits_of=None, root_row=False):
    """Drafts ``policy``'s tree layer by layer on random logits (``logits_of(B, W, V, g)``,
    default N(0, 3); with ``root_row``, layer 0 gets the root's row alone, a [B, 1, V] view),
    checking each layer and the emitted tree against the reference."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    roots = torch.randint(0, V, (B,), device=DEV, generator=g)
    seq = torch.randint(0, 20000, (B,), device=DEV, generator=g) if seq is None else seq
    st = treeops.DraftState.new(policy, roots, seq, active)
    W, K = policy.max_width, policy.topk
    C = W * K
    i = 0
    while st.wants_next_layer():
        if logits_of is None:
            logits = (torch.randn(B, W, V, device=DEV, generator=g) * 3).to(dtype)
        else:
            logits = logits_of(B, W, V, g).to(dtype)
        if root_row and i == 0:
            logits = logits[:, :1]
        before = _cpu_state(st)
        treeops.build_tree_expand(logits, st, policy)
        # reference applied to the kernel's state before this layer
        RB.build_tree_expand(logits.cpu(), before, policy)
        assert torch.equal(st.cand_tokens[:, i].cpu(), before.cand_tokens[:, i]), f"layer {i}"
        assert torch.equal(st.cand_parents[:, i].cpu(), before.cand_parents[:, i]), f"layer {i}"
        assert_close(
            st.cand_scores[:, i].clamp(min=0),
            before.cand_scores[:, i].clamp(min=0),
            torch.float32,
            f"layer {i} scores",
        )
        order, top = _host_frontier(st.cand_scores[:, i], W)
        n = int(st.decisions[i])
        assert n == int(before.decisions[i]), f"layer {i} width"
        flag = policy.max_depth + i
        assert int(st.decisions[flag]) == int(before.decisions[flag]), f"layer {i} depth flag"
        keep = (torch.arange(W)[None, :] < n) & (top >= 0)
        want = torch.where(keep, i * C + order, -1).to(torch.int32)
        assert torch.equal(st.frontier.cpu(), want), f"layer {i} frontier"
        assert st.width(i) == n  # pinned host copy agrees
        i += 1
    final = _cpu_state(st)
    tree = treeops.build_tree_emit(st, policy)
    want = RB.build_tree_emit(final, policy)
    assert st.verify_count() == int(final.decisions[-1])
    for f in ("tokens", "parents", "num_nodes", "depth", "anc", "first_child", "next_sibling"):
        assert torch.equal(getattr(tree, f).cpu(), getattr(want, f)), f
    assert_close(tree.scores, want.scores, torch.float32, "tree scores")
    tree.validate()
    return st, tree


@pytest.mark.parametrize("kind", ["eagle", "cast"])
@pytest.mark.parametrize(
    "B,V,dtype",
    [
        (1, 32000, torch.bfloat16),
        (8, 128256, torch.bfloat16),
        (64, 32000, torch.bfloat16),
        (5, 50257, torch.float32),
        (3, 1000, torch.float16),
    ],
)
def test_realistic(kind, B, V, dtype):
    _run(_policy(kind, B=B), B, V, dtype, seed=B * 31 + V)


# ties under EAGLE alone: CAST's width on exactly tied sums would test float rounding
@pytest.mark.parametrize("kind, ties", [("eagle", False), ("cast", False), ("eagle", True)])
@pytest.mark.parametrize("B,V", [(1, 32000), (16, 128256), (64, 32000)])
def test_root_row_logits_at_layer_0(kind, ties, B, V):
    """Layer 0 from [B, 1, V] logits (the root's row alone: its stream split for B rows, one
    per-row program a request), then full layers: each layer and the tree against the
    reference."""
    _run(
        _policy(kind, B=B), B, V, torch.bfloat16, seed=B + V + 7,
        logits_of=_ties_and_masks if ties else None, root_row=True,
    )  # fmt: skip


def _ties_and_masks(B, W, V, g):
    """Logits of four values (equal maxima in many tiles: the top-K pass's tile order and the
    lower id decide) with about half the vocabulary masked to -inf."""
    x = torch.randint(0, 4, (B, W, V), device=DEV, generator=g).float()
    return torch.where(torch.rand(B, W, V, device=DEV, generator=g) < 0.5, float("-inf"), x)


@pytest.mark.parametrize("B,V", [(1, 32000), (64, 32000), (8, 128256)])
def test_ties_across_tiles_and_masked_vocabulary(B, V):
    """The split expand (default tiling) where the top-K is a choice among equal logits spread
    over many tiles: tokens exact against the reference (the lower id wins). EAGLE's fixed
    width: CAST's width rule on exactly tied sums would test float rounding, not the top-K."""
    _run(_policy("eagle", B=B), B, V, torch.bfloat16, seed=B + V, logits_of=_ties_and_masks)


@pytest.mark.parametrize("B,V", [(1, 32000), (64, 32000), (8, 128256)])
@pytest.mark.parametrize("ties", [False, True])
def test_top_k_methods_agree(B, V, ties):
    """The split expand's top-K methods on the same logits, two layers: candidates ranked at once
    (``cand_cap`` 16, 32, 64; one to sixteen blocks a read; rows with more candidates than the
    cap take the merge), a max recorded per 512-token tile or per block of 256 to 32 tokens
    (``max_block``; None: the default), per-row programs of 2 or 8 warps (``row_warps``), the K
    best blocks or the ranked candidates by one ``tl.topk`` (``blocks_topk``, ``rank_topk``; off
    unless named), the stream's max and sum per tile (``tile_stats``: ``stream_lanes`` off),
    two-warp streaming programs over 1,024-token tiles (``two_warps``) and the launcher's
    defaults (``defaults``), give exactly the tile-by-tile
    merge's (``cand_cap`` 0) tokens, parents and frontier: integers, compared exactly."""
    pol = _policy("eagle", B=B, D=2)
    W = pol.max_width
    g = torch.Generator(device=DEV).manual_seed(B + V + ties)
    roots = torch.randint(0, V, (B,), device=DEV, generator=g)
    seq = torch.full((B,), 100, device=DEV)
    if ties:
        logits = [_ties_and_masks(B, W, V, g).to(torch.bfloat16) for _ in range(2)]
    else:
        logits = [(torch.randn(B, W, V, device=DEV, generator=g) * 3).to(torch.bfloat16)
                  for _ in range(2)]  # fmt: skip
    got = {}
    configs = [(0, 1, 512, 4), (16, 4, None, 4), (32, 1, None, 4), (32, 2, 512, 4),
               (64, 4, 256, 4), (32, 8, 512, 4), (32, 16, 512, 4), (32, 4, 128, 4),
               (32, 8, 32, 4), (0, 1, 64, 4), (32, 2, None, 2), (32, 4, None, 8),
               (32, 4, None, 4, "blocks_topk", "rank_topk"), (32, 1, None, 4, "blocks_topk"),
               (16, 4, 64, 4, "rank_topk"), (32, None, None, None, "defaults"),
               (32, 1, None, 4, "cand_ahead"), (32, 4, None, 4, "cand_ahead"),
               (32, 4, None, 4, "tile_stats"), (32, 1, 64, 4, "tile_stats"),
               (32, 1, 512, 4, "tile_stats"), (32, 4, None, 4, "two_warps"),
               (32, 1, 64, 4, "two_warps")]  # fmt: skip
    for cap, tiles, mb, rw, *topks in configs:
        st = treeops.DraftState.new(pol, roots, seq)
        named = ("blocks_topk", "rank_topk", "cand_ahead")
        kw = {} if "defaults" in topks else {k: k in topks for k in named}
        if "tile_stats" in topks:
            kw["stream_lanes"] = False
        if "two_warps" in topks:  # the stream's programs of two warps over 1,024-token tiles
            kw.update(block_v=1024, num_warps=2)
        for i, x in enumerate(logits):
            _launch_expand(
                x, st, pol, cand_cap=cap, cand_tiles=tiles, max_block=mb, row_warps=rw, **kw
            )  # fmt: skip
            st.layer = i + 1
        got[(cap, tiles, mb, rw, *topks)] = (
            st.cand_tokens.cpu(), st.cand_parents.cpu(), st.frontier.cpu(),
        )  # fmt: skip
    want = got.pop((0, 1, 512, 4))
    for cfg, have in got.items():
        for name, a, b in zip(("cand_tokens", "cand_parents", "frontier"), have, want):
            assert torch.equal(a, b), f"{cfg} {name}"


def test_inactive_rows_and_small_widths():
    B = 6
    active = torch.tensor([True, False, True, True, False, True], device=DEV)
    pol = treeops.Cast(
        C1=2.0,
        C2=0.5,
        C3=0.2,
        R=2,
        cost_table=_table(B),
        topk=4,
        max_width=6,
        max_depth=5,
        capacity=32,
    )
    st, tree = _run(pol, B, 4096, torch.bfloat16, seed=3, active=active)
    assert tree.num_nodes.cpu().tolist()[1] == 0 and tree.num_nodes.cpu().tolist()[4] == 0


def test_issue_4_caps_reach_the_pinned_decisions():
    """Flat cost tables (issue #4): CAST's width and verify count are capped at what exists, on
    the device and in the pinned host copy that ``width``/``verify_count`` read. B = 1, W = 4,
    K = 2: layer 0 has 2 candidates (width 2, not 4); 6 candidates make a 7-node tree (verify 7,
    not 16). Then a ragged batch on flat tables through ``_run`` (kernel == reference)."""
    flat = treeops.CostTable.from_functions(
        lambda b, c, n: 64.0, lambda b, c, n: 8.0, [1, 8], 1024, 1, 16
    )
    pol = treeops.Cast(
        C1=1.0, C2=0.0, C3=0.5, R=2, cost_table=flat, topk=2, max_width=4, max_depth=2, capacity=16
    )
    g = torch.Generator(device=DEV).manual_seed(4)
    st = treeops.DraftState.new(pol, torch.tensor([3], device=DEV), torch.tensor([100], device=DEV))
    for i in range(2):
        treeops.build_tree_expand(torch.randn(1, 4, 1000, device=DEV, generator=g), st, pol)
        assert st.width(i) == [2, 4][i]
    tree = treeops.build_tree_emit(st, pol)
    assert st.verify_count() == 7 == int(tree.num_nodes[0])
    assert st.host_decisions.tolist() == st.decisions.cpu().tolist()
    B = 6
    active = torch.tensor([True, False, True, True, False, True], device=DEV)
    flat8 = treeops.CostTable.from_functions(
        lambda b, c, n: 100.0, lambda b, c, n: 10.0, [8], 1024, 2, 64
    )
    pol = treeops.Cast(
        C1=0.0, C2=0.0, C3=0.0, R=2, cost_table=flat8, topk=3, max_width=8, max_depth=3, capacity=64
    )
    st, tree = _run(pol, B, 4096, torch.bfloat16, seed=5, active=active)
    assert st.verify_count() == int(tree.num_nodes.max()) < 64
    assert st.width(0) == 3  # the root's top-3: the only candidates of layer 0


def test_decisions_published_on_the_current_stream():
    """``publish`` (CAST's) records each decision point's event on the stream current at the
    call (a side stream here, the kept stream objects of ``_runtime.current_stream``), so
    ``width`` waits for that stream's expand and reads its decision; back on the default
    stream, the default stream's."""
    from treeops import _runtime

    flat = treeops.CostTable.from_functions(
        lambda b, c, n: 100.0, lambda b, c, n: 10.0, [2], 1024, 2, 64
    )
    # C1 = 0: every width pays, so layer i's width is the frontier's 3 rows
    pol = treeops.Cast(
        C1=0.0, C2=0.0, C3=0.0, R=2, cost_table=flat, topk=3, max_width=3, max_depth=2, capacity=8
    )
    side = torch.cuda.Stream()
    g = torch.Generator(device=DEV).manual_seed(6)
    logits = torch.randn(2, 3, 5000, device=DEV, generator=g)
    st = treeops.DraftState.new(
        pol, torch.tensor([3, 4], device=DEV), torch.tensor([9, 9], device=DEV)
    )
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        assert _runtime.current_stream(0) == side
        torch.cuda._sleep(50_000_000)  # the expand queues behind a long kernel on the side stream
        treeops.build_tree_expand(logits, st, pol)
    assert _runtime.current_stream(0) == torch.cuda.current_stream()
    assert st.width(0) == 3  # waited for the side stream's event
    assert st.host_decisions.tolist() == st.decisions.cpu().tolist()
    torch.cuda.current_stream().wait_stream(side)
    treeops.build_tree_expand(logits, st, pol)
    assert st.width(1) == 3 and st.host_decisions.tolist() == st.decisions.cpu().tolist()


@pytest.mark.parametrize("B", [64, 2])  # 2: several programs per row (split V)
def test_cuda_graph_replay_matches_eager(B):
    """Capture one expand (and the emit) in CUDA graphs; replay many times with new logits: the
    arrival counters must come back to 0 every time and the results equal eager runs."""
    W, V = 10, 32000
    pol = _policy("cast", B=B)
    g = torch.Generator(device=DEV).manual_seed(0)
    roots = torch.randint(0, V, (B,), device=DEV, generator=g)
    seq = torch.full((B,), 3000, device=DEV)
    static_logits = torch.randn(B, W, V, device=DEV, generator=g).to(torch.bfloat16)
    st = treeops.DraftState.new(pol, roots, seq)
    out = treeops.Tree.empty(B, pol.capacity, DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (compiles) outside the capture
        _launch_expand(static_logits, st, pol)
        _launch_emit(st, pol, out=out)
    torch.cuda.current_stream().wait_stream(s)
    st.reset(roots, seq)
    graph_expand, graph_emit = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph_expand):
        _launch_expand(static_logits, st, pol)
    st.layer = 1
    with torch.cuda.graph(graph_emit):
        _launch_emit(st, pol, out=out)
    eager = treeops.DraftState.new(pol, roots, seq)
    for rep in range(20):
        x = (torch.randn(B, W, V, device=DEV, generator=g) * (1 + rep % 4)).to(torch.bfloat16)
        static_logits.copy_(x)
        st.reset(roots, seq)
        graph_expand.replay()
        st.layer = 1
        graph_emit.replay()
        eager.reset(roots, seq)
        _launch_expand(x, eager, pol)
        eager.layer = 1
        ref_tree = _launch_emit(eager, pol)
        torch.cuda.synchronize()
        for name in ("counters", "row_counters"):
            if name in st.workspace:
                assert int(st.workspace[name].abs().sum()) == 0, name
        for f in ("cand_tokens", "cand_scores", "cand_parents", "frontier", "decisions"):
            assert torch.equal(getattr(st, f), getattr(eager, f)), (rep, f)
        for f in ("tokens", "parents", "num_nodes", "anc", "first_child", "next_sibling"):
            assert torch.equal(getattr(out, f), getattr(ref_tree, f)), (rep, f)


class _WholeStep:
    """A draft step of EAGLE at depth 4 (reset, the root layer's [B, 1, V] logits, then [B, W,
    V] layers, the emit) over logit buffers that ``fill`` rewrites in place, so a captured step
    replays with new logits; ``new()`` a state and an output tree for it, ``same(a, b)`` the
    bitwise comparison of two (state, tree) pairs."""

    STATE = ("cand_tokens", "cand_scores", "cand_parents", "frontier", "decisions")

    def __init__(self, B: int, seed: int, V: int = 32000):
        self.B, self.pol = B, _policy("eagle", D=4)
        W, D = self.pol.max_width, self.pol.max_depth
        self.g = torch.Generator(device=DEV).manual_seed(seed)
        self.roots = torch.randint(0, V, (B,), device=DEV, generator=self.g)
        self.seq = torch.full((B,), 3000, device=DEV)
        self.logits = [torch.zeros(B, 1 if i == 0 else W, V, device=DEV, dtype=torch.bfloat16)
                       for i in range(D)]  # fmt: skip

    def new(self):
        return treeops.DraftState.new(self.pol, self.roots, self.seq), treeops.Tree.empty(
            self.B, 64, DEV
        )

    def fill(self, rep: int) -> None:
        for x in self.logits:
            x.copy_(torch.randn(x.shape, device=DEV, generator=self.g) * (1 + rep % 3))

    def __call__(self, st, out):
        st.reset(self.roots, self.seq)
        for i, x in enumerate(self.logits):
            st.layer = i
            _launch_expand(x, st, self.pol)
        st.layer = self.pol.max_depth
        return _launch_emit(st, self.pol, out=out)

    def capture(self, st, out) -> torch.cuda.CUDAGraph:
        """One eager step on a side stream (compiles, builds the workspace), then the graph."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            self(st, out)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self(st, out)
        return graph

    def same(self, a, b, rep: int) -> None:
        (sa, ta), (sb, tb) = a, b
        for f in self.STATE:
            assert torch.equal(getattr(sa, f), getattr(sb, f)), (rep, f)
        for f in treeops.Tree.FIELDS:
            assert torch.equal(getattr(ta, f), getattr(tb, f)), (rep, f)


@pytest.mark.parametrize("B", [1, 16, 64])
def test_captured_step_matches_eager(B):
    """A whole step captured in one CUDA graph after an eager warm-up, replayed with new logits:
    bitwise the state and tree of eager steps. At B 16 and 64 the root layer's rows (B <= SMs)
    and the later layers' (B * W > SMs) record maxima over different blocks, so the split
    workspace must serve both without a rebuild inside the capture."""
    step = _WholeStep(B, seed=100 + B)
    eager, graphed = step.new(), step.new()
    graph = step.capture(*graphed)
    for rep in range(6):
        step.fill(rep)
        graph.replay()
        step(*eager)
        torch.cuda.synchronize()
        step.same(graphed, eager, rep)


@pytest.mark.parametrize("mode", ["late", "early"])
@pytest.mark.parametrize("B", [1, 64])
def test_pdl_launches_match_plain(B, mode, monkeypatch):
    """Programmatic dependent launch (kernels/_pdl.py, ``TREEOPS_PDL=1`` or ``early``): a whole
    step (reset, every layer's two launches, the emit's one or two) chained on one stream,
    eagerly and as a CUDA graph replayed with new logits, gives bitwise the state and tree of plain
    launches
    (every PDL kernel waits for the one before it before it touches memory), the next kernel
    released after each kernel's main work or at its start."""
    from treeops.kernels import _pdl
    from treeops.kernels import build_tree as kb

    on = {"late": _pdl.PDL_LATE, "early": _pdl.PDL_EARLY}[mode].value
    step = _WholeStep(B, seed=B)
    plain, piped = step.new(), step.new()
    step.fill(0)
    step(*plain)  # compiles the plain launches
    monkeypatch.setattr(kb, "use_pdl", lambda device, default=0: on)
    graph = step.capture(*piped)  # the PDL launches compiled outside the capture
    for rep in range(12):
        step.fill(rep)
        if rep % 2:
            graph.replay()
        else:
            step(*piped)  # eager PDL launches
        monkeypatch.setattr(kb, "use_pdl", lambda device, default=0: 0)
        step(*plain)
        monkeypatch.setattr(kb, "use_pdl", lambda device, default=0: on)
        torch.cuda.synchronize()
        step.same(piped, plain, rep)
        assert int(piped[0].workspace["counters"].abs().sum()) == 0, rep


def test_stress_arrival_counters():
    """Many programs racing for the arrival counters (B*W = 1280 programs, small V so they finish
    together): every launch must produce the decision exactly once and reset the counters."""
    B, W, V = 128, 10, 512
    pol = _policy("cast", B=B)
    g = torch.Generator(device=DEV).manual_seed(1)
    st = treeops.DraftState.new(
        pol, torch.zeros(B, dtype=torch.int64, device=DEV), torch.full((B,), 100, device=DEV)
    )
    frontier_scores = torch.rand(B, W, device=DEV, generator=g)
    for rep in range(200):
        st.frontier_scores.copy_(frontier_scores)
        st.layer = 0
        logits = torch.randn(B, W, V, device=DEV, generator=g)
        _launch_expand(logits, st, pol)
        if rep % 50 == 0 or rep == 199:
            torch.cuda.synchronize()
            assert int(st.workspace["counters"].abs().sum()) == 0, rep
            order, top = _host_frontier(st.cand_scores[:, 0], W)
            n = int(st.decisions[0])
            keep = (torch.arange(W)[None, :] < n) & (top >= 0)
            assert torch.equal(st.frontier.cpu(), torch.where(keep, order, -1).to(torch.int32))
    torch.cuda.synchronize()
    assert int(st.workspace["counters"].abs().sum()) == 0


@pytest.mark.parametrize(
    "kind,B,W,K,V,D,N",
    [
        ("eagle", 2, 4, 4, 1000, 3, 16),
        ("cast", 3, 10, 10, 4099, 4, 64),
        ("eagle", 1, 10, 10, 32000, 2, 128),
    ],
)
def test_memcheck(kind, B, W, K, V, D, N):
    """A fixed table for compute-sanitizer (odd V: the masked tail of the row)."""
    pol = _policy(kind, W, K, D, N, B, C=(0.1, 0.01, 0.01), R=2)
    _run(pol, B, V, torch.bfloat16, seed=7)
