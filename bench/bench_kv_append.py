"""KV append with RoPE on the GPU: treeops against the PyTorch recipe and the floor.

    python bench/bench_kv_append.py --out DIR        # writes DIR/kv_append.json, prints a table
    python bench/bench_kv_append.py --out DIR --dry-run     # tiny shapes on the CPU
    python -m pytest bench/bench_kv_append.py --benchmark-only

Rows (docs/design.md op 2): the K/V of N = 64 tree nodes (random trees, RoPE at each node's
depth) per request written after 4096 cached tokens, B in {1, 8, 64}, 8 KV heads, D = 128, bf16,
page size 16, pages shuffled. Peer: the same in PyTorch (positions and angles on device, rotate
K in fp32, then one advanced-index write per cache), sync-free and replayed in a graph. Inputs
rotate: each copy has its own K/V and its own prefix length, so the writes land in other slots
too. Before timing, treeops' caches are compared with ``treeops.reference.kv_append`` (V exact,
K within bf16 rounding) and the peer's with treeops'. Times are medians of CUDA-graph replays
(``harness.graph_us``); ``treeops_eager_us`` is one eager call, host included. Floor = max(the
new K/V read once and written once / 4.3 TB/s, an empty kernel replayed in a CUDA graph).
"""

from __future__ import annotations

import os
import random

import harness as H
import torch

import treeops
from treeops.reference import kv_append as ref

HKV, D, PAGE, N, CTX = 8, 128, 16, 64, 4096
THETA = 10000.0


