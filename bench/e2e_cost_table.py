"""The example decoder's cost table for ``bench_e2e.py``: CAST's ``S_T`` / ``S_D`` over the
decoder's own fused forwards at the token buckets it runs and several contexts, and a draft
layer's tree-op overhead per batch size (``layer_overhead_us``, what λ-CAST adds per layer)."""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import harness as H  # noqa: E402

from treeops import CostTable  # noqa: E402
from treeops.decoder import Draft, Target  # noqa: E402
from treeops.decoder.model import chain_tree  # noqa: E402
from treeops.tree import Tree  # noqa: E402


def log(msg: str) -> None:
    print(msg, flush=True)


def calibrate(target: Target, draft: Draft, batches, n_max: int, L: int, M: int, device,
              quick: bool, topk: int = 10, width: int = 10):  # fmt: skip
    """CAST's cost table over the decoder's own forwards, at the sizes the decoder runs:
    ``S_T(B, c, n)`` = the target's tree forward of n nodes (a chain) after c cached tokens;
    ``S_D(B, c, n)`` = the draft's forward of n frontier rows (root + n children, rows 1..n)
    with its LM head; n at the decoder's token buckets up to ``n_max`` (``token_buckets``), c at
    the M context buckets ``L, 2L, .., ML``. Also a draft layer's tree-op overhead per B: one
    ``build_tree_expand`` of a [B, width, V] frontier (top-``topk``), λ-CAST's
    ``layer_overhead_us``. CUDA-graph replays on CUDA (eager perf_counter on the CPU)."""
    import treeops
    from treeops.decoder.graphs import token_buckets

    dev = torch.device(device)
    ns = token_buckets(n_max)
    if quick:
        ns = sorted({n for n in (1, 8, 32) if n < n_max} | {n_max})
    H_ = target.cfg.hidden_size
    wdtype = target.model.embed_tokens.weight.dtype
    inputs: dict = {}

    def prep(B, c, n):
        key = (B, c, n)
        if key not in inputs:
            g = torch.Generator().manual_seed(n)
            V = target.cfg.vocab_size
            tok = torch.randint(0, V, (B, n + 1), generator=g).to(dev)
            tkv = target.make_cache(B, c + n + 1, page_size=16)
            dkv = draft.make_cache(B, c + n + 1, page_size=16)
            for kv in (tkv, dkv):
                kv.k.normal_()
                kv.v.normal_()
            seq = torch.full((B,), c, dtype=torch.int32, device=dev)
            full = torch.full((B,), n, dtype=torch.int32, device=dev)
            chain = chain_tree(tok[:, :n].contiguous(), full)
            par = torch.zeros(B, n + 1, dtype=torch.int32, device=dev)
            star = Tree.from_parents(par, full + 1, tok)
            feats = torch.randn(B, n, H_, generator=g).to(dev, wdtype)
            qs = torch.ones(B, dtype=torch.int32, device=dev)
            inputs[key] = (tok, tkv, dkv, seq, chain, star, feats, qs, full)
        return inputs[key]

    def t_fn(B, c, n):
        tok, tkv, _, seq, chain, *_ = prep(B, c, n)
        return target(tok[:, :n], tkv, seq, chain)

    def d_fn(B, c, n):
        tok, _, dkv, seq, _, star, feats, qs, full = prep(B, c, n)
        return draft(target, tok[:, 1:], feats, dkv, seq, star, qs, full)

    fallbacks: list = []
    tt = torch.zeros(len(batches), M, n_max, dtype=torch.float64)
    dd = torch.zeros_like(tt)
    layer_us: dict[int, float] = {}
    t0 = time.time()
    for i, B in enumerate(batches):
        for c in range(1, M + 1):  # prepared up front: nothing allocates between timings
            for n in ns:
                prep(B, c * L, n)
        iters = 5 if quick or dev.type != "cuda" else 10
        kw = dict(ns=ns, warmup=2 if dev.type == "cuda" else 1, iters=iters, device=dev,
                  fallbacks=fallbacks)  # fmt: skip
        tt[i] = CostTable.measure_grid(t_fn, [B], L, M, n_max, name="target", **kw)[0]
        dd[i] = CostTable.measure_grid(d_fn, [B], L, M, n_max, name="draft", **kw)[0]
        inputs.clear()
        # the tree ops of one draft layer besides its forward: the expand (softmax + top-k over
        # V per frontier row, the path scores, the next frontier)
        pol = treeops.EagleStatic(depth=2, topk=topk, budget=n_max, width=width)
        V = target.cfg.vocab_size
        logits = torch.randn(B, width, V, device=dev)
        root = torch.zeros(B, dtype=torch.int64, device=dev)
        st = treeops.DraftState.new(pol, root, torch.full((B,), L, device=dev))

        def expand(st=st, logits=logits, pol=pol):
            st.layer = 0
            treeops.build_tree_expand(logits, st, pol)

        layer_us[B] = round(H.graph_us([expand], device=dev), 2)
        log(f"  cost table B={B}: S_T(n=1)={tt[i, 0, 0]:.1f} us S_T(n={n_max})="
            f"{tt[i, 0, -1]:.1f} us S_D(n=1)={dd[i, 0, 0]:.1f} us; draft layer's tree ops "
            f"{layer_us[B]:.1f} us")  # fmt: skip
    meta = {
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "model": "bench_e2e decoder pair",
        "measured_ns": ns,
        "contexts": [L * (k + 1) for k in range(M)],
        "layer_overhead_us": layer_us,
        "timing": "CUDA-graph replays, median" if dev.type == "cuda" else "eager, perf_counter",
        "graph_fallbacks": fallbacks[:5],
        "seconds": round(time.time() - t0, 1),
    }
    return CostTable(list(batches), L, tt, dd, meta)
