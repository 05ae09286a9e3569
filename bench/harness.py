"""What every benchmark in bench/ shares: timing, floors, GPU and version facts, result files.

Timing. ``graph_us(calls, reps)`` captures ``reps`` rounds of ``calls`` (closures, typically one
per rotated input copy, so the L2 does not hold a small input across calls) in one CUDA graph,
replays it (warm-up replays first) and returns the median over replays of the time per call,
from CUDA events: what a decoder that replays graphs pays, without the host's launch overhead.
``eager_us(fn)`` times plain calls with the host included (``perf_counter`` around a call and a
device sync, median); ``eager_us(fn, host=False)`` times back-to-back calls with CUDA events
(the fallback for a peer that cannot be captured). On a CPU device both time wall-clock calls
(the scripts' dry runs).

Floors. ``ceilings()`` gives the rates a floor divides by: on an H200 (and on a CPU) its measured
device-to-device copy rate ``HBM_BYTES_PER_S`` and dense bf16 rate ``ATTENTION_FLOPS_PER_S``
(docs/benchmarks.md); on any other GPU the same two measured in this process, once (a 1 GiB
copy, an 8,192-cube bf16 matmul), so an H100's rows are held to an H100's floor.
``floor_us(bytes, flops)`` is the largest of bytes / rate, flops / rate and an empty Triton
kernel replayed in a CUDA graph (``empty_kernel_us``, measured once per process): no launch is
faster than that. ``result_doc`` records the rates used.

pytest-benchmark. ``benchmark_graph(benchmark, calls, reps)`` runs the same graph replays
through ``benchmark.pedantic`` with a clock that advances by each replay's device time per call,
so the fixture's statistics (and ``--benchmark-json``) are replayed medians, not host time; the
median is also returned for ``extra_info``. ``needs_cuda()`` says why a benchmark cannot run here.

Results. ``result_doc(**fields)`` starts a JSON document (``gpu``, ``gpu_facts``, ``versions``,
``commit``, ``date``); ``write_json(path, doc)`` writes it atomically, so a stage cut short by
its time limit leaves the rows written so far.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))

HBM_BYTES_PER_S = 4.3e12  # H200 device-to-device copy, measured: the bandwidth floor's rate
ATTENTION_FLOPS_PER_S = 790e12  # H200 dense bf16 tensor-core rate: the attention floor's rate
ROTATE_BYTES = 128e6  # rotated inputs span about twice the H200's 60 MB L2

Call = Callable[[], Any]


# ------------------------------------------------------------------------------- device
def needs_cuda() -> str | None:
    """Why GPU benchmarks cannot run in this process (None if they can)."""
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "needs compiled Triton kernels (TRITON_INTERPRET=1 is set; run bench/ on its own)"
    return None


def _is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def rotation(nbytes: int, calls_per_graph: int = 24, max_copies: int = 32) -> tuple[int, int]:
    """(copies, reps): enough input copies of ``nbytes`` each to span ``ROTATE_BYTES``, and
    ``reps`` rounds over them so that a graph holds about ``calls_per_graph`` calls (one round
    for inputs over 256 MB)."""
    copies = max(1, min(max_copies, math.ceil(ROTATE_BYTES / max(nbytes, 1))))
    reps = max(1, min(12, calls_per_graph // copies))
    if nbytes > 256e6:
        reps = 1
    return copies, reps


# ------------------------------------------------------------------------------- timing
class GraphTimer:
    """``reps`` rounds of ``calls`` captured in one CUDA graph, after one eager round on a side
    stream (compilation, allocations, autotuning stay out of the graph)."""

    def __init__(self, calls: Sequence[Call], reps: int = 1, warmup: int = 3):
        calls = list(calls)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for f in calls:
                f()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for _ in range(reps):
                for f in calls:
                    f()
        self.calls_per_replay = reps * len(calls)
        for _ in range(warmup):
            self.graph.replay()
        torch.cuda.synchronize()

    def replay_us(self) -> float:
        """One replay, timed by CUDA events: µs per call."""
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        self.graph.replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e3 / self.calls_per_replay

    def median_us(self, replays: int = 50) -> float:
        return statistics.median(self.replay_us() for _ in range(replays))


def graph_us(
    calls: Sequence[Call], reps: int = 1, replays: int = 50, device: Any = "cuda"
) -> float:
    """Median µs per call of ``calls`` replayed in a CUDA graph (``GraphTimer``); on a CPU
    ``device``, wall-clock µs per call of one eager round (dry runs)."""
    if not _is_cuda(device):
        return wall_us(calls)
    timer = GraphTimer(calls, reps)
    try:
        return timer.median_us(replays)
    finally:
        del timer


def wall_us(calls: Sequence[Call], rounds: int = 1) -> float:
    """Wall-clock µs per call of ``rounds`` eager rounds of ``calls`` (CPU dry runs)."""
    t0 = time.perf_counter()
    for _ in range(rounds):
        for f in calls:
            f()
    return (time.perf_counter() - t0) * 1e6 / (rounds * len(calls))


def eager_us(fn: Call, iters: int = 20, warmup: int = 3, host: bool = True, device="cuda") -> float:
    """Median µs of eager calls of ``fn``. ``host=True``: each call timed by ``perf_counter``
    up to a device sync after it (launch overhead and the sync included: what a caller that
    waits pays). ``host=False``: CUDA events around ``iters`` back-to-back calls, per call."""
    cuda = _is_cuda(device)
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    if cuda and not host:
        ts = []
        for _ in range(5):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3 / iters)
        return statistics.median(ts)
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


def time_any(fn: Call, device="cuda") -> tuple[float, str]:
    """(µs, method): a graph replay if ``fn`` can be captured, else CUDA events around eager
    calls (method ``"events"``)."""
    if not _is_cuda(device):
        return wall_us([fn]), "wall"
    try:
        return graph_us([fn]), "cudagraph"
    except Exception:  # noqa: BLE001 - a peer that cannot be captured is timed eagerly
        torch.cuda.synchronize()
        return eager_us(fn, host=False), "events"


# ------------------------------------------------------------------------------- floors
@triton.jit
def _empty_kernel(x_ptr):
    pass


_EMPTY_US: dict[str, float] = {}


def empty_kernel_us(device: Any = "cuda") -> float:
    """An empty Triton kernel replayed in a CUDA graph, µs per launch (0 on a CPU device);
    measured once per device and process, with ``ceilings`` (the scripts call this first, so
    neither is measured while a graph captures)."""
    if not _is_cuda(device):
        return 0.0
    ceilings()
    key = str(torch.device(device))
    if key not in _EMPTY_US:
        x = torch.zeros(1, device=device)
        _EMPTY_US[key] = graph_us([lambda: _empty_kernel[(1,)](x)], reps=100)
    return _EMPTY_US[key]


_CEILINGS: dict[str, Any] = {}


def ceilings() -> dict[str, Any]:
    """The floors' rates on the current device: ``hbm_bytes_per_s`` (copy, bytes read +
    written), ``flops_per_s`` (dense bf16 matmul) and ``source``: the H200's measured constants
    there and without a GPU, else measured once per process on this GPU (medians over CUDA
    events: ten copies of 1 GiB, five 8,192-cube matmuls)."""
    if _CEILINGS:
        return _CEILINGS
    name = gpu_name() if needs_cuda() is None else "cpu"
    if name != "cpu" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("harness.ceilings() measures: call it before capturing a graph")
    if name == "cpu" or "H200" in name:
        _CEILINGS.update(hbm_bytes_per_s=HBM_BYTES_PER_S, flops_per_s=ATTENTION_FLOPS_PER_S,
                         source="H200, measured (docs/benchmarks.md)")  # fmt: skip
        return _CEILINGS
    _CEILINGS.update(hbm_bytes_per_s=_copy_rate(), flops_per_s=_matmul_rate(),
                     source=f"{name}, measured in this process")  # fmt: skip
    return _CEILINGS


def _copy_rate(nbytes: int = 1 << 30) -> float:
    """Bytes read + written per second by a device-to-device copy of ``nbytes``."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return round(2 * nbytes / _event_median_s(lambda: y.copy_(x), 10), -9)