class Case:
    """Paged bf16 caches with room for CTX + N tokens per request, ``copies`` sets of new K/V
    and prefix lengths, and the trees' depths."""

    def __init__(self, B: int, copies: int, dev, seed: int = 0, dims=(HKV, D, N, CTX)):
        self.hkv, self.d, self.n, self.ctx = dims
        self.B, self.dev = B, dev
        rng = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        pages = -(-(self.ctx + self.n) // PAGE)
        P = B * pages
        self.block_table = torch.randperm(P, generator=g)[: B * pages].view(B, pages)
        self.block_table = self.block_table.to(torch.int32).to(dev)
        shape = (P, PAGE, self.hkv, self.d)
        self.k_cache = torch.randn(shape, generator=g).to(dev, torch.bfloat16)
        self.v_cache = torch.randn(shape, generator=g).to(dev, torch.bfloat16)
        depth = torch.zeros(B, self.n, dtype=torch.int32)
        for b in range(B):
            for i in range(1, self.n):
                depth[b, i] = depth[b, rng.randrange(i)] + 1
        self.depth = depth.to(dev)
        self.num = torch.full((B,), self.n, dtype=torch.int32, device=dev)
        step = max(1, min(self.n, self.ctx // max(copies, 1)))
        kv = (B, self.n, self.hkv, self.d)
        self.inputs = [
            (
                torch.randn(kv, generator=g).to(dev, torch.bfloat16),
                torch.randn(kv, generator=g).to(dev, torch.bfloat16),
                torch.full((B,), self.ctx - c * step, dtype=torch.int32, device=dev),
            )
            for c in range(copies)
        ]
        self.inv_freq = ref.rope_inv_freq(self.d, THETA, dev)
        self.ar = torch.arange(self.n, device=dev)

    def treeops(self, k, v, seq):
        treeops.kv_append(k, v, self.k_cache, self.v_cache, self.block_table, seq, self.num,
                          self.depth, rope_theta=THETA)  # fmt: skip

    def torch(self, k, v, seq):
        """The PyTorch recipe: every node of every request valid (num_tokens = N)."""
        pos = seq[:, None].long() + self.depth.long()  # [B, N]
        ang = pos.float()[..., None] * self.inv_freq  # [B, N, D/2]
        cos, sin = torch.cos(ang)[:, :, None], torch.sin(ang)[:, :, None]
        kf = k.float()
        h = self.d // 2
        k1, k2 = kf[..., :h], kf[..., h:]
        kr = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], -1).to(k.dtype)
        slots = seq[:, None].long() + self.ar[None, :]
        page = self.block_table.long().gather(1, slots // PAGE)
        off = slots % PAGE
        self.k_cache[page, off] = kr
        self.v_cache[page, off] = v

    def snapshot(self):
        return self.k_cache.clone(), self.v_cache.clone()

    def restore(self, snap):
        self.k_cache.copy_(snap[0])
        self.v_cache.copy_(snap[1])


def check(c: Case) -> tuple[str, str]:
    """(treeops against the reference, the peer against treeops): "ok" or what differs."""
    snap = c.snapshot()
    k, v, seq = c.inputs[0]
    c.treeops(k, v, seq)
    got = c.snapshot()
    c.restore(snap)
    ref.kv_append(k, v, c.k_cache, c.v_cache, c.block_table, seq, c.num, c.depth,
                  rope_theta=THETA)  # fmt: skip
    want = c.snapshot()
    c.restore(snap)
    c.torch(k, v, seq)
    peer = c.snapshot()
    c.restore(snap)

    def same(a, b):
        if not torch.equal(a[1], b[1]):
            return "V cache differs"
        if not torch.allclose(a[0].float(), b[0].float(), rtol=1e-2, atol=1e-2):
            return "K cache differs beyond bf16 rounding"
        return "ok"

    return same(got, want), same(peer, got)


def bench_row(B: int, empty_us: float, dev, time_treeops=None, dims=(HKV, D, N, CTX)) -> dict:
    """One row, checked first (an incorrect row has no times)."""
    hkv, d, n, ctx = dims
    nbytes = 2 * 2 * B * n * hkv * d * 2  # K and V, read once and written once, bf16
    copies, reps = H.rotation(nbytes) if torch.device(dev).type == "cuda" else (2, 1)
    c = Case(B, copies, dev, dims=dims)
    row = dict(op="kv_append", B=B, N=n, ctx=ctx, hkv=hkv, d=d, page_size=PAGE, dtype="bf16",
               copies=copies, reps=reps, bytes=nbytes, empty_kernel_us=empty_us,
               floor_us=H.floor_us(nbytes, empty_us=empty_us))  # fmt: skip
    row["check"], row["torch_check"] = check(c)
    if row["check"] != "ok":
        return row
    timer = time_treeops or (lambda calls, reps: H.graph_us(calls, reps, device=dev))
    row["treeops_us"] = timer([lambda a=a: c.treeops(*a) for a in c.inputs], reps)
    row["treeops_eager_us"] = H.eager_us(lambda: c.treeops(*c.inputs[0]), device=dev)
    row["torch_us"] = H.graph_us([lambda a=a: c.torch(*a) for a in c.inputs], reps, device=dev)
    H.ratios([row])
    return row


def main(argv=None) -> dict:
    args, dev = H.parse_cli(__doc__, "kv_append.json", argv)
    dims = (2, 64, 8, 40) if args.dry_run else (HKV, D, N, CTX)
    empty_us = H.empty_kernel_us(dev)
    rows: list[dict] = []
    doc = H.result_doc(dev, commit_id=args.commit, hbm_bytes_per_s=H.HBM_BYTES_PER_S,
                       empty_kernel_graph_us=empty_us, rows=rows)  # fmt: skip
    path = os.path.join(args.out, "kv_append.json")
    for B in (int(b) for b in args.batches.split(",")):
        rows.append(bench_row(B, empty_us, dev, dims=dims))
        H.write_json(path, doc)

    keys = (
        "B",
        "treeops_us",
        "treeops_eager_us",
        "torch_us",
        "floor_us",
        "treeops_over_floor",
        "check",
        "torch_check",
    )
    H.print_table(doc, path, rows, keys)
    return doc


def test_kv_append(benchmark):
    """B = 8, N = 64 tree nodes after 4096 tokens, 8 KV heads, D = 128, bf16, page 16. Peer:
    the PyTorch recipe, replayed in a graph."""
    dev = torch.device("cuda")
    row = bench_row(8, H.empty_kernel_us(dev), dev,
                    lambda calls, reps: H.benchmark_graph(benchmark, calls, reps))  # fmt: skip
    assert row["check"] == "ok", row["check"]
    H.record(benchmark, row)


if __name__ == "__main__":
    main()
