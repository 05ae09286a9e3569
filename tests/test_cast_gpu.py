"""GPU tests of the standalone CAST ops (treeops.kernels.cast compiled).

Run on the H200: ``TREEOPS_GPU_TESTS=1 python -m pytest tests/test_cast_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

import treeops
from treeops.reference import cast as ref


@pytest.mark.gpu
def test_cast_ops_on_the_gpu_match_the_reference_and_capture():
    """On CUDA the ops run the kernels: equal to the CPU reference on dyadic inputs, opcheck, and
    captured in a CUDA graph that replays on new values in the same buffers."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(5)

    def dyadic(B, M):
        s = torch.randint(-8, 65, (B, M), generator=g).float() / 64
        return torch.where(s < 0, -1.0, s)

    for B, M, K in [(1, 100, 10), (8, 100, 10), (64, 800, 64), (33, 7, 40), (5, 300, 200)]:
        s = dyadic(B, M)
        costs = torch.cumsum(torch.randint(0, 9, (K,), generator=g).float(), 0) / 16 + 1
        a = torch.rand(B, generator=g) < 0.8
        for C in (0.0, 0.25, 2.0):
            for fn, rule in ((treeops.cast_width, ref.cast_width),
                             (treeops.cast_rerank, ref.cast_rerank)):  # fmt: skip
                got = fn(s.to(dev), costs.to(dev), C, active=a.to(dev))
                assert got.is_cuda and int(got) == int(rule(s, costs, C, a)), (B, M, K, C)
                got = fn(s.to(dev, torch.bfloat16), costs.to(dev), C)
                assert int(got) == int(rule(s, costs, C)), (B, M, K, C)
    u = torch.tensor([1.0, 0.5, 0.25, 0.5, 1.0])
    for R in (1, 2, 4, 8):
        got = treeops.cast_depth(u.to(dev), torch.tensor(0.25, device=dev), 1.0, R)
        assert bool(got) == bool(ref.cast_depth(u, torch.tensor(0.25), 1.0, R))
    # opcheck of the CUDA backends
    s, costs = dyadic(4, 50).to(dev), (torch.arange(1, 9, dtype=torch.float32) / 4).to(dev)
    table = torch.stack([costs, 2 * costs, 3 * costs])  # per context bucket
    seq = torch.tensor([300, 40, 7, 129], dtype=torch.int32, device=dev)
    no_table = (None, 0, None)
    for op, args in [
        (torch.ops.treeops.cast_select.default, (costs.cumsum(0), costs, 0.5)),
        (torch.ops.treeops.cast_width.default, (s, costs, 0.125, None, *no_table)),
        (torch.ops.treeops.cast_width.default, (s, table, 0.125, None, seq, 128, None)),
        (torch.ops.treeops.cast_rerank.default, (s, costs, 0.125, s[:, 0] > 0, *no_table)),
        (torch.ops.treeops.cast_rerank.default, (s, table, 0.125, None, seq, 128, table[:, 0])),
        (torch.ops.treeops.cast_depth.default, (u.to(dev), costs[0], 1.0, 2, *no_table, None)),
    ]:
        res = torch.library.opcheck(op, args)
        assert set(res.values()) == {"SUCCESS"}, (op, res)
    # capture all four in one graph, replay on new inputs
    a = torch.ones(4, dtype=torch.bool, device=dev)
    uh = u.to(dev)

    def step():
        return (
            treeops.cast_width(s, costs, 0.125, active=a),
            treeops.cast_rerank(s, costs, 0.125, active=a),
            treeops.cast_select(costs.cumsum(0), costs, 0.5),
            treeops.cast_depth(uh, costs[0], 1.0, 2),
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: compiles
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(3):
        s.copy_(dyadic(4, 50).to(dev))
        a.copy_(torch.rand(4, generator=g).to(dev) < 0.7)
        graph.replay()
        torch.cuda.synchronize()
        sc, ac, cc = s.cpu(), a.cpu(), costs.cpu()
        assert int(outs[0]) == int(ref.cast_width(sc, cc, 0.125, ac))
        assert int(outs[1]) == int(ref.cast_rerank(sc, cc, 0.125, ac))


@pytest.mark.gpu
def test_cast_ops_look_up_per_context_tables_on_the_gpu():
    """Per-context cost tables looked up in the launch: equal to the CPU reference, and a graph
    captured once follows the contexts as seq_lens grow in place (no new costs from the host)."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(6)
    B, M, K, MC, L = 16, 200, 64, 4, 128
    s = torch.randint(0, 65, (B, M), generator=g).float() / 64
    base = torch.cumsum(torch.randint(0, 9, (K,), generator=g).float(), 0) / 16 + 1
    table = torch.stack([base * 2**i for i in range(MC)])  # costs double per context bucket
    unit = torch.tensor([1.0, 2.0, 2.0, 4.0])
    seq = torch.randint(0, L * MC, (B,), generator=g).to(torch.int32)
    a = torch.rand(B, generator=g) < 0.8
    d = {x: y.to(dev) for x, y in (("s", s), ("t", table), ("u", unit), ("q", seq), ("a", a))}
    for C in (0.0, 0.0625, 0.5):
        for fn, rule in ((treeops.cast_width, ref.cast_width),
                         (treeops.cast_rerank, ref.cast_rerank)):  # fmt: skip
            got = fn(d["s"], d["t"], C, active=d["a"], seq_lens=d["q"], context_len=L,
                     unit=d["u"])  # fmt: skip
            assert int(got) == int(rule(s, table, C, a, seq, L, unit)), C
    w = torch.tensor(5, dtype=torch.int32)
    u_hist = torch.tensor([1.0, 0.5, 0.25])
    got = treeops.cast_depth(u_hist.to(dev), d["t"], 0.5, 2, seq_lens=d["q"], context_len=L,
                             unit=d["u"], width=w.to(dev))  # fmt: skip
    assert bool(got) == bool(ref.cast_depth(u_hist, table, 0.5, 2, seq, L, unit, w))
    q = torch.zeros(B, dtype=torch.int32, device=dev)
    out = torch.zeros((), dtype=torch.int32, device=dev)
    width = treeops.cast_width(d["s"], d["t"], 2.0, seq_lens=q, context_len=L, unit=d["u"])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(treeops.cast_width(d["s"], d["t"], 2.0, seq_lens=q, context_len=L,
                                     unit=d["u"]))  # fmt: skip
    seen = set()
    for ctx in (0, L, 2 * L + 5, 10 * L):
        q.fill_(ctx)
        graph.replay()
        want = int(ref.cast_width(s, table, 2.0, None, torch.full((B,), ctx), L, unit))
        assert int(out) == want, ctx
        seen.add(want)
    assert width.is_cuda and len(seen) > 1  # the contexts' rows gave different widths
