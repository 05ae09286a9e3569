"""Where sampling acceptance's time goes at small B: each of its launches timed alone, and its
pass 2 (the top-k/top-p kept sets) cut after each phase.

A replay of the whole op chains three launches with programmatic dependent launch, so a
profiler's per-kernel device time counts a dependent launch's wait for the one before (pass 2
at B 1 "takes" 12-17 µs that way). Here each recorded launch of one call is relaunched alone,
without PDL, ``REPS`` times back to back in one CUDA graph (per launch: its latency and the gap
between graph nodes). Pass 2 is then rebuilt from its own helpers (``accept_thresh``,
``accept_stats``) in a probe kernel that stops after a phase and stores what that phase made,
so every phase's work is live:

* ``merge``: the row's parameters and the merge of pass 1's partials;
* ``bound``: + the lower bound of the threshold from the coarse group maxima (a sort of GC);
* ``bound_max``: the bound's loads with a max in place of the sort (the sort's cost apart);
* ``bound_radix``: the bound as the k-th largest by a bitwise search of the keys, no sort;
* ``gather``: + the reread of the groups reaching the bound into the candidate slots;
* ``kept``: + the kept set (a sort of CAP_S candidates, its masses per block): all of pass 2's
  fast path.

Top-p alone over these logits (standard normal: a nucleus of most of the row) takes pass 2's
exact search instead; its rows time the whole op at each (tile, pivots) of ``EXACT_CONFIGS``
(``exact_us``) and check that every configuration accepts the same tokens.

    python bench/pass2_phases.py [--out F.json] [--reps 20] [--shapes 1x32000,8x32000]
        [--no-exact] [--exact-configs 1024x1,2048x1,4096x1]

Prints a table (µs per launch, medians of replays) and writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from treeops.kernels.accept_stats import (  # noqa: E402
    _gather_candidates,
    _kept_set,
    _key,
    _lower_bound,
    _unkey,
)
from treeops.kernels.accept_thresh import _merge_node, _row_params  # noqa: E402

SHAPES = [(1, 32000), (1, 128256), (2, 128256), (8, 32000)]
EXACT_CONFIGS = [(128, 16), (512, 4), (1024, 2), (1024, 4), (2048, 1), (2048, 2)]
STOPS = {"merge": 0, "bound": 1, "bound_max": 10, "bound_radix": 11, "gather": 2, "kept": 3}


@triton.jit
def _kth_largest(v, k, GC: tl.constexpr):
    """The k-th largest (1 <= k <= GC) of the [GC] fp32 values ``v``, without a sort: the
    largest int32 key t with at least k keys >= t, found one bit at a time from the top."""
    key = _key(v)
    # the sign bit first (t + 2^31 is 0), then the 31 below it
    n = tl.sum((key >= 0).to(tl.int32), axis=0)
    t = tl.where(n >= k, 0, -2147483648)
    for b in tl.static_range(30, -1, -1):
        c = t + (1 << b)
        n = tl.sum((key >= c).to(tl.int32), axis=0)
        t = tl.where(n >= k, c, t)
    return _unkey(t)


@triton.jit
def _pass2_upto(
    p_res,  # [B*N] fp32: what the last phase made (so the compiler keeps every phase)
    p_logits,
    s_lb,
    s_ln,
    s_lv,
    p_num_nodes,
    p_temp,
    p_topk_param,
    p_topp,
    p_wmax,
    p_wse,
    p_wcs,
    p_wcm,
    p_wgm,
    p_wcand,
    p_wsel,
    N,
    V,
    NCH,
    S: tl.constexpr,
    S_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NCH_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    GC: tl.constexpr,
    READ: tl.constexpr,
    CAP: tl.constexpr,
    CAP_S: tl.constexpr,
    SUB: tl.constexpr,
    MASS_TILE: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    HAS_TOPP: tl.constexpr,
    STOP: tl.constexpr,
):
    node = tl.program_id(0).to(tl.int64)
    i_n = (node % N).to(tl.int32)
    i_b = node // N
    T, k, top_p, use_k, use_p, trunc = _row_params(
        i_b, i_n, p_num_nodes, p_temp, p_topk_param, p_topp, V, HAS_TOPK, HAS_TOPP
    )
    m, z = _merge_node(p_wmax, p_wse, node, T, S, S_PAD)
    res = m + z
    if trunc:
        p_gm = p_wgm + node * G_PAD
        if (STOP == 10) | (STOP == 11):
            # the bound's loads, then a max in place of the sort (10) or the bitwise search (11)
            n_g = (V + GROUP - 1) // GROUP
            R: tl.constexpr = G_PAD // GC
            o_g = tl.arange(0, GC)
            gm = tl.full([GC], float("-inf"), tl.float32)
            for r in tl.static_range(R):
                o_f = o_g * R + r
                gm = tl.maximum(
                    gm, tl.load(p_gm + o_f, mask=o_f < n_g, other=float("-inf"), volatile=True)
                )
            if STOP == 10:
                res += tl.max(gm, axis=0)
            else:
                res += _kth_largest(gm, tl.maximum(k, 1), GC)
        elif STOP >= 1:
            L, ok = _lower_bound(p_gm, V, m, T, z, k, top_p, use_k, G_PAD, GROUP, GC)
            res += L
            if (STOP >= 2) & ok:
                p_row = p_logits + i_b * s_lb + i_n.to(tl.int64) * s_ln
                count = _gather_candidates(
                    p_row, s_lv, V, L, p_gm, p_wsel + node * G_PAD, p_wcand + node * CAP, GROUP,
                    G_PAD, GC, CAP, READ
                )  # fmt: skip
                res += count.to(tl.float32)
                if (STOP >= 3) & (count <= CAP_S):
                    thr, cut, z2 = _kept_set(
                        p_wcand + node * CAP, count, m, T, z, k, top_p, use_k, use_p,
                        p_wcs + node * NCH, p_wcm + node * NCH, NCH, BLOCK_V, NCH_PAD, CAP_S,
                        SUB, MASS_TILE
                    )  # fmt: skip
                    res += thr.to(tl.float32) + cut.to(tl.float32) + z2
    tl.store(p_res + node, res)


def _graph_us(launch, reps: int, replays: int = 50) -> float:
    """Median µs per ``launch()`` (``harness.graph_us``: ``replays`` replays of a graph of
    ``reps`` of them; fewer of both for a launch of a millisecond or more)."""
    import harness
    import torch

    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    launch()
    t0.record()
    launch()
    t1.record()
    t1.synchronize()
    if t0.elapsed_time(t1) > 0.5:  # ms
        reps, replays = 2, 5
    return harness.graph_us([launch], reps, replays)


def _recorded(call) -> list:
    """The direct launches of one ``call()`` (warmed so that none goes through Triton)."""
    from treeops.kernels import _launch

    for _ in range(3):
        call()
    with _launch.recording() as launches:
        call()
    if launches.missed:
        raise RuntimeError("a launch went through Triton's own path: not recordable")
    return list(launches)


def _relaunch(rec):
    """A function launching recorded launch ``rec`` again on the current stream, without PDL
    (its wait is then a no-op)."""
    import torch

    entry, grid, args = rec
    g = tuple(grid) + (1,) * (3 - len(grid))
    if not entry[4]:
        raise RuntimeError("a launch without Triton's C launcher")
    run, fn, meta, coop = entry[0], entry[1], entry[2], entry[5]

    def go():
        s = torch.cuda.current_stream().cuda_stream
        run(g[0], g[1], g[2], s, fn, coop, False, None, None, meta, None, None, None, *args)

    return go


def exact_sweep(call, reps: int, configs=None) -> tuple[dict, bool]:
    """The op at each (tile, pivots) of ``configs`` (default ``EXACT_CONFIGS``): µs, and
    whether every one accepted what the first did."""
    from treeops.kernels import accept as KA

    times, outs = {}, []
    for tile, piv in configs or EXACT_CONFIGS:
        KA._PLANS.clear()

        def go(tile=tile, piv=piv):
            return call(exact_tile=tile, num_pivots=piv)

        r = go()
        outs.append((r.accepted.clone(), r.accept_len.clone(), r.bonus.clone()))
        times[f"{tile}x{piv}"] = _graph_us(go, reps)
    KA._PLANS.clear()
    same = all(all((a == b).all().item() for a, b in zip(o, outs[0])) for o in outs)
    return times, same


def case(B: int, V: int, reps: int, exact: bool = True, configs=None) -> list[dict]:
    import torch

    import treeops
    from treeops.kernels import accept as KA
    from treeops.kernels._launch import direct

    N = 64
    torch.manual_seed(0)
    par = torch.arange(-1, N - 1, dtype=torch.int32)[None].repeat(B, 1)
    tree = treeops.Tree.from_parents(
        par, torch.full((B,), N, dtype=torch.int32), torch.randint(0, V, (B, N))
    ).to("cuda")
    logits = torch.randn(B, N, V, device="cuda", dtype=torch.bfloat16)
    temp = torch.ones(B, device="cuda")
    u = torch.rand(B, N, device="cuda")
    rows = []
    for k, p in ((0, 1.0), (50, 0.9), (50, 1.0), (0, 0.9)):
        top_k = torch.full((B,), k, dtype=torch.int32, device="cuda")
        top_p = torch.full((B,), p, device="cuda")

        def call(top_k=top_k, top_p=top_p, **kw):
            return KA.accept_launch(tree, logits, temperature=temp, top_k=top_k, top_p=top_p,
                                    uniforms=u, **kw)  # fmt: skip

        row = dict(B=B, V=V, N=N, top_k=k, top_p=p, op_us=_graph_us(call, reps))
        if (k, p) == (0, 0.9) and exact:
            row["exact_us"], row["exact_same"] = exact_sweep(call, reps, configs)
        recs = _recorded(call)
        row["launches_us"] = [_graph_us(_relaunch(r), reps) for r in recs]
        if (k, p) != (0, 1.0) and len(recs) == 3:
            names = direct(KA._accept_kernel).params
            kw = dict(zip(names, recs[1][2], strict=True))
            res = torch.empty(B * N, device="cuda")
            sub = {n: kw[n] for n in _pass2_upto.arg_names if n in kw}
            phases = {}
            for name, stop in STOPS.items():

                def go(stop=stop, res=res, sub=sub):
                    _pass2_upto[(B * N,)](res, **sub, STOP=stop, num_warps=4)

                phases[name] = _graph_us(go, reps)
            row["pass2_phases_us"] = phases
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default=",".join(f"{b}x{v}" for b, v in SHAPES))
    ap.add_argument("--no-exact", action="store_true", help="leave out the exact search's sweep")
    ap.add_argument("--exact-configs", default=None,
                    help="the sweep's TILExPIVOTS,... (default EXACT_CONFIGS)")  # fmt: skip
    a = ap.parse_args(argv)
    configs = None
    if a.exact_configs:
        configs = [tuple(int(x) for x in c.split("x")) for c in a.exact_configs.split(",")]
    import torch

    rows = []
    for s in a.shapes.split(","):
        B, V = (int(x) for x in s.split("x"))
        rows += case(B, V, a.reps, not a.no_exact, configs)
    print(f"{'B':>3} {'V':>7} {'k':>3} {'p':>4} {'op':>7} | launches alone | pass 2 phases")
    for r in rows:
        if "exact_us" in r:
            print(f"{r['B']:>3} {r['V']:>7} top-p alone, exact search (tile x pivots, same: "
                  f"{r['exact_same']}): "
                  + " ".join(f"{c} {x:.1f}" for c, x in r["exact_us"].items()))  # fmt: skip
        ph = r.get("pass2_phases_us", {})
        print(f"{r['B']:>3} {r['V']:>7} {r['top_k']:>3} {r['top_p']:>4} {r['op_us']:7.2f} | "
              + " ".join(f"{x:6.2f}" for x in r["launches_us"]) + " | "
              + " ".join(f"{n} {x:.2f}" for n, x in ph.items()))  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), reps=a.reps, rows=rows), f,
                      indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
