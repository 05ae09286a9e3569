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

With queries (32 heads, GQA 4, as the decoder calls it): ``treeops_q_us`` is ``kv_append(...,
q=q)``, one launch that also rotates q in place (checked against the reference first:
``check_q``), ``treeops_rope_us`` the two launches it replaces (``kv_append``, then
``treeops.rope`` of q at positions computed beforehand); ``floor_q_us`` adds q's read and write.
"""

from __future__ import annotations

import os
import random

import harness as H
import torch

import treeops
from treeops.reference import kv_append as ref

HKV, D, PAGE, N, CTX = 8, 128, 16, 64, 4096
GQA = 4  # query heads per KV head in the rows with queries
THETA = 10000.0


class Case:
    """Paged bf16 caches with room for CTX + N tokens per request, ``copies`` sets of new K/V,
    queries and prefix lengths (with the queries' RoPE positions), and the trees' depths."""

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
        qs = (B, self.n, GQA * self.hkv, self.d)
        self.queries = [torch.randn(qs, generator=g).to(dev, torch.bfloat16) for _ in self.inputs]
        self.positions = [seq[:, None].long() + self.depth.long() for _, _, seq in self.inputs]
        self.inv_freq = ref.rope_inv_freq(self.d, THETA, dev)
        self.ar = torch.arange(self.n, device=dev)

    def treeops(self, k, v, seq, q=None):
        treeops.kv_append(k, v, self.k_cache, self.v_cache, self.block_table, seq, self.num,
                          self.depth, q=q, rope_theta=THETA)  # fmt: skip

    def treeops_rope(self, k, v, seq, q, pos):
        """The two launches ``q=`` replaces: kv_append, then rope of the queries."""
        self.treeops(k, v, seq)
        return treeops.rope(q, pos, THETA)

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


def check_q(c: Case) -> str:
    """``kv_append(..., q=q)``: q rotated as the reference rotates it, the caches as without q."""
    snap = c.snapshot()
    k, v, seq = c.inputs[0]
    q = c.queries[0].clone()
    c.treeops(k, v, seq, q)
    got = c.snapshot()
    c.restore(snap)
    want_q = c.queries[0].clone()
    ref.kv_append(k, v, c.k_cache, c.v_cache, c.block_table, seq, c.num, c.depth, q=want_q,
                  rope_theta=THETA)  # fmt: skip
    want = c.snapshot()
    c.restore(snap)
    if not torch.equal(got[1], want[1]):
        return "V cache differs"
    for name, a, b in (("K cache", got[0], want[0]), ("q", q, want_q)):
        if not torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2):
            return f"{name} differs beyond bf16 rounding"
    return "ok"


def bench_row(B: int, empty_us: float, dev, time_treeops=None, dims=(HKV, D, N, CTX)) -> dict:
    """One row, checked first (an incorrect row has no times)."""
    hkv, d, n, ctx = dims
    nbytes = 2 * 2 * B * n * hkv * d * 2  # K and V, read once and written once, bf16
    qbytes = 2 * B * n * GQA * hkv * d * 2  # q, read once and written once
    copies, reps = H.rotation(nbytes) if torch.device(dev).type == "cuda" else (2, 1)
    c = Case(B, copies, dev, dims=dims)
    row = dict(op="kv_append", B=B, N=n, ctx=ctx, hkv=hkv, d=d, page_size=PAGE, dtype="bf16",
               copies=copies, reps=reps, bytes=nbytes, empty_kernel_us=empty_us,
               floor_us=H.floor_us(nbytes, empty_us=empty_us), hq=GQA * hkv,
               floor_q_us=H.floor_us(nbytes + qbytes, empty_us=empty_us))  # fmt: skip
    row["check"], row["torch_check"] = check(c)
    if row["check"] != "ok":
        return row
    timer = time_treeops or (lambda calls, reps: H.graph_us(calls, reps, device=dev))
    row["treeops_us"] = timer([lambda a=a: c.treeops(*a) for a in c.inputs], reps)
    row["treeops_eager_us"] = H.eager_us(lambda: c.treeops(*c.inputs[0]), device=dev)
    row["torch_us"] = H.graph_us([lambda a=a: c.torch(*a) for a in c.inputs], reps, device=dev)
    row["check_q"] = check_q(c)
    if row["check_q"] == "ok":  # q is rotated again on every call: only the time matters here
        ins = list(zip(c.inputs, c.queries, c.positions, strict=True))
        row["treeops_q_us"] = H.graph_us([lambda a=a, q=q: c.treeops(*a, q) for a, q, _ in ins],
                                         reps, device=dev)  # fmt: skip
        row["treeops_rope_us"] = H.graph_us(
            [lambda a=a, q=q, p=p: c.treeops_rope(*a, q, p) for a, q, p in ins], reps, device=dev
        )
    H.ratios([row])
    return row


def main(argv=None) -> dict:
    args, dev = H.parse_cli(__doc__, "kv_append.json", argv)
    dims = (2, 64, 8, 40) if args.dry_run else (HKV, D, N, CTX)
    empty_us = H.empty_kernel_us(dev)
    rows: list[dict] = []
    doc = H.result_doc(dev, commit_id=args.commit, hbm_bytes_per_s=H.ceilings()["hbm_bytes_per_s"],
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
        "treeops_q_us",
        "treeops_rope_us",
        "floor_q_us",
        "check",
        "torch_check",
        "check_q",
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
