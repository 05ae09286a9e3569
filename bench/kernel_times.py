"""Device time per kernel of one op call (torch.profiler, CUDA activity), at the small shapes
where a replay's total hides which launch costs what: tree attention's split launch and merge
(and the fused merge), greedy acceptance's one launch against its two-launch form and forced
vocabulary splits, sampling acceptance's three launches (``--only sample``), the table update's
two stages by method (``--only update``), one build layer's stream and per-row launches, and a
whole build step's launches (``--only step``).

    python bench/kernel_times.py [--only attention,accept,sample,update,build,step] [--iters 30]
        [--full-root]

Prints one line per case: the kernels the call launched, each ``(launches per call, [median
device µs of each launch])``. Eager calls (the profiler times each kernel on the device, host
gaps excluded).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

ATTENTION_SHAPES = [(1, 512, 8), (1, 512, 64), (1, 1024, 64), (4, 512, 64), (1, 4096, 16)]
ACCEPT_SHAPES = [(1, 32000), (1, 128256), (8, 32000)]
BUILD_SHAPES = [(1, 32000), (64, 32000), (1, 128256)]
STEP_SHAPES = [(1, 32000), (64, 32000)]
UPDATE_SHAPES = [(1, 128256), (8, 128256), (64, 32000)]
FULL_ROOT = False  # ``--full-root``: the step's layer 0 from all W rows of its logits


def kernel_times(fn, iters: int = 30) -> dict[str, tuple[int, list[float]]]:
    """{kernel name: (launches per call, median device µs of each, in launch order)} over
    ``iters`` calls of ``fn`` (a kernel launched twice per call, such as acceptance's two-launch
    form, gets two medians: its first and second launches apart)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    acc = collections.defaultdict(list)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    for e in sorted(events, key=lambda e: e.time_range.start):
        acc[e.name[:40]].append(e.device_time)
    return {name: per_launch_medians(times, iters) for name, times in acc.items()}