def _matmul_rate(n: int = 8192) -> float:
    """Dense bf16 flops per second of an n-cube matmul."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    return round(2 * n**3 / _event_median_s(lambda: a @ a, 5), -12)


def _event_median_s(fn: Call, iters: int) -> float:
    """Median seconds of ``fn`` on the current stream (two warm-up calls first)."""
    fn(), fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def bytes_floor_us(nbytes: float) -> float:
    return nbytes / ceilings()["hbm_bytes_per_s"] * 1e6


def flops_floor_us(flops: float) -> float:
    return flops / ceilings()["flops_per_s"] * 1e6


def floor_us(nbytes: float = 0, flops: float = 0, empty_us: float | None = None) -> float:
    """max(bytes / copy rate, flops / matmul rate (``ceilings``), empty kernel) in µs."""
    return max(bytes_floor_us(nbytes), flops_floor_us(flops), empty_us or 0.0)


# ------------------------------------------------------------------------ pytest-benchmark
class _ReplayClock:
    """pytest-benchmark's timer during ``benchmark_graph``: it advances by the device time per
    call of each replay, so the fixture's statistics are replayed times."""

    __name__ = "cuda_graph_replay_clock"

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def benchmark_graph(
    benchmark, calls: Sequence[Call], reps: int = 1, rounds: int = 50, warmup_rounds: int = 3
) -> float:
    """Time ``calls`` as ``graph_us`` does, through ``benchmark.pedantic`` (one round = one
    replay); returns the median µs per call (also in ``extra_info["treeops_us"]``)."""
    timer = GraphTimer(calls, reps)
    clock = _ReplayClock()
    samples: list[float] = []

    def replay() -> None:
        us = timer.replay_us()
        samples.append(us)
        clock.now += us * 1e-6

    if hasattr(benchmark, "_timer"):  # the fixture reads its clock from here
        benchmark._timer = clock
    benchmark.pedantic(replay, rounds=rounds, warmup_rounds=warmup_rounds, iterations=1)
    median = statistics.median(samples[-rounds:])
    benchmark.extra_info["treeops_us"] = round(median, 3)
    benchmark.extra_info["timing"] = (
        f"CUDA-graph replays, {timer.calls_per_replay} calls per replay, median per call"
    )
    return median


