"""What limits each bookkeeping kernel, read from the GPU's hardware counters (Nsight Compute).

For every case (an op at a benchmark shape) the script runs itself once under ``ncu`` with the
case's call inside a profiled region (``torch.cuda.profiler.start/stop``; the call's warm-up,
which compiles, runs before it), and keeps, per kernel the call launches, the counters that say
where it stands: duration, DRAM and compute throughput as a share of the peak (Speed Of Light),
achieved against theoretical occupancy, registers, grid, waves per SM, and the warp cycles per
issued instruction. ``limiter`` names the larger of the DRAM and SM shares (below 60 % of both:
latency, i.e. too little parallelism or serial dependences). Clocks are left alone
(``--clock-control none``), so the durations are those of a graph replay's kernels, not an
ncu-locked clock.

    python bench/kernel_limits.py --out DIR [--cases accept_greedy_b64,build_layer_b1]
    python bench/kernel_limits.py --list
    python bench/kernel_limits.py --out DIR --source --cases build_layer_b1

``--source`` instead samples where each kernel's warps stall, per instruction (ncu's
SourceCounters section), and writes ``DIR/<case>_source.csv.gz``: ncu's source page with the
Python line each SASS instruction came from (Triton keeps line info), for reading by hand or
with ``--summarise FILE`` (stall samples summed per Python line, the top lines printed).

Writes ``DIR/kernel_limits.json`` (one entry per case; a case that failed carries its error).
Needs a CUDA GPU whose runtime lets ncu read the counters (see the device notes); the shapes are
those of ``bench_accept``, ``bench_build_tree``, ``bench_graft``, ``bench_compact_kv`` and
``bench_tree_attention``.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats")
KEEP = {  # (section, metric) -> key in the JSON
    ("GPU Speed Of Light Throughput", "Duration"): "duration",
    ("GPU Speed Of Light Throughput", "DRAM Throughput"): "dram_pct",
    ("GPU Speed Of Light Throughput", "Memory Throughput"): "memory_pct",
    ("GPU Speed Of Light Throughput", "Compute (SM) Throughput"): "sm_pct",
    ("Occupancy", "Achieved Occupancy"): "achieved_occupancy_pct",
    ("Occupancy", "Theoretical Occupancy"): "theoretical_occupancy_pct",
    ("Launch Statistics", "Registers Per Thread"): "registers",
    ("Launch Statistics", "Grid Size"): "grid",
    ("Launch Statistics", "Block Size"): "block",
    ("Launch Statistics", "Waves Per SM"): "waves_per_sm",
    ("Warp State Statistics", "Warp Cycles Per Issued Instruction"): "cycles_per_issue",
}


# ------------------------------------------------------------------------------------ cases
def _accept(B: int, V: int, sample: bool, top: bool = False) -> Callable[[], object]:
    import bench_accept as A
    import torch

    import treeops

    tree = A.bench_tree(B, 64, V, B * 131 + V)
    lg = A.bench_logits(tree, V, B * 131 + V, 16.0 if sample else 4.0)
    if not sample:
        return lambda: treeops.accept_greedy(tree, lg)
    T = torch.full((B,), 0.8, device="cuda")
    k = torch.full((B,), 50 if top else 0, device="cuda", dtype=torch.int32)
    p = torch.full((B,), 0.9 if top else 1.0, device="cuda")
    u = torch.rand(B, 64, device="cuda")
    return lambda: treeops.accept_sample(tree, lg, T, k, p, u)


def _build_layer(B: int, V: int) -> Callable[[], object]:
    import bench_build_tree as BT

    pol = BT.make_policy("eagle", 64, BT.synthetic_table())
    st, _, _ = BT.fresh_state(pol, B, V, "cuda")
    x0, x1 = BT.logits_buffers(B, V, "cuda", count=2)
    BT.expand_at(x0, st, pol, 0)  # layer 0 from the root: layer 1 then has a full frontier
    return lambda: BT.expand_at(x1, st, pol, 1)


def _graft_update(B: int, V: int) -> Callable[[], object]:
    import bench_accept as A
    import torch

    import treeops

    tree = A.bench_tree(B, 64, V, 7)
    lg = torch.randn(B, 64, V, device="cuda").to(torch.bfloat16)
    table = treeops.AdjacencyTable(V, k=8, device="cuda")
    return lambda: table.update(tree, lg)


def _compact_kv(B: int) -> Callable[[], object]:
    import bench_accept as A
    import torch

    import treeops

    L, H, D, page, N, ctx = 32, 8, 128, 16, 64, 1024
    tree = A.bench_tree(B, N, 32000, 3)
    acc = treeops.accept_greedy(tree, A.bench_logits(tree, 32000, 3, 4.0))
    pages = B * ((ctx + N) // page + 1)
    k = torch.randn(L, pages, page, H, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    bt = torch.arange(pages, device="cuda", dtype=torch.int32).view(B, -1)
    seq = torch.full((B,), ctx, device="cuda", dtype=torch.int32)
    return lambda: treeops.compact_kv(k, v, bt, seq, tree, acc.accepted, acc.accept_len)


def _prune(B: int) -> Callable[[], object]:
    import bench_accept as A

    import treeops

    tree = A.bench_tree(B, 64, 32000, 5)
    return lambda: treeops.prune(tree, 40)


def _tree_attention(B: int, ctx: int, n: int) -> Callable[[], object]:
    import bench_tree_attention as TA

    return TA.treeops_fn(TA.Case(B, ctx, n))


CASES: dict[str, Callable[[], Callable[[], object]]] = {
    "accept_greedy_b1": lambda: _accept(1, 32000, False),
    "accept_greedy_b64": lambda: _accept(64, 32000, False),
    "accept_sample_b8": lambda: _accept(8, 32000, True),
    "accept_sample_b64": lambda: _accept(64, 32000, True),
    "accept_sample_topk_topp_b8": lambda: _accept(8, 32000, True, top=True),
    "accept_greedy_b1_v128256": lambda: _accept(1, 128256, False),
    "accept_sample_topk_topp_b1_v128256": lambda: _accept(1, 128256, True, top=True),
    "build_layer_b1": lambda: _build_layer(1, 32000),
    "build_layer_b64": lambda: _build_layer(64, 32000),
    "graft_update_b1": lambda: _graft_update(1, 32000),
    "graft_update_b1_v128256": lambda: _graft_update(1, 128256),
    "graft_update_b64": lambda: _graft_update(64, 32000),
    "compact_kv_b64": lambda: _compact_kv(64),
    "prune_b64": lambda: _prune(64),
    "tree_attention_b8_ctx4096_n64": lambda: _tree_attention(8, 4096, 64),
    "tree_attention_b1_ctx512_n8": lambda: _tree_attention(1, 512, 8),
    "tree_attention_b32_ctx4096_n64": lambda: _tree_attention(32, 4096, 64),
    "tree_attention_b1_ctx16384_n64": lambda: _tree_attention(1, 16384, 64),
    "tree_attention_b4_ctx32768_n128": lambda: _tree_attention(4, 32768, 128),
}


# ------------------------------------------------------------------------------------ inner
def inner(case: str) -> None:
    """Under ncu: build the case, warm it up (compiles), then one call in the profiled region."""
    import torch

    fn = CASES[case]()
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


# ------------------------------------------------------------------------------------ outer
def parse(text: str) -> list[dict]:
    """ncu's ``--csv --page details`` output -> one dict per profiled kernel (launch order)."""
    start = text.find('"ID"')
    if start < 0:
        raise RuntimeError("no ncu CSV in the output: " + text[-400:])
    kernels: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO(text[start:])):
        ent = kernels.setdefault(row["ID"], {"kernel": row["Kernel Name"].split("(")[0]})
        key = KEEP.get((row["Section Name"], row["Metric Name"]))
        if key is None:
            continue
        val = row["Metric Value"].replace(",", "")
        try:
            ent[key] = float(val)
        except ValueError:
            ent[key] = val
        if key == "duration":
            ent["duration_unit"] = row["Metric Unit"]
    out = [kernels[i] for i in sorted(kernels, key=int)]
    for k in out:
        dram, sm = k.get("dram_pct", 0.0), k.get("sm_pct", 0.0)
        if max(dram, sm) < 60.0:
            k["limiter"] = f"latency (DRAM {dram:.0f} %, SM {sm:.0f} % of peak)"
        else:
            k["limiter"] = "DRAM bandwidth" if dram >= sm else "SM throughput"
    return out


