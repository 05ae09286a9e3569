"""Where an eager call's host time goes: per public op, at ``bench_host.py``'s tiny shapes, the
Python functions that take it and the CUDA runtime and driver calls each call makes.

    python bench/host_profile.py [--ops build_tree_emit,accept_greedy] [--calls 300] [--out F]

Per op, on CUDA when there is a GPU (else on the CPU, where the ops run their references):

* ``loop_us``: back-to-back eager calls, one sync at the end, per call (GC paused; the host's
  cost where, as at these shapes, the device keeps up);
* ``top``: the ``--top`` functions with the most own time (cProfile over ``--calls`` calls;
  cProfile's own cost inflates every entry, so read them relative to each other), each as
  [function, µs per call, calls per call];
* ``api``: CUDA runtime and driver calls per eager call (torch.profiler's host events named
  ``cuda*`` or ``cu*``: launches, copies, event records, allocations, device switches) and
  ``kernels``: device kernels per call, by name.

``bench_host.py`` says how much an eager call costs; this says where that goes.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402
from bench_host import OPS, cases, per_call_us  # noqa: E402


def loop_us(fn, calls: int, cuda: bool) -> float:
    """bench_host's back-to-back calls (GC paused), the device drained before and after."""
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    per_call_us(fn, calls)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / calls


def top_functions(fn, calls: int, top: int) -> list[list]:
    """[function, own µs per call, calls per call] of the ``top`` functions by own time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    out = []
    for (path, line, name), (_cc, nc, tt, _ct, _callers) in rows:
        where = f"{os.path.basename(path)}:{line}({name})" if line else name
        out.append([where, round(tt * 1e6 / calls, 2), round(nc / calls, 2)])
    return out


def device_calls(fn, calls: int, cuda: bool) -> tuple[dict, dict]:
    """CUDA runtime/driver calls and device kernels per eager call (empty on the CPU)."""
    if not cuda:
        return {}, {}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    api, kernels = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name[:80]] += 1
        elif e.name.startswith("cu"):
            api[e.name] += 1
    per = lambda c: {k: round(v / calls, 2) for k, v in c.most_common()}  # noqa: E731
    return per(api), per(kernels)


def profile_ops(ops: list[str], calls: int, top: int) -> list[dict]:
    cuda = torch.cuda.is_available()
    fns = cases(torch.device("cuda" if cuda else "cpu"))
    rows = []
    for op in ops:
        fn, row = fns[op], {"op": op}
        try:
            for _ in range(5):  # compiles, caches, workspaces
                fn()
            row["loop_us"] = round(min(loop_us(fn, calls, cuda) for _ in range(3)), 2)
            row["top"] = top_functions(fn, calls, top)
            row["api"], row["kernels"] = device_calls(fn, min(calls, 20), cuda)
        except Exception as e:  # noqa: BLE001 - one op's failure is reported, not fatal
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default=None, help="comma list (default: every op of bench_host)")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    args = ap.parse_args(argv)
    ops = [o for o in (args.ops or ",".join(OPS)).split(",") if o]
    unknown = set(ops) - set(OPS)
    if unknown:
        ap.error(f"unknown ops {sorted(unknown)}")
    rows = profile_ops(ops, args.calls, args.top)
    for r in rows:
        print(f"=== {r['op']}: {r.get('loop_us', r.get('error'))} us per call")
        for name, us, n in r.get("top", []):
            print(f"  {us:8.2f} us  x{n:<5} {name}")
        if r.get("api"):
            print("  api per call: " + ", ".join(f"{k} {v}" for k, v in r["api"].items()))
            print("  kernels per call: " + ", ".join(f"{k} {v}" for k, v in r["kernels"].items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if torch.cuda.is_available()
                       else "cpu", "calls": args.calls, "rows": rows}, f, indent=1)  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
