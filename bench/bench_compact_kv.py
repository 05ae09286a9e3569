"""KV compaction on one GPU (docs/design.md op 8, docs/benchmarks.md protocol).

    python bench/bench_compact_kv.py --out DIR      # writes DIR/compact_kv.json, prints a table
    python -m pytest bench/bench_compact_kv.py --benchmark-only

Rows: 32 layers, 8 KV heads, D = 128, bf16, page size 16 (pages shuffled), B in {1, 8, 64},
every request's accepted path (0, 2, 5, 9, 14) after 1000 cached tokens, against the torch
recipe (physical slots computed on device, then one advanced-index gather and scatter per cache,
every layer at once). Both are checked against the expected cache before they are timed.
Times are medians of CUDA-graph replays (``harness.graph_us``); ``treeops_eager_us`` is one
eager call with the host included. Floor = max(the moved K/V read and written once / 4.3 TB/s,
an empty Triton kernel replayed in a CUDA graph, measured in this run).
"""

from __future__ import annotations

import argparse
import os
import time

import harness as H
import torch

import treeops

DEV = "cuda"


def graph_time_us(calls, reps: int) -> float:
    """Median µs per call replayed in a CUDA graph (``--cpu-dry-run``: wall-clock)."""
    return H.graph_us(calls, reps, replays=20, device=DEV)