def run_case(case: str, timeout_s: float) -> dict:
    cmd = ["ncu", "--clock-control", "none", "--profile-from-start", "off", "--csv",
           "--page", "details", "--print-units", "base"]  # fmt: skip
    for s in SECTIONS:
        cmd += ["--section", s]
    cmd += [sys.executable, os.path.abspath(__file__), "--inner", case]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"case": case, "error": f"timed out after {timeout_s:.0f} s"}
    ent: dict = {"case": case, "seconds": round(time.time() - t0, 1)}
    if p.returncode != 0:
        ent["error"] = (p.stderr or p.stdout)[-800:]
        return ent
    try:
        ent["kernels"] = parse(p.stdout)
    except RuntimeError as e:
        ent["error"] = str(e)
    return ent


def run_source(case: str, out_dir: str, timeout_s: float, interval: str = "auto") -> dict:
    """ncu's per-instruction stall sampling of the case's kernels -> ``<case>_source.csv.gz``;
    ``interval``: ncu's ``--warp-sampling-interval`` (n: a sample every 2^(5 + n) cycles per SM; a
    short kernel on few SMs needs 0 to be sampled more than a few hundred times)."""
    import gzip

    rep = os.path.join("/tmp", f"treeops_{case}")
    cmd = ["ncu", "--clock-control", "none", "--profile-from-start", "off", "--section",
           "SourceCounters", "--section", "WarpStateStats", "--warp-sampling-interval", interval,
           "--import-source", "yes", "-f", "-o",
           rep, sys.executable, os.path.abspath(__file__), "--inner", case]  # fmt: skip
    ent: dict = {"case": case}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if p.returncode != 0:
            return {**ent, "error": (p.stderr or p.stdout)[-800:]}
        for mode in ("cuda,sass", "sass"):  # older ncu releases know only "sass"
            q = subprocess.run(["ncu", "-i", rep + ".ncu-rep", "--page", "source", "--csv",
                                "--print-source", mode], capture_output=True, text=True,
                               timeout=timeout_s)  # fmt: skip
            if q.returncode == 0 and q.stdout.strip():
                path = os.path.join(out_dir, f"{case}_source.csv.gz")
                with gzip.open(path, "wt") as f:
                    f.write(q.stdout)
                return {**ent, "source": path, "mode": mode, "chars": len(q.stdout)}
            ent["error"] = f"{mode}: " + (q.stderr or q.stdout)[-400:]
    except subprocess.TimeoutExpired:
        ent["error"] = f"timed out after {timeout_s:.0f} s"
    return ent