def record(benchmark, row: dict) -> None:
    """Copy a result row's JSON-serialisable entries into ``benchmark.extra_info``."""
    for key, val in row.items():
        try:
            json.dumps(val)
        except (TypeError, ValueError):
            continue
        benchmark.extra_info[key] = val


# ------------------------------------------------------------------------------- facts
def versions() -> dict[str, str]:
    """torch, triton, CUDA, Python, treeops and FlashInfer versions (or why not importable)."""
    v = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": str(torch.version.cuda),
        "python": sys.version.split()[0],
    }
    for mod in ("treeops", "flashinfer"):
        try:
            v[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception as e:  # noqa: BLE001
            v[mod] = f"unavailable: {type(e).__name__}"
    return v


def gpu_name(device: Any = None) -> str:
    if device is not None and not _is_cuda(device):
        return "cpu (dry run)"
    return torch.cuda.get_device_name(device) if torch.cuda.is_available() else "cpu (dry run)"


def gpu_facts(device: Any = None) -> dict[str, Any]:
    """Name, compute capability, SM count, memory and clocks' source of the GPU (empty on CPU)."""
    if not torch.cuda.is_available() or (device is not None and not _is_cuda(device)):
        return {}
    p = torch.cuda.get_device_properties(device)
    return {
        "name": p.name,
        "capability": f"sm_{p.major}{p.minor}",
        "sm_count": p.multi_processor_count,
        "memory_gib": round(p.total_memory / 2**30, 1),
        "l2_mib": round(getattr(p, "L2_cache_size", 0) / 2**20, 1),
    }


def commit(explicit: str | None = None, mark_dirty: bool = False) -> str:
    """The commit the results belong to: ``explicit``, else ``TREEOPS_COMMIT`` (the device's
    copy of .git can lag the working tree; ``bench/run_h200.sh`` exports it), else git HEAD
    (with " (dirty)" if ``mark_dirty`` and tracked files changed), else "unknown"."""
    if explicit:
        return explicit
    if os.environ.get("TREEOPS_COMMIT"):
        return os.environ["TREEOPS_COMMIT"]

    def git(*a: str) -> str:
        out = subprocess.run(["git", *a], capture_output=True, text=True, cwd=HERE, timeout=10)
        return out.stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        dirty = mark_dirty and bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + (" (dirty)" if head and dirty else "")


def result_doc(device: Any = None, commit_id: str | None = None, **fields: Any) -> dict:
    """A results document: ``gpu``, ``gpu_facts``, ``versions``, ``commit``, ``date``,
    ``ceilings`` (the floors' rates), then ``fields`` (``rows`` and the script's own
    settings)."""
    doc = {
        "gpu": gpu_name(device),
        "gpu_facts": gpu_facts(device),
        "versions": versions(),
        "commit": commit(commit_id),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "ceilings": dict(ceilings()),
    }
    doc.update(fields)
    return doc


def write_json(path: str, doc: dict) -> str:
    """Write ``doc`` to ``path`` atomically (a temporary file, then a rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)
    return path


class SavedRows(list):
    """Rows that rewrite ``path`` each time one is appended (``doc(rows)`` builds the document),
    so a run stopped at its stage's time limit keeps every row it measured."""

    def __init__(self, path: str, doc: Callable[[list[dict]], dict]):
        super().__init__()
        self.path, self.doc = path, doc

    def append(self, row: dict) -> None:
        super().append(row)
        write_json(self.path, self.doc(list(self)))


def ratios(rows: Iterable[dict], peers: Sequence[str] = ("torch",)) -> None:
    """Add ``treeops_over_floor`` and ``treeops_over_<peer>`` to rows with a treeops time."""
    for r in rows:
        t = r.get("treeops_us")
        if not t:
            continue
        if r.get("floor_us"):
            r["treeops_over_floor"] = t / r["floor_us"]
        for p in peers:
            if r.get(f"{p}_us"):
                r[f"treeops_over_{p}"] = t / r[f"{p}_us"]


def print_table(doc: dict, path: str, rows: Sequence[dict], keys: Sequence[str], width=12) -> None:
    """The run's GPU, commit and file, then one line per row of ``keys``."""

    def fmt(x):
        return "-" if x is None else (f"{x:.2f}" if isinstance(x, float) else str(x))

    print(f"\n{doc['gpu']}  commit {doc['commit'][:10]}  -> {path}")
    print(" | ".join(f"{k:>{width}}" for k in keys))
    for r in rows:
        print(" | ".join(f"{fmt(r.get(k)):>{width}}" for k in keys))


def parse_cli(doc: str, json_name: str, argv=None):
    """(args, device) of a one-op script: ``--out DIR`` (for ``json_name``), ``--batches``,
    ``--dry-run`` (the CPU), ``--commit``; without CUDA only ``--dry-run`` runs."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", required=True, help=f"directory for {json_name}")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cpu" if args.dry_run else "cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("needs a CUDA device (or --dry-run)")
    return args, dev
