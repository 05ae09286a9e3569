"""Host cost of one eager call of every public op, at tiny shapes (the launch's host side only).

Two measurements per op:

* CPU, always (the number treeops controls): the public function on CPU tensors with each op's
  CPU backend swapped for its CUDA backend (the Triton launcher) and the ops' direct path taken
  for CPU tensors too (``treeops._library.DIRECT = 2``), so one call runs the argument checks,
  the direct-path guard (or, with ``TREEOPS_DISPATCH=1``, the custom-op dispatch) and the
  launcher's host code as on the GPU. Triton is pointed at a stand-in driver
  (``bench/compile_check.py``'s) and every kernel's compiled form is a stub, so nothing compiles
  or runs on a device. ``host_us``: the call with every launch a no-op (the direct launches of
  ``kernels/_launch.py`` and Triton's ``JITFunction.run``): treeops' checks, guard and launcher
  prep; ``triton_us``: what the launch's Python path adds on top (the direct launch's key, cache
  lookup and call of the compiled kernel's launcher, here the stub's; with
  ``TREEOPS_DIRECT_LAUNCH=0``, Triton's binding, specialisation and cache lookup; not the C
  launch itself); ``launch_misses``: launches that went through ``JITFunction.run`` in the
  timed rounds (0 when every launch was direct). Each the best of several rounds of
  back-to-back calls, the two alternating.
* CUDA, when a GPU is there: ``eager_us`` (``harness.eager_us``: a call and a device sync,
  perf_counter) minus ``replay_us`` (``harness.graph_us``: the same call replayed in a CUDA
  graph) = ``overhead_us``, the host time an eager call adds (the sync's latency included);
  ``return_us``: from a call's start to its return, after a sync (the host's part of
  ``eager_us``; the rest is the wait for the device);
  ``loop_us``: back-to-back eager calls and one sync, per call (the host's cost where, as at
  these shapes, the device keeps up); ``gpu_launch_misses`` as above, for the GPU loops. Then the
  same GPU columns from a fresh process through the old paths, as ``old_*`` (``--no-compare``
  skips them). ``baselines``: the same columns for an empty Triton kernel and a one-element
  torch ``add_``: the launch and the sync alone, below which no op's overhead can go.

    python bench/bench_host.py [--out bench/results/host.json] [--quick] [--ops a,b]
    TREEOPS_DISPATCH=1 TREEOPS_DIRECT_LAUNCH=0 python bench/bench_host.py ...  # the old paths

Must run without ``TRITON_INTERPRET`` (the launchers' GPU tile choices are timed).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
# the lean paths (treeops/_library.py, kernels/_launch.py; the defaults): this bench times them
# unless the environment turns them off; its second process (``old_*`` columns) the old paths
os.environ.setdefault("TREEOPS_DISPATCH", "0")
os.environ.setdefault("TREEOPS_DIRECT_LAUNCH", "1")

import harness  # noqa: E402
import torch  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import treeops  # noqa: E402
from treeops import _library  # noqa: E402
from treeops.kernels import _replay  # noqa: E402

Call = Callable[[], object]
BUDGET_US = 25.0
"""The goal for every op's eager host overhead on the H200's host."""


# ------------------------------------------------------------------------------------ cases
def _tree(B: int, N: int, dev) -> treeops.Tree:
    par = torch.tensor([[-1] + [(i - 1) // 2 for i in range(1, N)]] * B, dtype=torch.int32)
    tok = torch.arange(B * N).view(B, N) % 50 + 1
    sc = torch.linspace(1, 0.1, N).expand(B, N).contiguous()
    return treeops.Tree.from_parents(par, torch.full((B,), N, dtype=torch.int32), tok, sc).to(dev)


OPS = (
    "tree_attention",
    "tree_attention_prepared",
    "kv_append",
    "kv_append_prepared",
    "rope",
    "accept_greedy",
    "accept_sample",
    "accept_sample_no_trunc",
    "compact_kv",
    "build_tree_expand",
    "build_tree_emit",
    "build_tree_emit_out",
    "cast_select",
    "cast_width",
    "cast_depth",
    "cast_rerank",
    "adjacency_update",
    "adjacency_update_logits",
    "adjacency_retrieve",
    "graft",
    "graft_out",
    "graft_merge",
    "graft_merge_out",
    "graft_tail",
    "graft_tail_out",
    "prune",
    "prune_out",
    "prune_checkpoint",
)
"""Every public op's entry point (``adjacency_update_logits``: the update from logits, which
runs a second launch; ``build_tree_emit_out``, ``graft*_out`` and ``prune_out``: the call into
the caller's ``Tree`` (``out=``), as a decoder's step makes it, no allocation;
``accept_sample_no_trunc``: without top-k / top-p tensors (two launches); ``*_prepared``:
the op's call through ``treeops.prepare``, its tensors rebound per call as a layer loop
rebinds them). A plain call
replays its recorded launches (``treeops.kernels._replay``) unless ``TREEOPS_REPLAY=0``."""

REPLAYS_OF = {
    "tree_attention": ("treeops.tree_attention", "_REPLAYS"),
    "kv_append": ("treeops.kv_append", "_APPEND_REPLAYS"),
    "rope": ("treeops.kv_append", "_ROPE_REPLAYS"),
    "accept_greedy": ("treeops.accept", "_GREEDY_REPLAYS"),
    "accept_sample": ("treeops.accept", "_SAMPLE_REPLAYS"),
    "accept_sample_no_trunc": ("treeops.accept", "_SAMPLE_REPLAYS"),
    "compact_kv": ("treeops.compact_kv", "_REPLAYS"),
    "build_tree_expand": ("treeops.build_tree", "_EXPAND_REPLAYS"),
    "build_tree_emit": ("treeops.build_tree", "_EMIT_REPLAYS"),
    "build_tree_emit_out": ("treeops.build_tree", "_EMIT_REPLAYS"),
    "adjacency_update": ("treeops.graft", "_UPDATE_REPLAYS"),
    "adjacency_update_logits": ("treeops.graft", "_UPDATE_REPLAYS"),
    "adjacency_retrieve": ("treeops.graft", "_RETRIEVE_REPLAYS"),
    "graft": ("treeops.graft", "_GRAFT_REPLAYS"),
    "graft_merge": ("treeops.graft", "_GRAFT_MERGE_REPLAYS"),
    "graft_out": ("treeops.graft", "_GRAFT_REPLAYS"),
    "graft_merge_out": ("treeops.graft", "_GRAFT_MERGE_REPLAYS"),
    "graft_tail": ("treeops.graft_tail", "_GRAFT_TAIL_REPLAYS"),
    "graft_tail_out": ("treeops.graft_tail", "_GRAFT_TAIL_REPLAYS"),
    "prune": ("treeops.prune", "_PRUNE_REPLAYS"),
    "prune_out": ("treeops.prune", "_PRUNE_REPLAYS"),
    "prune_checkpoint": ("treeops.prune", "_CHECKPOINT_REPLAYS"),
    "cast_select": ("treeops.cast", "_REPLAYS", "select"),
    "cast_width": ("treeops.cast", "_REPLAYS", "width"),
    "cast_depth": ("treeops.cast", "_REPLAYS", "depth"),
    "cast_rerank": ("treeops.cast", "_REPLAYS", "rerank"),
}
"""Each op's ``Replays`` (module, attribute[, key]): a row counts its replays."""