def bench_compact_row(B: int, empty_us: float, time_treeops=None) -> dict:
    """One compaction row, checked against the expected cache first (an incorrect row has no
    times). ``time_treeops(calls, reps)`` times treeops (default: ``graph_time_us``)."""
    time_treeops = time_treeops or graph_time_us
    Lyr, Hkv, D, PS, N = (32, 8, 128, 16, 64) if DEV != "cpu" else (2, 2, 8, 16, 64)
    path = [0, 2, 5, 9, 14]
    seq0 = 1000 if DEV != "cpu" else 20
    pages = -(-(seq0 + N) // PS)
    P = B * pages + 1
    perm = torch.randperm(P, generator=torch.Generator().manual_seed(B))[: B * pages]
    bt = perm.view(B, pages).to(torch.int32).to(DEV)
    kc = torch.empty(Lyr, P, PS, Hkv, D, device=DEV, dtype=torch.bfloat16).normal_()
    vc = torch.empty_like(kc).normal_()
    seq = torch.full((B,), seq0, device=DEV, dtype=torch.int32)
    rows_par = [[-1] + list(range(N - 1))] * B  # a chain: any depth exists
    tree = treeops.Tree.from_parents(
        torch.tensor(rows_par, dtype=torch.int32), torch.full((B,), N, dtype=torch.int32)
    ).to(DEV)
    # path (0, 2, 5, 9, 14) on a chain is not a root path, so the tree is only used for shapes;
    # the kernel reads accepted / accept_len
    acc = torch.full((B, N), -1, dtype=torch.int32, device=DEV)
    acc[:, : len(path)] = torch.tensor(path, dtype=torch.int32, device=DEV)
    alen = torch.full((B,), len(path), dtype=torch.int32, device=DEV)
    moved = len(path) - 1
    nbytes = B * Lyr * Hkv * moved * D * 2 * 2 * 2  # K and V, read and written
    row = dict(
        op="compact_kv",
        B=B,
        N=N,
        V=None,
        layers=Lyr,
        kv_heads=Hkv,
        head_dim=D,
        page_size=PS,
        path=path,
        floor_bytes_us=H.bytes_floor_us(nbytes),
        empty_kernel_us=empty_us,
        floor_us=H.floor_us(nbytes, empty_us=empty_us),
    )

    # slots [s, s + N) of every request: before, and the expected after
    slots = seq[:, None].long() + torch.arange(N, device=DEV)[None, :]
    pg = bt.long().gather(1, slots // PS)
    off = slots % PS
    before_k, before_v = kc[:, pg, off].clone(), vc[:, pg, off].clone()  # [L, B, N, H, D]
    want_k, want_v = before_k.clone(), before_v.clone()
    src = torch.tensor(path, device=DEV)
    want_k[:, :, : len(path)] = before_k[:, :, src]
    want_v[:, :, : len(path)] = before_v[:, :, src]

    def check(name):
        ok = torch.equal(kc[:, pg, off], want_k) and torch.equal(vc[:, pg, off], want_v)
        kc[:, pg, off] = before_k
        vc[:, pg, off] = before_v
        return ok

    def run_treeops():
        return treeops.compact_kv(kc, vc, bt, seq, tree, acc, alen)

    k_list, v_list = list(kc.unbind(0)), list(vc.unbind(0))  # an engine's per-layer caches

    def run_treeops_list():
        return treeops.compact_kv(k_list, v_list, bt, seq, tree, acc, alen)

    d = torch.arange(1, len(path), device=DEV)

    def run_torch():
        # the usual recipe: physical indices from (seq_lens, accepted) on device, then one
        # advanced-index gather (all sources first) and scatter per cache, every layer at once
        s_src = seq[:, None].long() + acc[:, 1 : len(path)].long()
        s_dst = seq[:, None].long() + d[None, :]
        sp = bt.long().gather(1, s_src // PS).flatten()
        so = (s_src % PS).flatten()
        dp = bt.long().gather(1, s_dst // PS).flatten()
        do = (s_dst % PS).flatten()
        kc[:, dp, do] = kc[:, sp, so]
        vc[:, dp, do] = vc[:, sp, so]
        return seq + alen

    new = run_treeops()
    ok_t = check("treeops") and torch.equal(new, seq + alen)
    run_torch()
    ok_p = check("torch")
    new = run_treeops_list()
    ok_l = check("treeops list") and torch.equal(new, seq + alen)
    row.update(correct=ok_t, torch_correct=ok_p, list_correct=ok_l)
    if not ok_t:
        row["note"] = "treeops output does not match the expected cache"
        return row
    reps = 20 if B <= 8 else 5
    row["treeops_us"] = time_treeops([run_treeops], reps)
    row["treeops_eager_us"] = H.eager_us(run_treeops, device=DEV)
    row["torch_us"] = graph_time_us([run_torch], reps)
    if ok_l:  # the same copies through the layers' address table
        row["treeops_list_us"] = time_treeops([run_treeops_list], reps)
    return row


def main(argv=None) -> dict:
    global DEV
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for compact_kv.json")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument(
        "--cpu-dry-run", action="store_true", help="tiny sizes on the CPU (checks the script only)"
    )
    args = ap.parse_args(argv)
    if args.cpu_dry_run:
        DEV = "cpu"
    elif not torch.cuda.is_available():
        ap.error("needs a CUDA device (or --cpu-dry-run)")
    t_start = time.time()
    empty_us = H.empty_kernel_us(DEV)
    rows: list[dict] = []
    path = os.path.join(args.out, "compact_kv.json")
    doc = H.result_doc(DEV, hbm_bytes_per_s=H.ceilings()["hbm_bytes_per_s"],
                       empty_kernel_graph_us=empty_us, rows=rows)  # fmt: skip
    for B in (int(b) for b in args.batches.split(",")):
        rows.append(bench_compact_row(B, empty_us))
        H.ratios(rows)
        doc["wall_s"] = round(time.time() - t_start, 1)
        H.write_json(path, doc)  # after every row: a stage time limit keeps what was measured

    keys = (
        "B",
        "treeops_us",
        "treeops_eager_us",
        "treeops_list_us",
        "torch_us",
        "floor_us",
        "treeops_over_floor",
        "correct",
        "torch_correct",
    )
    H.print_table(doc, path, rows, keys)
    return doc


def test_compact_kv(benchmark):
    """B = 8, 32 layers x 8 KV heads x D 128, bf16, page 16, path (0, 2, 5, 9, 14). Peer: the
    torch gather/scatter recipe."""
    row = bench_compact_row(
        8, H.empty_kernel_us(), lambda calls, reps: H.benchmark_graph(benchmark, calls, reps)
    )
    assert row["correct"], row.get("note")
    H.ratios([row])
    H.record(benchmark, row)


if __name__ == "__main__":
    main()
