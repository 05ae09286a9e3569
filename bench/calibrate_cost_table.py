"""Calibrate CAST's cost table on this GPU for a Llama-shaped 8B-class target and a one-layer draft.

    python bench/calibrate_cost_table.py --out DIR [--quick] [--layers 2]
    python bench/calibrate_cost_table.py --dry-run            # tiny model on the CPU

Target: hidden 4096, 32 query / 8 KV heads of dim 128, MLP 14336, vocab 128256, 32 layers,
bf16. ``--layers`` decoder layers are timed (``f_layers(B, c, n)``) and scaled by 32 / layers; the
final norm + LM head over the n new tokens is timed separately (``f_head``) and added:
``S_T = 32 / layers * f_layers + f_head``. The JSON's ``meta`` says so and keeps both parts.
Draft (EAGLE-style, docs/design.md: "the draft includes its LM head"): fc (2 x hidden -> hidden) +
one decoder layer + norm + LM head, timed whole.

A forward of n new tokens per request at context c: RMSNorm, QKV projection, the new K/V written
into a bf16 cache after c tokens, attention of the n queries over the c + n keys (torch SDPA,
flash backend, GQA; the tree mask only touches the last n keys, so an unmasked pass is the same
work; RoPE is left out, its cost is negligible), O projection, RMSNorm, SwiGLU MLP.
Grid: B in {1, 2, 4, 8, 16, 32, 64}, c = L, 2L, ..., ML (L = 4096, M = 8: up to 32K), n
measured at ``NS`` up to 128 and interpolated.

Timing (``treeops.CostTable.measure``'s graph path, the default on CUDA): each (B, c, n) forward
is captured once into a CUDA graph and its replays are timed with CUDA events (warm-up replays,
median), which is what a decoder running CUDA graphs pays; timing eager calls instead measured
the Python launch overhead (about 7x the real cost of a layer at B = 1 on the H200). The
forwards are capturable: weights, KV caches and inputs are allocated before capture (inputs once
per batch size for every n), the new K/V are written in place, SDPA runs the flash backend, and
nothing syncs with the host. A point whose capture fails is timed eagerly and listed in
``meta["graph_fallbacks"]``. ``--timing eager`` restores eager timing. The GPU runs ~200 ms of
matmuls before each batch size so that its clocks are up. At the end a sanity check compares the
per-layer target time at B = 1, n = 1 with docs/benchmarks.md's 129 µs for the linear layers of a
Llama-3-8B layer on the H200 (``meta["sanity"]``; above 2x is flagged as suspicious).

Writes ``DIR/cost_table_h200.json`` (a ``treeops.CostTable``), ``DIR/cost_table_h200.svg`` (S_T
and S_D against n, per batch size, at one context), and prints a summary table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

NS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128]
BATCHES = [1, 2, 4, 8, 16, 32, 64]
# docs/benchmarks.md: the linear layers of one Llama-3-8B decoder layer, 1 token, bf16, H200
BENCH_LINEARS_1TOK_US = 129.0
SUSPICIOUS_RATIO = 2.0


class Dims:
    def __init__(
        self,
        hidden=4096,
        heads=32,
        kv_heads=8,
        head_dim=128,
        mlp=14336,
        vocab=128256,
        layers=32,
        draft_vocab=None,
    ):
        self.hidden, self.heads, self.kv_heads, self.head_dim = hidden, heads, kv_heads, head_dim
        self.mlp, self.vocab, self.layers = mlp, vocab, layers
        self.draft_vocab = draft_vocab or vocab

    def describe(self):
        return (
            f"hidden {self.hidden}, {self.heads} query / {self.kv_heads} KV heads of dim "
            f"{self.head_dim}, MLP {self.mlp}, vocab {self.vocab}, {self.layers} layers"
        )


def rms_norm(x, w, eps=1e-5):
    v = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(v + eps)).to(x.dtype) * w


class Layer:
    """One Llama decoder layer with a KV cache of capacity ``cap`` tokens per request."""

    def __init__(self, d: Dims, B: int, cap: int, dev, dtype, g):
        h, hd = d.hidden, d.head_dim
        s = 0.02

        def w(*shape):
            return (torch.randn(*shape, device=dev, generator=g) * s).to(dtype)

        self.d = d
        self.wqkv = w((d.heads + 2 * d.kv_heads) * hd, h)
        self.wo = w(h, d.heads * hd)
        self.wgu = w(2 * d.mlp, h)
        self.wd = w(h, d.mlp)
        self.n1 = torch.ones(h, device=dev, dtype=dtype)
        self.n2 = torch.ones(h, device=dev, dtype=dtype)
        self.k = (torch.randn(B, d.kv_heads, cap, hd, device=dev, generator=g)).to(dtype)
        self.v = (torch.randn(B, d.kv_heads, cap, hd, device=dev, generator=g)).to(dtype)

    def __call__(self, x, c):
        d = self.d
        B, n, _ = x.shape
        hd = d.head_dim
        qkv = F.linear(rms_norm(x, self.n1), self.wqkv)
        q, k, v = qkv.split([d.heads * hd, d.kv_heads * hd, d.kv_heads * hd], dim=-1)
        g = d.heads // d.kv_heads
        # GQA without a mask: the g query heads of a KV head are g * n queries of one head, so
        # the flash backend runs with equal head counts (no enable_gqa fallback risk)
        q = q.view(B, n, d.kv_heads, g, hd).permute(0, 2, 3, 1, 4)
        q = q.reshape(B, d.kv_heads, g * n, hd)
        self.k[:, :, c : c + n] = k.view(B, n, d.kv_heads, hd).transpose(1, 2)
        self.v[:, :, c : c + n] = v.view(B, n, d.kv_heads, hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, self.k[:, :, : c + n], self.v[:, :, : c + n])
        o = o.view(B, d.kv_heads, g, n, hd).permute(0, 3, 1, 2, 4).reshape(B, n, d.heads * hd)
        x = x + F.linear(o, self.wo)
        gu = F.linear(rms_norm(x, self.n2), self.wgu)
        gate, up = gu.chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.wd)


class Models:
    """Weights and caches for one batch size (caches sized for the largest context)."""

    def __init__(self, d: Dims, B: int, cap: int, n_layers: int, dev, dtype):
        g = torch.Generator(device=dev).manual_seed(B)
        self.d, self.dev, self.dtype = d, dev, dtype
        self.layers = [Layer(d, B, cap, dev, dtype, g) for _ in range(n_layers)]
        self.draft_layer = Layer(d, B, cap, dev, dtype, g)
        self.fc = (torch.randn(d.hidden, 2 * d.hidden, device=dev, generator=g) * 0.02).to(dtype)
        self.norm = torch.ones(d.hidden, device=dev, dtype=dtype)
        self.head = (torch.randn(d.vocab, d.hidden, device=dev, generator=g) * 0.02).to(dtype)
        self.dhead = self.head[: d.draft_vocab]
        self.B = B
        self.x = {}

    def prepare(self, ns):
        """Allocate the static inputs of every n before any capture: a forward inside a CUDA
        graph must read buffers that exist outside it."""
        g = torch.Generator(device=self.dev).manual_seed(1000 + self.B)
        for n in ns:
            for width in (1, 2):
                if (n, width) not in self.x:
                    shape = (self.B, n, width * self.d.hidden)
                    x = torch.randn(*shape, device=self.dev, generator=g).to(self.dtype)
                    self.x[(n, width)] = x

    def inp(self, B, n, width=1):
        if (n, width) not in self.x:  # eager use without prepare(); never reached in a capture
            self.prepare([n])
        return self.x[(n, width)]

    @torch.inference_mode()
    def target_layers(self, B, c, n):
        x = self.inp(B, n)
        for layer in self.layers:
            x = layer(x, c)
        return x

    @torch.inference_mode()
    def target_head(self, B, c, n):
        return F.linear(rms_norm(self.inp(B, n), self.norm), self.head)

    @torch.inference_mode()
    def draft(self, B, c, n):
        x = F.linear(self.inp(B, n, 2), self.fc)
        x = self.draft_layer(x, c)
        return F.linear(rms_norm(x, self.norm), self.dhead)


def svg_plot(table, path, c, title):
    """S_T and S_D (µs) against n for every batch size at context ``c``: a dependency-free SVG."""
    Wd, Ht, pad = 900, 520, 60
    k = table.bucket(c)
    curves = []
    for i, B in enumerate(table.batch_sizes):
        curves.append((f"S_T B={B}", table.target[i, k].tolist(), "-"))
        curves.append((f"S_D B={B}", table.draft[i, k].tolist(), "4,3"))
    # log scale: batch 1 and batch 64 differ by two orders of magnitude
    ymax = max(max(v) for _, v, _ in curves) * 1.2
    ymin = max(min(min(v) for _, v, _ in curves) / 1.2, 1e-3)
    lo, hi = math.log10(ymin), math.log10(ymax)
    n = table.n_max
    colors = [
        "#1f77b4",
        "#ff7f0e",
        "#2ca02c",
        "#d62728",
        "#9467bd",
        "#8c564b",
        "#e377c2",
        "#7f7f7f",
        "#bcbd22",
        "#17becf",
    ]

    def X(j):
        return pad + (Wd - 2 * pad) * j / max(n - 1, 1)

    def Y(v):
        return Ht - pad - (Ht - 2 * pad) * (math.log10(max(v, ymin)) - lo) / (hi - lo)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{Wd}" height="{Ht}" '
        f'font-family="sans-serif" font-size="11">',
        f'<rect width="{Wd}" height="{Ht}" fill="white"/>',
        f'<text x="{Wd / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>',
        f'<line x1="{pad}" y1="{Ht - pad}" x2="{Wd - pad}" y2="{Ht - pad}" stroke="black"/>',
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{Ht - pad}" stroke="black"/>',
        f'<text x="{Wd / 2}" y="{Ht - 20}" text-anchor="middle">n (new tokens per request)</text>',
        f'<text x="15" y="{Ht / 2}" transform="rotate(-90 15 {Ht / 2})" '
        'text-anchor="middle">forward time (us, log scale)</text>',
    ]
    for e in range(math.floor(lo), math.ceil(hi) + 1):
        for m in (1, 2, 5):
            v = m * 10.0**e
            if ymin <= v <= ymax:
                out.append(f'<text x="{pad - 5}" y="{Y(v) + 4}" text-anchor="end">{v:g}</text>')
                out.append(
                    f'<line x1="{pad}" y1="{Y(v)}" x2="{Wd - pad}" y2="{Y(v)}" stroke="#ddd"/>'
                )
    for j in (1, 32, 64, 96, 128):
        if j <= n:
            out.append(f'<text x="{X(j - 1)}" y="{Ht - pad + 15}" text-anchor="middle">{j}</text>')
    for ci, (label, vals, dash) in enumerate(curves):
        col = colors[(ci // 2) % len(colors)]
        pts = " ".join(f"{X(j):.1f},{Y(v):.1f}" for j, v in enumerate(vals))
        out.append(
            f'<polyline fill="none" stroke="{col}" stroke-width="1.5" '
            f'stroke-dasharray="{"none" if dash == "-" else dash}" points="{pts}"/>'
        )
        if dash == "-":
            out.append(
                f'<text x="{Wd - pad + 3}" y="{Y(vals[-1]) + 4}" fill="{col}">B={label[6:]}</text>'
            )
    out.append(
        f'<text x="{pad + 10}" y="{pad - 8}">solid: target S_T; dashed: draft S_D; '
        f"context {table.select(c)}</text>"
    )
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--layers", type=int, default=2, help="target layers timed (scaled to 32)")
    ap.add_argument("--L", type=int, default=4096)
    ap.add_argument("--M", type=int, default=8)
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--ns", default=",".join(map(str, NS)))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="draft LM head size (default: the target's 128256)",
    )
    ap.add_argument(
        "--timing",
        choices=("graph", "eager"),
        default=None,
        help="graph: time CUDA-graph replays (default on CUDA); eager: time eager calls "
        "(default on the CPU; graph there only exercises the eager fallback)",
    )
    ap.add_argument(
        "--gpu-warmup-ms", type=float, default=200.0, help="matmuls before each batch size"
    )
    ap.add_argument("--quick", action="store_true", help="fewer points: M = 4, 7 n values")
    ap.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU")
    args = ap.parse_args(argv)
    import treeops
    from treeops.cost_table import default_meta, timing_meta

    batches = [int(b) for b in args.batches.split(",")]
    ns = [int(n) for n in args.ns.split(",")]
    L, M = args.L, args.M
    if args.quick:
        M, ns = min(M, 4), [1, 8, 32, 64, 96, 112, 128]
        L = 8192
    if args.dry_run:
        dev, dtype = torch.device("cpu"), torch.float32
        d = Dims(hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=128, vocab=1000, layers=32)
        batches, L, M, ns = [1, 2], 64, 2, [1, 4, 8]
        iters, warmup = 2, 1
    else:
        dev, dtype = torch.device("cuda"), torch.bfloat16
        d = Dims(draft_vocab=args.draft_vocab)
        iters, warmup = args.iters, args.warmup
    n_max = ns[-1]
    cap = L * M + n_max
    graph = (args.timing or ("graph" if dev.type == "cuda" else "eager")) == "graph"
    fallbacks = []
    kw = dict(ns=ns, warmup=warmup, iters=iters, device=dev, graph=graph, fallbacks=fallbacks)
    t0 = time.time()
    parts = {"layers": [], "head": [], "draft": []}
    warmed = []
    eager_b1 = None
    for B in batches:
        models = Models(d, B, cap, args.layers, dev, dtype)
        models.prepare(ns)
        warmed.append(treeops.CostTable.warm_up_gpu(dev, args.gpu_warmup_ms))
        for name, fn in (
            ("layers", models.target_layers),
            ("head", models.target_head),
            ("draft", models.draft),
        ):
            g = treeops.CostTable.measure_grid(
                fn, [B], L, M, n_max, name=name, progress=lambda s: print(s, flush=True), **kw
            )
            parts[name].append(g)
        if B == 1 and graph:
            # the same point timed eagerly, for the record: the launch overhead graphs remove
            eager_b1 = treeops.CostTable.measure(
                models.target_layers, 1, L, 1, warmup=warmup, iters=iters, device=dev, graph=False
            )
        del models
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    layers = torch.cat(parts["layers"])
    head = torch.cat(parts["head"])
    draft = torch.cat(parts["draft"])
    target = layers * (d.layers / args.layers) + head
    meta = default_meta(dev)
    meta.update(
        {
            "target": f"Llama-shaped 8B-class: {d.describe()}, bf16",
            "target_timing": (
                f"{args.layers} decoder layers timed and scaled x{d.layers}/"
                f"{args.layers}, plus final RMSNorm + LM head over the n tokens "
                "(timed separately); embeddings and sampling not included"
            ),
            "target_per_layer_us": (layers / args.layers).tolist(),
            "target_head_us": head.tolist(),
            "draft": (
                f"EAGLE-style: fc (2 x {d.hidden} -> {d.hidden}) + one decoder layer + "
                f"RMSNorm + LM head ({d.draft_vocab} tokens), timed whole"
            ),
            "attention": (
                "torch SDPA (flash; the 4 query heads of a KV head folded into the query "
                "length) over a bf16 cache of c + n tokens, unmasked"
            ),
            "measured_ns": ns,
            "calibration_seconds": round(time.time() - t0, 1),
        }
    )
    meta.update(timing_meta(dev, graph, warmup, iters, warmed[0] if warmed else 0.0, fallbacks))
    meta["gpu_warmup"] = (
        f"{args.gpu_warmup_ms:g} ms of bf16 matmuls before each batch size"
        if any(w > 0 for w in warmed)
        else "none"
    )
    meta["sanity"] = sanity_check(layers, batches, args.layers, L, meta["gpu"], d, eager_b1)
    table = treeops.CostTable(batches, L, target, draft, meta)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(
        args.out, "cost_table_h200.json" if not args.dry_run else "cost_table_dry_run.json"
    )
    table.save(path)
    svg = path[:-5] + ".svg"
    c_plot = min(4096, L * M)
    svg_plot(table, svg, c_plot, f"CAST cost table, {meta['gpu']}")
    # summary: S_T and S_D at one context, a few n, every batch size; what a tree would cost
    print(f"\nwrote {path} and {svg} in {meta['calibration_seconds']} s")
    print(f"context {table.select(c_plot)}: forward time in us (target S_T / draft S_D)")
    show = [n for n in (1, 16, 32, 64, 96, 128) if n <= n_max]
    print("B    | " + " | ".join(f"n={n:>3}" for n in show))
    for i, B in enumerate(batches):
        k = table.bucket(c_plot)
        cells = [f"{table.target[i, k, n - 1]:.0f}/{table.draft[i, k, n - 1]:.0f}" for n in show]
        print(f"{B:<4} | " + " | ".join(f"{c:>5}" for c in cells))
    print(
        json.dumps(
            {
                "S_T(64, 4096, 64) / S_T(64, 4096, 1)": round(
                    float(table.S_T(64, c_plot)[min(63, n_max - 1)] / table.S_T(64, c_plot)[0]), 2
                )
            }
        )
    )
    print(f"timing: {meta['method']} ({meta['timing']})")
    if fallbacks:
        names = sorted({f["name"] for f in fallbacks})
        print(
            f"WARNING: {len(fallbacks)} points fell back to eager timing ({', '.join(names)}); "
            f"first error: {fallbacks[0]['error']}"
        )
    print("sanity: " + meta["sanity"]["verdict"])
    return table


def sanity_check(layers, batches, n_layers, L, gpu, d, eager_us=None):
    """Per-layer target time at B = 1, n = 1, context L against docs/benchmarks.md's 129 µs for
    the linear layers alone (attention over the context adds a little): a ratio above 2 means the
    timing still measures something else (launch overhead, idle clocks)."""
    out = {
        "reference_us": BENCH_LINEARS_1TOK_US,
        "reference": (
            "docs/benchmarks.md: the linear layers of one Llama-3-8B decoder layer, 1 token, "
            "bf16, H200 (attention over the context adds a little)"
        ),
        "suspicious_above_ratio": SUSPICIOUS_RATIO,
    }
    if 1 not in batches:
        out.update(per_layer_us=None, ratio=None, suspicious=None, verdict="no B = 1 measured")
        return out
    per_layer = float(layers[batches.index(1), 0, 0]) / n_layers
    ratio = per_layer / BENCH_LINEARS_1TOK_US
    applies = "H200" in str(gpu) and d.hidden == 4096 and d.mlp == 14336
    suspicious = bool(applies and ratio > SUSPICIOUS_RATIO)
    out.update(
        point={"B": 1, "c": L, "n": 1},
        per_layer_us=round(per_layer, 1),
        ratio=round(ratio, 2),
        applies=applies,
        suspicious=suspicious,
    )
    if eager_us is not None:
        out["eager_per_layer_us"] = round(eager_us / n_layers, 1)
    verdict = (
        f"per-layer target time at B=1, n=1, c={L}: {per_layer:.1f} us = {ratio:.2f}x "
        f"docs/benchmarks.md's {BENCH_LINEARS_1TOK_US:g} us (linears only)"
    )
    if eager_us is not None:
        verdict += f"; timed eagerly: {eager_us / n_layers:.1f} us"
    if not applies:
        verdict += " -- reference not applicable (not an H200 or not the 8B-class shapes)"
    elif suspicious:
        verdict += f" -- SUSPICIOUS: above {SUSPICIOUS_RATIO:g}x, the timing is not the GPU's"
    else:
        verdict += " -- OK"
    out["verdict"] = verdict
    return out


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    main()