def summarise(path: str, top: int = 25) -> list[tuple[float, str, str]]:
    """Stall samples per (kernel, Python line) of a ``--source`` file, largest first. ncu's source
    page comes in blocks, each headed by ``"File Path"`` and ``"Function Name"`` rows; in a
    block, a row whose first column is a line number carries that line's samples summed over its
    SASS (the address rows under it)."""
    import gzip

    text = gzip.open(path, "rt").read() if path.endswith(".gz") else open(path).read()
    per: dict[tuple[str, str], list] = {}
    file = func = "?"
    col = None
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if row[0] == "File Path":
            file = os.path.basename(row[1])
        elif row[0] == "Function Name":
            func = row[1]
        elif row[0] == "Line No":
            col = row.index("Warp Stall Sampling (All Samples)")
        elif col is not None and row[0].isdigit() and col < len(row):
            if not row[col].replace(",", "").replace(".", "").isdigit():
                continue  # "-": a line with no instructions of its own
            ent = per.setdefault((func, f"{file}:{row[0]}"), [0.0, row[1].strip()[:70]])
            ent[0] += float(row[col].replace(",", "") or 0)
    ranked = sorted(((n, f"{fn} {where}", src) for (fn, where), (n, src) in per.items()),
                    key=lambda t: -t[0])  # fmt: skip
    return ranked[:top]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="directory for kernel_limits.json")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--timeout-s", type=float, default=90.0, help="per case")
    ap.add_argument("--inner", help=argparse.SUPPRESS)
    ap.add_argument("--list", action="store_true", help="print the cases and stop")
    ap.add_argument("--source", action="store_true", help="stall samples per instruction")
    ap.add_argument("--summarise", help="a --source file: samples per Python line")
    ap.add_argument("--sampling-interval", default="auto", help="--source: ncu's, 0-31 or auto")
    args = ap.parse_args(argv)
    if args.summarise:
        for n, where, src in summarise(args.summarise):
            print(f"{n:8.0f}  {where:48s} {src}")
        return 0
    if args.list:
        print("\n".join(CASES))
        return 0
    if args.inner:
        inner(args.inner)
        return 0
    if not args.out:
        ap.error("--out is required")
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown cases {unknown}; --list shows them")
    os.makedirs(args.out, exist_ok=True)
    if args.source:
        for case in cases:
            print(json.dumps(run_source(case, args.out, args.timeout_s, args.sampling_interval)))
        return 0
    doc = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "commit": os.environ.get("TREEOPS_COMMIT"), "sections": SECTIONS,
           "cases": []}  # fmt: skip
    path = os.path.join(args.out, "kernel_limits.json")
    for case in cases:
        ent = run_case(case, args.timeout_s)
        doc["cases"].append(ent)
        with open(path, "w") as f:  # after every case: a later timeout keeps what ran
            json.dump(doc, f, indent=1)
        for k in ent.get("kernels", []):
            print(f"{case:32s} {k['kernel'][:40]:40s} {k.get('duration', 0):>10} "
                  f"DRAM {k.get('dram_pct', 0):5.1f}% SM {k.get('sm_pct', 0):5.1f}% "
                  f"occ {k.get('achieved_occupancy_pct', 0):5.1f}% -> {k['limiter']}")  # fmt: skip
        if "error" in ent:
            print(f"{case:32s} ERROR {ent['error'][-200:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