def replays_of(op: str):
    """``op``'s ``Replays`` (None: it has none)."""
    where = REPLAYS_OF.get(op)
    if where is None:
        return None
    obj = getattr(sys.modules[where[0]], where[1], None)
    return obj[where[2]] if obj is not None and len(where) > 2 else obj


def cases(dev: torch.device) -> dict[str, Call]:
    """One closure per op of ``OPS`` at a tiny shape (B=2, N=8, V=64, D=64, page 16)."""
    g = torch.Generator().manual_seed(0)
    B, N, HQ, HKV, D, PAGE, V = 2, 8, 4, 2, 64, 16, 64

    def rnd(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype).to(dev)

    def i32(*vals):
        return torch.tensor(vals, dtype=torch.int32, device=dev)

    tree = _tree(B, N, dev)
    bf = torch.bfloat16
    q, k, v = rnd(B, N, HQ, D, dtype=bf), rnd(B, N, HKV, D, dtype=bf), rnd(B, N, HKV, D, dtype=bf)
    kc, vc = rnd(B * 4, PAGE, HKV, D, dtype=bf), rnd(B * 4, PAGE, HKV, D, dtype=bf)
    bt = torch.arange(B * 4, dtype=torch.int32, device=dev).view(B, 4)
    sl = i32(*[20] * B)
    pos = tree.positions(sl)
    logits = rnd(B, N, V)
    temp, top_k, top_p = rnd(B).abs() + 0.5, i32(*[0] * B), torch.ones(B, device=dev)
    uni = torch.rand(B, N, generator=g).to(dev)
    acc = treeops.accept_greedy(tree, logits)
    stacked_k, stacked_v = kc[None].clone(), vc[None].clone()
    table = treeops.AdjacencyTable(V, 4, device=dev)
    topk = torch.topk(logits, 4, dim=-1).indices.to(torch.int32)
    template = treeops.RankTemplate.from_paths([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
    table.update(tree, topk_ids=topk)
    retrieved = table.retrieve(tree.tokens[:, 0], template)
    ckpt = treeops.PruneCheckpoints()
    keep, best = ckpt.start(B, dev), torch.rand(B, generator=g).to(dev)
    eagle = treeops.EagleStatic(depth=3, topk=4, budget=N)
    state = treeops.DraftState.new(eagle, tree.tokens[:, 0].contiguous(), sl.long())
    draft_logits = rnd(B, eagle.max_width, V)
    scores, costs = torch.rand(B, 16, generator=g).to(dev), torch.linspace(1, 2, 16, device=dev)
    u_hist, c0 = torch.tensor([1.0, 0.5], device=dev), torch.tensor(0.25, device=dev)

    def expand():
        state.layer = 0
        treeops.build_tree_expand(draft_logits, state, eagle)

    def emit():
        state.layer = 1
        treeops.build_tree_emit(state, eagle)

    tree_out = treeops.Tree.empty(B, eagle.capacity, dev)
    graft_out = treeops.Tree.empty(B, N, dev)  # the Graft ops' and prune's out= rows

    def emit_out():  # into the caller's tree, as a decoder's step does: no allocation
        state.layer = 1
        treeops.build_tree_emit(state, eagle, out=tree_out)

    out = torch.empty_like(q)
    attn = treeops.prepare(
        treeops.tree_attention, q, kc, vc, bt, sl, tree, out=out,
        rebind=("q", "k_cache", "v_cache", "out"),
    )  # fmt: skip
    append = treeops.prepare(
        treeops.kv_append, k, v, kc, vc, bt, sl, tree.num_nodes, tree.depth,
        rebind=("k", "v", "k_cache", "v_cache"),
    )  # fmt: skip

    def attn_prepared():
        return attn(q, kc, vc, out)

    def append_prepared():
        return append(k, v, kc, vc)

    attn_prepared.replayer, append_prepared.replayer = attn, append  # type: ignore[attr-defined]
    calls = {
        "tree_attention": lambda: treeops.tree_attention(q, kc, vc, bt, sl, tree),
        "tree_attention_prepared": attn_prepared,
        "kv_append_prepared": append_prepared,
        "kv_append": lambda: treeops.kv_append(k, v, kc, vc, bt, sl, tree.num_nodes, tree.depth),
        "rope": lambda: treeops.rope(q, pos),
        "accept_greedy": lambda: treeops.accept_greedy(tree, logits),
        "accept_sample": lambda: treeops.accept_sample(tree, logits, temp, top_k, top_p, uni),
        "accept_sample_no_trunc": lambda: treeops.accept_sample(
            tree, logits, temp, None, None, uni
        ),
        "compact_kv": lambda: treeops.compact_kv(
            stacked_k, stacked_v, bt, sl, tree, acc.accepted, acc.accept_len
        ),
        "build_tree_expand": expand,
        "build_tree_emit": emit,
        "build_tree_emit_out": emit_out,
        "cast_select": lambda: treeops.cast_select(costs, costs, 0.5),
        "cast_width": lambda: treeops.cast_width(scores, costs, 0.5),
        "cast_depth": lambda: treeops.cast_depth(u_hist, c0, 1.0, 4),
        "cast_rerank": lambda: treeops.cast_rerank(scores, costs, 0.5),
        "adjacency_update": lambda: table.update(tree, topk_ids=topk),
        "adjacency_update_logits": lambda: table.update(tree, logits),
        "adjacency_retrieve": lambda: table.retrieve(tree.tokens[:, 0], template),
        "graft": lambda: treeops.graft(tree, table, template, N),
        "graft_out": lambda: treeops.graft(tree, table, template, N, out=graft_out),
        "graft_merge": lambda: treeops.graft_merge(tree, retrieved, N),
        "graft_merge_out": lambda: treeops.graft_merge(tree, retrieved, N, out=graft_out),
        "graft_tail": lambda: treeops.graft_tail(tree, table, 4, N),
        "graft_tail_out": lambda: treeops.graft_tail(tree, table, 4, N, out=graft_out),
        "prune": lambda: treeops.prune(tree, 4),
        "prune_out": lambda: treeops.prune(tree, 4, out=graft_out),
        "prune_checkpoint": lambda: ckpt.check(0, best, keep),
    }
    return calls


# ------------------------------------------------------------------------------------ timing
def per_call_us(fn: Call, iters: int) -> float:
    """Mean µs of ``iters`` back-to-back calls (GC paused)."""
    gc_was = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e6 / iters
    finally:
        if gc_was:
            gc.enable()


class _StubKernel:
    """A compiled kernel that launches nothing (what ``JITFunction.run`` calls after its cache
    lookup)."""

    function = None
    packed_metadata = None

    def launch_metadata(self, *args):
        return None

    def run(self, *args):
        return None


def _stub_compile(self, key, signature, device, constexprs, options, attrs, warmup):
    kernel = _StubKernel()
    self.device_caches[device][0][key] = kernel
    return kernel


def _no_launch(self, *args, grid, warmup, **kwargs):
    return None


@contextlib.contextmanager
def launchers_on_cpu():
    """Every treeops op's CPU kernel is its CUDA backend; Triton compiles nothing (stub kernels)
    against a stand-in driver. The CPU kernels come back on exit; the driver stays (this
    process launches nothing afterwards)."""
    from compile_check import _Driver

    from treeops.kernels import _launch

    # on a GPU machine the real kernels sit in the caches under device 0, the stand-in's device
    # too: set them aside so that no real kernel is launched on CPU pointers
    _launch.clear_all()
    real_caches = {lau.fn: lau.fn.device_caches for lau in _launch.LAUNCHERS}
    for fn in real_caches:
        fn.device_caches = collections.defaultdict(fn.create_binder)
    driver.set_active(_Driver())
    saved = JITFunction._do_compile
    direct_was = _library.DIRECT
    if direct_was:  # the ops' direct path (no dispatcher) for the CPU tensors too
        _library.DIRECT = 2
    JITFunction._do_compile = _stub_compile
    # torch before 2.13 refuses a second Python kernel for an (op, key) it has in this registry
    # of Python registrations (the dispatcher itself allows the override and undoes it when the
    # library is destroyed): hide treeops' CPU entries while registering, put them back after
    registry = getattr(torch.library, "_impls", None)
    ours = {f"treeops/{name}/CPU" for name in _library.CUDA_BACKENDS}
    hidden = ours & registry if isinstance(registry, set) else set()
    lib = torch.library.Library("treeops", "IMPL")
    try:
        if hidden:
            registry -= hidden
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
            for name, cuda in _library.CUDA_BACKENDS.items():
                lib.impl(name, cuda, "CPU")
        yield
    finally:
        lib._destroy()
        # the library's finalizer removes its entries from the registry once more: none left
        lib._op_impls.clear()
        if hidden:
            registry |= hidden
        JITFunction._do_compile = saved
        _library.DIRECT = direct_was
        _launch.clear_all()  # the stub kernels cached for the stand-in driver
        for fn, caches in real_caches.items():
            fn.device_caches = caches


def cpu_rows(ops: list[str], iters: int, repeats: int) -> list[dict]:
    from treeops.kernels import _launch

    rows = []
    with launchers_on_cpu():
        calls = cases(torch.device("cpu"))
        real_run = JITFunction.run
        for op in ops:
            fn = calls[op]
            row: dict = {"op": op}
            try:
                for _ in range(3):  # first calls: stub compiles, cached buffers, launchers
                    fn()
                direct = {lau: lau.launch for lau in _launch.LAUNCHERS}
                # the two variants alternate, each keeps its best round: the machine's other
                # load hits both alike
                own = total = float("inf")
                misses = None
                # a Prepared, or the op's own Replays (plain calls replay)
                prepared = getattr(fn, "replayer", None) or (
                    replays_of(op) if _replay.ENABLED else None
                )
                for _ in range(repeats):
                    if prepared is None:  # a replay calls the launchers itself: no split
                        _launches_off(direct)
                        own = min(own, per_call_us(fn, iters))
                        _launches_on(direct, real_run)
                    if misses is None:
                        misses = _launch_misses()
                        replays = prepared.replays if prepared is not None else 0
                    total = min(total, per_call_us(fn, iters))
                own = total if prepared is not None else own
                row.update(host_us=own, triton_us=max(total - own, 0.0), total_us=total)
                row["launch_misses"] = _launch_misses() - misses
                if prepared is not None:  # every timed call replayed the recorded launches
                    row["replayed"] = prepared.replays - replays == repeats * iters
            except Exception as e:  # noqa: BLE001 - one op's failure is reported, not fatal
                row["error"] = f"{type(e).__name__}: {e}"
            finally:
                JITFunction.run = real_run
                for lau, launch in direct.items():
                    lau.launch = launch
            rows.append(row)
    return rows


def _no_direct_launch(grid, *args, **kwargs) -> None:
    return None


def _launches_off(direct: dict) -> None:
    """Every launch a no-op: the direct launches (``kernels/_launch.py``) and Triton's run."""
    JITFunction.run = _no_launch
    for lau in direct:
        lau.launch = _no_direct_launch


def _launches_on(direct: dict, real_run) -> None:
    JITFunction.run = real_run
    for lau, launch in direct.items():
        lau.launch = launch


def _return_us(fn, n: int) -> float:
    """Median µs from an eager call's start to its return, each call after a device sync: the
    host's part of ``eager_us``. What ``eager_us`` adds is the wait for the device (the launch's
    latency, the kernels, the sync itself)."""
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(ts)


def cuda_rows(ops: list[str], quick: bool) -> dict[str, dict]:
    """``eager_us`` (a call and a sync), ``replay_us`` (CUDA graph), ``overhead_us`` (their
    difference) and ``loop_us``: wall time per call of back-to-back eager calls with one sync at
    the end, which is the host's cost per call where the device is faster than the host (tiny
    shapes)."""
    calls = cases(torch.device("cuda"))
    n = 50 if quick else 300
    out = {}
    for op in ops:
        fn, row = calls[op], {}
        try:
            row["eager_us"] = harness.eager_us(fn, iters=n)
            row["return_us"] = _return_us(fn, n)
            row["replay_us"] = harness.graph_us([fn], reps=20)
            row["overhead_us"] = row["eager_us"] - row["replay_us"]
            torch.cuda.synchronize()
            misses = _launch_misses()
            row["loop_us"] = min(harness.wall_us([fn], rounds=n) for _ in range(3))
            torch.cuda.synchronize()
            # launches that went through JITFunction.run in the timed loops (0: every launch
            # direct, kernels/_launch.py; with TREEOPS_DIRECT_LAUNCH=0 every launch)
            row["gpu_launch_misses"] = _launch_misses() - misses
        except Exception as e:  # noqa: BLE001 - one op's failure is reported, not fatal
            torch.cuda.synchronize()
            row["cuda_error"] = f"{type(e).__name__}: {e}"
        out[op] = row
    return out


def baseline_rows(quick: bool) -> dict[str, dict]:
    """The same GPU columns for the least an eager call can cost on this machine: an empty Triton
    kernel launched directly (``kernels/_launch.py``, one argument) and a one-element torch
    ``add_``. Their ``overhead_us`` is the launch and the sync alone, what no op's can go below."""
    from treeops.kernels._launch import direct

    x = torch.zeros(1, device="cuda")
    calls = {
        "empty_triton_kernel": lambda: direct(harness._empty_kernel).launch((1,), x),
        "torch_add_one_element": lambda: x.add_(1.0),
    }
    n = 50 if quick else 300
    out = {}
    for name, fn in calls.items():
        try:
            row = {"eager_us": harness.eager_us(fn, iters=n), "return_us": _return_us(fn, n)}
            row["replay_us"] = harness.graph_us([fn], reps=20)
            row["overhead_us"] = row["eager_us"] - row["replay_us"]
            torch.cuda.synchronize()
            row["loop_us"] = min(harness.wall_us([fn], rounds=n) for _ in range(3))
            torch.cuda.synchronize()
            out[name] = {k: round(v, 2) for k, v in row.items()}
        except Exception as e:  # noqa: BLE001 - a baseline's failure is reported, not fatal
            torch.cuda.synchronize()
            out[name] = {"cuda_error": f"{type(e).__name__}: {e}"[:200]}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON file for the results")
    ap.add_argument("--quick", action="store_true", help="fewer calls per op (the CPU test)")
    ap.add_argument("--ops", default=None, help="comma-separated subset of the ops")
    ap.add_argument("--commit", default=None)
    ap.add_argument(
        "--no-compare",
        action="store_true",
        help="on a GPU, skip the second run through the old paths (the old_* columns)",
    )
    ap.add_argument("--gpu-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit(
            "bench_host.py times the GPU launchers' host code: run it without TRITON_INTERPRET"
        )
    ops = list(OPS)
    if args.ops:
        ops = [o for o in args.ops.split(",") if o]
        unknown = set(ops) - set(OPS)
        if unknown:
            ap.error(f"unknown ops {sorted(unknown)}")
    iters, repeats = (50, 3) if args.quick else (400, 7)
    cuda = harness.needs_cuda() is None
    by_op = cuda_rows(ops, args.quick) if cuda else {}  # before the stand-in driver replaces CUDA
    baselines = baseline_rows(args.quick) if cuda else {}
    if args.gpu_only:
        rows = [{"op": op} for op in ops]
    elif cuda and not args.no_compare:
        _compare_old(by_op, ops, args.quick)
    try:
        rows = rows if args.gpu_only else cpu_rows(ops, iters, repeats)
    except RuntimeError as e:
        # a torch that refuses the CPU kernels' swap (launchers_on_cpu): no CPU rows there,
        # the GPU rows stand alone
        print(f"CPU rows skipped: {e}", file=sys.stderr)
        rows = [{"op": op, "cpu_rows_skipped": str(e)[:160]} for op in ops]
    for r in rows:
        r.update(by_op.get(r["op"], {}))
    doc = harness.result_doc(
        commit_id=args.commit,
        host_cpu=_cpu_name(),
        budget_us=BUDGET_US,
        paths={"direct_op": bool(_library.DIRECT), "direct_launch": _direct_launch_enabled()},
        timing=(
            "host_us: eager call on CPU tensors through the CUDA launchers, launches no-ops; "
            "triton_us: the launch's Python path on top (stub kernels); overhead_us (GPU): "
            "eager_us - replay_us; loop_us (GPU): back-to-back eager calls, one sync; "
            "launch_misses / gpu_launch_misses: launches through JITFunction.run in the timed "
            "loops (0: all direct)"
        ),
        baselines=baselines,
        rows=rows,
    )
    keys = ["op", "host_us", "triton_us", "total_us", "launch_misses"]
    if cuda:
        keys += ["eager_us", "replay_us", "overhead_us", "loop_us", "gpu_launch_misses"]
        if any("old_loop_us" in r for r in rows):
            keys += ["old_overhead_us", "old_loop_us"]
    if args.out:
        harness.write_json(args.out, doc)
    harness.print_table(doc, args.out or "-", rows, keys, width=10)
    for r in rows:
        if "error" in r:
            print(f"{r['op']}: {r['error']}")
    for name, b in baselines.items():
        print(f"baseline {name}: " + ", ".join(f"{k} {v}" for k, v in b.items()))
    return doc


def _launch_misses() -> int:
    from treeops.kernels import _launch

    return sum(lau.misses for lau in _launch.LAUNCHERS)


def _direct_launch_enabled() -> bool:
    from treeops.kernels import _launch

    return _launch.ENABLED


def _compare_old(by_op: dict, ops: list[str], quick: bool) -> None:
    """The GPU columns again in a fresh process through the old paths (every call through the
    dispatcher, every launch through ``JITFunction.run``, no replays), as ``old_*``: before and
    after on the same machine in one run."""
    import json
    import subprocess
    import tempfile

    env = dict(os.environ, TREEOPS_DISPATCH="1", TREEOPS_DIRECT_LAUNCH="0", TREEOPS_REPLAY="0")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "old.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--gpu-only", "--out", out,
               "--ops", ",".join(ops)] + (["--quick"] if quick else [])  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"old paths' run failed: {proc.stderr[-2000:]}", file=sys.stderr)
            return
        with open(out) as f:
            old = {r["op"]: r for r in json.load(f)["rows"]}
    for op, row in by_op.items():
        for k in ("eager_us", "replay_us", "overhead_us", "loop_us", "gpu_launch_misses",
                  "cuda_error"):  # fmt: skip
            if k in old.get(op, {}):
                row[f"old_{k}"] = old[op][k]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


if __name__ == "__main__":
    main()