def per_launch_medians(times: list[float], iters: int) -> tuple[int, list[float]]:
    """One kernel's device times over ``iters`` calls, in launch order: (launches per call, the
    median of each launch position)."""
    per = max(1, len(times) // iters)
    cols = [sorted(times[i::per]) for i in range(per)]
    return per, [round(c[len(c) // 2], 2) for c in cols]


def attention(iters: int) -> None:
    import bench_tree_attention as BTA

    for B, ctx, n in ATTENTION_SHAPES:
        c = BTA.Case(B, ctx, n)
        for name, ov in (("auto", None), ("fused", {"fused_merge": True})):
            fn, cfg = BTA.kernel_fn(c, ov)
            print(f"attention B {B} ctx {ctx} n {n} {name} splits {cfg.num_splits} block_m "
                  f"{cfg.block_m}: {kernel_times(fn, iters)}", flush=True)  # fmt: skip


def accept(iters: int) -> None:
    import torch

    import treeops
    from treeops.kernels import accept as KA

    N = 64
    for B, V in ACCEPT_SHAPES:
        par = torch.arange(-1, N - 1, dtype=torch.int32)[None].repeat(B, 1)  # a chain
        tree = treeops.Tree.from_parents(
            par, torch.full((B,), N, dtype=torch.int32), torch.randint(0, V, (B, N))
        ).to("cuda")
        logits = torch.randn(B, N, V, device="cuda", dtype=torch.bfloat16)
        for phase in (0, 1):
            call = functools.partial(KA.accept_launch, tree, logits, phase=phase)
            print(f"greedy accept B {B} V {V} phase {phase}: {kernel_times(call, iters)}")
        for s in (8, 16, 32):
            for bv in (1024, 2048):
                call = functools.partial(KA.accept_launch, tree, logits, num_splits=s, block_v=bv)
                print(f"greedy accept B {B} V {V} splits {s} block_v {bv}: "
                      f"{kernel_times(call, iters)}", flush=True)  # fmt: skip


def sample(iters: int) -> None:
    """Sampling acceptance's three launches (statistics, kept sets, walk), plain and with
    top-k 50 / top-p 0.9, and its two without top-k / top-p tensors (statistics, walk), on a
    chain of 64 nodes."""
    import torch

    import treeops
    from treeops.kernels import accept as KA

    N = 64
    for B, V in ACCEPT_SHAPES:
        par = torch.arange(-1, N - 1, dtype=torch.int32)[None].repeat(B, 1)
        tree = treeops.Tree.from_parents(
            par, torch.full((B,), N, dtype=torch.int32), torch.randint(0, V, (B, N))
        ).to("cuda")
        logits = torch.randn(B, N, V, device="cuda", dtype=torch.bfloat16)
        temp = torch.ones(B, device="cuda")
        u = torch.rand(B, N, device="cuda")
        for k, p in ((0, 1.0), (50, 0.9)):
            top_k = torch.full((B,), k, dtype=torch.int32, device="cuda")
            top_p = torch.full((B,), p, device="cuda")
            call = functools.partial(KA.accept_launch, tree, logits, temperature=temp,
                                     top_k=top_k, top_p=top_p, uniforms=u)  # fmt: skip
            print(f"sampling accept B {B} V {V} top_k {k} top_p {p}: "
                  f"{kernel_times(call, iters)}", flush=True)  # fmt: skip
        call = functools.partial(KA.accept_launch, tree, logits, temperature=temp, top_k=None,
                                 top_p=None, uniforms=u, phase=1)  # fmt: skip
        print(f"sampling accept B {B} V {V} without top-k / top-p tensors: "
              f"{kernel_times(call, iters)}", flush=True)  # fmt: skip


def update(iters: int) -> None:
    """The successor-table update from logits (60 of 64 nodes a request, k = 8): stage 1 and
    the write stage of the top-k lists (``block_max`` 0) and of the block-maxima method (128)."""
    import torch

    import treeops
    from treeops.kernels import graft_update as kg

    N = 64
    for B, V in UPDATE_SHAPES:
        par = torch.arange(-1, N - 1, dtype=torch.int32)[None].repeat(B, 1)
        tree = treeops.Tree.from_parents(
            par, torch.full((B,), 60, dtype=torch.int32), torch.randint(0, V, (B, N))
        ).to("cuda")
        logits = torch.randn(B, N, V, device="cuda", dtype=torch.bfloat16) * 3
        saved = kg.UPDATE_TUNING["block_max"]
        try:
            for mb in (0, 128):
                kg.UPDATE_TUNING["block_max"] = mb
                table = treeops.AdjacencyTable(V, 8, device="cuda")
                call = functools.partial(table.update, tree, logits)
                print(f"update B {B} V {V} block_max {mb}: {kernel_times(call, iters)}",
                      flush=True)  # fmt: skip
        finally:
            kg.UPDATE_TUNING["block_max"] = saved


def build(iters: int) -> None:
    import torch

    import treeops
    from treeops.build_tree import _launch_expand

    for B, V in BUILD_SHAPES:
        pol = treeops.EagleStatic(depth=8, topk=10, budget=64)
        roots = torch.randint(0, V, (B,), device="cuda")
        seq = torch.full((B,), 3000, device="cuda")
        st = treeops.DraftState.new(pol, roots, seq)
        x0 = torch.randn(B, 1, V, device="cuda", dtype=torch.bfloat16)
        x1 = torch.randn(B, pol.max_width, V, device="cuda", dtype=torch.bfloat16)
        st.reset(roots, seq)
        _launch_expand(x0, st, pol)  # layer 0 from the root: layer 1 has a full frontier

        def layer1(st=st, x1=x1, pol=pol):
            st.layer = 1
            _launch_expand(x1, st, pol)

        print(f"build layer 1 EAGLE W=K=10 B {B} V {V}: {kernel_times(layer1, iters)}", flush=True)


def step(iters: int) -> None:
    """A whole EAGLE step as ``bench_build_tree.py``'s step rows time it (reset, 8 layers of
    W = K = 10, emit of 64 nodes), one [B, W, V] logits buffer per layer (layer 0 gets the root's
    row alone, [B, 1, V]; ``--full-root`` passes all W rows there instead): each kernel's
    launches in order, so layer 0's and the rest apart."""
    import torch

    import treeops

    for B, V in STEP_SHAPES:
        pol = treeops.EagleStatic(depth=8, topk=10, budget=64)
        roots = torch.randint(0, V, (B,), device="cuda")
        seq = torch.full((B,), 3000, device="cuda")
        st = treeops.DraftState.new(pol, roots, seq)
        xs = [torch.randn(B, pol.max_width, V, device="cuda", dtype=torch.bfloat16)
              for _ in range(8)]  # fmt: skip
        out = treeops.Tree.empty(B, 64, "cuda")

        def whole(st=st, xs=xs, pol=pol, out=out, roots=roots, seq=seq):
            st.reset(roots, seq)
            for i, x in enumerate(xs):
                st.layer = i
                treeops.build_tree_expand(x if i or FULL_ROOT else x[:, :1], st, pol)
            treeops.build_tree_emit(st, pol, out=out)

        print(f"build step EAGLE depth 8 W=K=10 N 64 B {B} V {V}: {kernel_times(whole, iters)}",
              flush=True)  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="attention,accept,build")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--full-root", action="store_true", help="step: layer 0 from all W rows")
    args = ap.parse_args(argv)
    global FULL_ROOT
    FULL_ROOT = args.full_root
    for name in args.only.split(","):
        cases = {"attention": attention, "accept": accept, "sample": sample, "update": update}
        cases.update(build=build, step=step)
        cases[name](args.iters)


if __name__ == "__main__":
    main()
