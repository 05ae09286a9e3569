"""CAST's standalone rules on the GPU: ``treeops.cast_width`` / ``cast_rerank`` / ``cast_depth``.

    python bench/bench_cast.py --out DIR             # writes DIR/cast.json, prints a table
    python bench/bench_cast.py --out DIR --dry-run   # the same on the CPU
    python -m pytest bench/bench_cast.py --benchmark-only

Rows (docs/design.md op 5), B in {1, 8, 64}: ``width`` over one draft layer's W x top-k = 100
candidate scores per request with K = 10 draft costs; ``rerank`` over 8 layers' 800 candidates with
K = 64 target costs; ``*_table`` the same with the costs a per-context table [4, K] whose row the
launch picks from ``seq_lens``; ``depth`` over a history of 8 utilities. On CUDA each op is one
Triton launch (``treeops.kernels.cast``) with no host sync: ``treeops_us`` is its CUDA-graph replay,
``treeops_eager_us`` an eager call with the host included (``harness.eager_us``). The peer is
Algorithm 1 written sync-free in PyTorch (sort, cumulative sum, batch mean, the largest argmax):
``torch_us`` its CUDA-graph replay, ``torch_eager_us`` its eager call. Each result is compared with
the peer's before it is timed. Floor = max(scores read once / 4.3 TB/s, an empty kernel replayed in
a CUDA graph)."""

from __future__ import annotations

import os

import harness as H
import pytest
import torch

import treeops

SHAPES = {"width": (100, 10, 0.3), "rerank": (800, 64, 0.1)}  # op: (M, K, threshold)
TABLE_ROWS, CONTEXT_LEN, CONTEXT = 4, 128, 300  # the *_table rows: row 2 of 4 is the batch's


def torch_select(scores: torch.Tensor, costs: torch.Tensor, C: float, rerank: bool):
    """Algorithm 1 for every request active, all scores >= 0 and M >= K: the largest k in
    [1, K] maximising u_k - C c_k, u_k the batch mean of the k best (rerank: 1 + the k - 1
    best)."""
    K = costs.shape[0]
    top = torch.topk(scores, K - 1 if rerank else K, dim=1).values
    u = top.cumsum(1).mean(0)
    if rerank:
        u = torch.cat([u.new_zeros(1), u]) + 1.0
    obj = u - C * costs
    return (K - torch.argmax(torch.flip(obj, (0,)))).to(torch.int32)


def inputs(op: str, B: int, dev, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if op == "depth":
        return torch.rand(8, generator=g).to(dev), torch.tensor(0.5, device=dev)
    M, K, _ = SHAPES[op.removesuffix("_table")]
    scores = torch.rand(B, M, generator=g).to(dev)  # every candidate exists: no ties in practice
    costs = (1.0 + torch.rand(K, generator=g).cumsum(0) / K).to(dev)
    return scores, costs


def bench_row(op: str, B: int, empty_us: float, dev, time_treeops=None) -> dict:
    """One row, checked against the peer first (an incorrect row has no times)."""
    time_treeops = time_treeops or (lambda fn: H.graph_us([fn], device=dev))
    a, b = inputs(op, B, dev)
    if op == "depth":
        row = dict(op="cast_depth", B=None, M=8, K=None, floor_us=empty_us, check="ok")

        def run():
            return treeops.cast_depth(a, b, 0.2, 4)

        run()
        row["treeops_us"] = time_treeops(run)
        row["treeops_eager_us"] = H.eager_us(run, device=dev)
        return row
    rule, table = op.removesuffix("_table"), op.endswith("_table")
    M, K, C = SHAPES[rule]
    fn = treeops.cast_width if rule == "width" else treeops.cast_rerank
    nbytes = a.numel() * 4 + b.numel() * 4
    row = dict(op=f"cast_{op}", B=B, M=M, K=K, threshold=C, bytes=nbytes,
               floor_us=H.floor_us(nbytes, empty_us=empty_us))  # fmt: skip
    if table:  # costs per context bucket, the batch's row looked up in the launch
        tab = torch.stack([b * (1 + i) for i in range(TABLE_ROWS)])
        seq = torch.full((B,), CONTEXT, dtype=torch.int32, device=dev)

        def run():
            return fn(a, tab, C, seq_lens=seq, context_len=CONTEXT_LEN)

        def peer():
            r = torch.clamp(seq.max() // CONTEXT_LEN, max=TABLE_ROWS - 1)
            costs = tab.index_select(0, r.view(1))[0]
            return torch_select(a, costs / costs[0], C, rule == "rerank")
    else:

        def run():
            return fn(a, b, C)

        def peer():
            return torch_select(a, b, C, rule == "rerank")

    got, want = int(run()), int(peer())
    row["check"] = "ok" if got == want else f"treeops {got} != torch {want}"
    row["value"] = got
    if row["check"] != "ok":
        return row
    row["treeops_us"] = time_treeops(run)
    row["treeops_eager_us"] = H.eager_us(run, device=dev)
    row["torch_eager_us"] = H.eager_us(peer, device=dev)
    row["torch_us"] = H.graph_us([peer], device=dev)
    H.ratios([row])
    return row


def main(argv=None) -> dict:
    args, dev = H.parse_cli(__doc__, "cast.json", argv)
    empty_us = H.empty_kernel_us(dev)
    rows: list[dict] = []
    doc = H.result_doc(dev, commit_id=args.commit, empty_kernel_graph_us=empty_us,
                       timing="treeops: eager calls, host included (not capturable)",
                       rows=rows)  # fmt: skip
    path = os.path.join(args.out, "cast.json")
    for op in ("width", "rerank", "width_table", "rerank_table"):
        for B in (int(b) for b in args.batches.split(",")):
            rows.append(bench_row(op, B, empty_us, dev))
            H.write_json(path, doc)
    rows.append(bench_row("depth", 1, empty_us, dev))
    H.write_json(path, doc)

    keys = ("op", "B", "treeops_us", "treeops_eager_us", "torch_eager_us", "torch_us", "floor_us",
            "check")  # fmt: skip
    H.print_table(doc, path, rows, keys, width=14)
    return doc


@pytest.mark.parametrize("op", ["width", "rerank", "width_table"])
def test_cast(benchmark, op):
    """B = 64; width: 100 candidates, K = 10 draft costs; rerank: 800 candidates, K = 64 target
    costs; width_table: the costs a per-context table looked up in the launch. Peer: the
    sync-free PyTorch rule (eager and replayed in a graph)."""
    dev = torch.device("cuda")
    row = bench_row(
        op, 64, H.empty_kernel_us(dev), dev, lambda fn: H.benchmark_graph(benchmark, [fn])
    )
    assert row["check"] == "ok", row["check"]
    H.record(benchmark, row)


if __name__ == "__main__":
    main()
