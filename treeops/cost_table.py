"""``CostTable``: measured forward times ``f(B, c, n)`` of the target and the draft, which CAST
prices its decisions with (docs/design.md op 4).

``S_T(B)[k][n]`` / ``S_D(B)[k][n]``: the target's / draft's forward time at batch size B, context
bucket k and n tokens per request. Tables are measured on the GPU (CUDA-graph replays), stored as
JSON, and copied to the device once per batch size for the kernels (``device_tables``).
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import triton

from ._version import __version__

__all__ = ["CostTable", "default_meta", "timing_meta"]


@dataclass
class CostTable:
    """Forward times ``f(B, c, n)`` of the target (``S_T``) and the draft (``S_D``, with its LM
    head).

    ``target[i, k, n - 1]`` is the time of one target forward of ``n`` new tokens per request at
    batch ``batch_sizes[i]`` and context ``(k + 1) * L`` (the context grid ``c = kL``,
    ``k = 1..M``); ``draft`` likewise. Both are float64 tensors ``[len(batch_sizes), M, n_max]``
    in microseconds, made non-decreasing in ``n`` on construction (running max over measurement
    noise). ``meta`` records the GPU, model identities, versions and whatever else the
    calibration knew (e.g. that the target was timed on a few layers and scaled).

    Example:
        >>> t = CostTable.from_functions(lambda B, c, n: 100 + B * n, lambda B, c, n: 10 + B * n,
        ...                              batch_sizes=[1, 8], L=1024, M=4, n_max=16)
        >>> t.select(3000), t.select(10**6), t.batch_index(5)
        (3072, 4096, 1)
    """

    batch_sizes: list[int]
    L: int
    target: torch.Tensor
    draft: torch.Tensor
    meta: dict[str, Any] = field(default_factory=dict)
    _dev_cache: dict[Any, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        bs = [int(b) for b in self.batch_sizes]
        if not bs or any(b < 1 for b in bs) or sorted(set(bs)) != bs:
            raise ValueError(
                f"Invalid value of batch_sizes: expected increasing positive ints, got {bs}"
            )
        if not isinstance(self.L, int) or self.L < 1:
            raise ValueError(f"Invalid value of L: expected a positive int, got {self.L!r}")
        for name in ("target", "draft"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[0] != len(bs):
                got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"Invalid shape of {name}: expected [{len(bs)}, M, n_max], got {got}"
                )
            t = t.detach().to("cpu", torch.float64)
            if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
                raise ValueError(
                    f"Invalid value in {name}: expected finite non-negative times, got NaN, inf "
                    "or a negative number"
                )
            setattr(self, name, torch.cummax(t, dim=2).values.contiguous())
        if self.target.shape != self.draft.shape:
            raise ValueError(
                f"Invalid shape of draft: expected {list(self.target.shape)} (as target), "
                f"got {list(self.draft.shape)}"
            )
        if bool((self.target[:, :, 0] <= 0).any()):
            raise ValueError("Invalid value in target: expected S_T(B)[c][1] > 0 (it divides)")
        self.batch_sizes = bs

    def __repr__(self) -> str:
        return (
            f"CostTable(batch_sizes={self.batch_sizes}, L={self.L}, M={self.M}, "
            f"n_max={self.n_max}, gpu={self.meta.get('gpu')!r})"
        )

    # ----------------------------------------------------------------- lookup
    @property
    def M(self) -> int:
        """Number of context buckets (contexts L, 2L, ..., ML)."""
        return int(self.target.shape[1])

    @property
    def n_max(self) -> int:
        return int(self.target.shape[2])

    def bucket(self, c: int) -> int:
        """Index of context ``c``'s bucket: ``min(c // L, M - 1)``
        (``select(c) = L * (bucket + 1)``)."""
        return min(max(int(c), 0) // self.L, self.M - 1)

    def select(self, c: int) -> int:
        """``select(c) = L * (min(floor(c / L), M - 1) + 1)``: the grid context pricing ``c``."""
        return self.L * (self.bucket(c) + 1)

    def batch_index(self, B: int) -> int:
        """Row of batch size ``B``: the smallest measured batch >= B (the largest if none is)."""
        for i, b in enumerate(self.batch_sizes):
            if b >= B:
                return i
        return len(self.batch_sizes) - 1

    def S_T(self, B: int, c: int) -> torch.Tensor:
        """Target times [n_max] (float64, µs) for batch ``B`` at context ``select(c)``."""
        return self.target[self.batch_index(B), self.bucket(c)]

    def S_D(self, B: int, c: int) -> torch.Tensor:
        """Draft times [n_max] (float64, µs) for batch ``B`` at context ``select(c)``."""
        return self.draft[self.batch_index(B), self.bucket(c)]

    def width_costs(self, B: int, c: int, K: int) -> torch.Tensor:
        """``c_k = S_D(B)[select(c)][k] / S_T(B)[select(c)][1]``, k = 1..K: [K] float64."""
        self._check_k("K", K)
        return self.S_D(B, c)[:K] / self.S_T(B, c)[0]

    def rerank_costs(self, B: int, c: int, N: int) -> torch.Tensor:
        """``c_k = S_T(B)[select(c)][k] / S_T(B)[select(c)][1]``, k = 1..N: [N] float64."""
        self._check_k("N", N)
        return self.S_T(B, c)[:N] / self.S_T(B, c)[0]

    def _check_k(self, name: str, k: int) -> None:
        if not 1 <= k <= self.n_max:
            raise ValueError(
                f"Invalid value of {name}: expected 1 <= {name} <= n_max = {self.n_max}, got {k}"
            )

    def device_tables(
        self, B: int, device: torch.device | str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(target, draft) rows of batch ``B`` as float32 ``[M, n_max]`` tensors on ``device``,
        cached: the view the selection kernels read (they bucket the context on the device)."""
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            # "cuda" and "cuda:0" must hit the same entry: a miss inside CUDA-graph capture
            # would copy host -> device, which capture forbids.
            dev = torch.device("cuda", torch.cuda.current_device())
        key = (self.batch_index(B), str(dev))
        if key not in self._dev_cache:
            i = key[0]
            self._dev_cache[key] = (
                self.target[i].to(device=device, dtype=torch.float32).contiguous(),
                self.draft[i].to(device=device, dtype=torch.float32).contiguous(),
            )
        return self._dev_cache[key]

    # ------------------------------------------------------------ construction
    @classmethod
    def from_functions(
        cls,
        target_cost: Callable[[int, int, int], float],
        draft_cost: Callable[[int, int, int], float],
        batch_sizes: Sequence[int],
        L: int,
        M: int,
        n_max: int,
        meta: dict[str, Any] | None = None,
    ) -> CostTable:
        """A table from cost functions ``f(B, c, n)`` (µs), evaluated on the full grid."""
        shape = (len(batch_sizes), M, n_max)
        tt = torch.empty(shape, dtype=torch.float64)
        dd = torch.empty(shape, dtype=torch.float64)
        for i, B in enumerate(batch_sizes):
            for k in range(M):
                for n in range(1, n_max + 1):
                    tt[i, k, n - 1] = float(target_cost(B, (k + 1) * L, n))
                    dd[i, k, n - 1] = float(draft_cost(B, (k + 1) * L, n))
        return cls(list(batch_sizes), L, tt, dd, dict(meta or {}))

    @staticmethod
    def measure(
        fn: Callable[[int, int, int], object],
        B: int,
        c: int,
        n: int,
        *,
        warmup: int = 3,
        iters: int = 10,
        device: torch.device | str | None = None,
        graph: bool | None = None,
        fallbacks: list[dict[str, Any]] | None = None,
    ) -> float:
        """Median time in µs of one ``fn(B, c, n)``.

        With ``graph`` (default: on a CUDA device), the call is captured once into a CUDA graph
        (after ``warmup`` eager calls on a side stream, as ``torch.cuda.graph`` requires) and
        the replays are timed with CUDA events (``warmup`` untimed replays first; each timed
        replay queued behind an untimed one so that its CPU launch is not in the time): what a
        decoder running CUDA graphs pays, without eager launch overhead. ``fn`` must then be
        capturable: static inputs, no host syncs, no host -> device copies. If the capture
        fails, the point is timed eagerly instead and a record ``{"B", "c", "n", "error"}`` is
        appended to ``fallbacks`` (when given). Without ``graph``: ``warmup`` calls, then
        ``iters`` eager calls timed by CUDA events on a CUDA device, ``time.perf_counter``
        otherwise.
        """
        dev = _device(device)
        use_graph = dev.type == "cuda" if graph is None else bool(graph)
        if use_graph:
            try:
                return _time_graph_replay(fn, B, c, n, warmup=warmup, iters=iters, device=dev)
            except Exception as e:  # capture unsupported by fn: time this point eagerly
                if fallbacks is not None:
                    err = f"{type(e).__name__}: {e}"
                    if e.__context__ is not None:  # capture_end's error hides the first one
                        cause = e.__context__
                        err += f" (after {type(cause).__name__}: {cause})"
                    fallbacks.append({"B": B, "c": c, "n": n, "error": err[:500]})
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
        for _ in range(warmup):
            fn(B, c, n)
        times = []
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            for _ in range(iters):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn(B, c, n)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
        else:
            for _ in range(iters):
                t0 = time.perf_counter()
                fn(B, c, n)
                times.append((time.perf_counter() - t0) * 1e6)
        return float(statistics.median(times))

    @staticmethod
    def warm_up_gpu(device: torch.device | str | None = None, ms: float = 200.0) -> float:
        """Keep the GPU busy with bf16 matmuls for about ``ms`` milliseconds so that its clocks
        leave idle before the first measurement (an idle H200 sat at 345 MHz). Returns the
        milliseconds spent; a no-op returning 0.0 off CUDA."""
        dev = _device(device)
        if dev.type != "cuda" or ms <= 0:
            return 0.0
        a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
        b = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        while (time.perf_counter() - t0) * 1e3 < ms:
            for _ in range(20):  # about 20 x 0.15 ms of work per host check
                torch.mm(a, b)
            torch.cuda.synchronize(dev)
        return (time.perf_counter() - t0) * 1e3

    @classmethod
    def measure_grid(
        cls,
        fn: Callable[[int, int, int], object],
        batch_sizes: Sequence[int],
        L: int,
        M: int,
        n_max: int,
        *,
        ns: Sequence[int] | None = None,
        warmup: int = 3,
        iters: int = 10,
        device: torch.device | str | None = None,
        progress: Callable[[str], None] | None = None,
        name: str = "",
        graph: bool | None = None,
        fallbacks: list[dict[str, Any]] | None = None,
    ) -> torch.Tensor:
        """Times of ``fn(B, c, n)`` on the grid: [len(batch_sizes), M, n_max] float64 µs, measured
        at contexts ``c = L, 2L, ..., ML`` and token counts ``ns`` (default every n in 1..n_max;
        must start at 1 and end at n_max), linearly interpolated between measured n (not yet
        made non-decreasing: the constructor does that). ``graph`` and ``fallbacks`` as in
        ``measure`` (each fallback record also gets ``"name": name``)."""
        ns = sorted(set(ns)) if ns is not None else list(range(1, n_max + 1))
        if ns[0] != 1 or ns[-1] != n_max:
            raise ValueError(
                f"Invalid value of ns: expected to start at 1 and end at n_max = "
                f"{n_max}, got {ns[0]}..{ns[-1]}"
            )
        out = torch.zeros(len(batch_sizes), M, n_max, dtype=torch.float64)
        for i, B in enumerate(batch_sizes):
            for k in range(M):
                c = (k + 1) * L
                fell: list[dict[str, Any]] = []
                pts = [
                    cls.measure(
                        fn,
                        B,
                        c,
                        n,
                        warmup=warmup,
                        iters=iters,
                        device=device,
                        graph=graph,
                        fallbacks=fell,
                    )
                    for n in ns
                ]
                for rec in fell:
                    rec["name"] = name
                if fallbacks is not None:
                    fallbacks.extend(fell)
                if progress is not None:
                    note = f" ({len(fell)} points timed eagerly: capture failed)" if fell else ""
                    progress(f"{name} B={B} c={c}: " + " ".join(f"{v:.1f}" for v in pts) + note)
                for n in range(1, n_max + 1):
                    j = max(idx for idx, m in enumerate(ns) if m <= n)
                    if ns[j] == n:
                        out[i, k, n - 1] = pts[j]
                    else:
                        f = (n - ns[j]) / (ns[j + 1] - ns[j])
                        out[i, k, n - 1] = pts[j] + f * (pts[j + 1] - pts[j])
        return out

    @classmethod
    def calibrate(
        cls,
        target_fn: Callable[[int, int, int], object],
        draft_fn: Callable[[int, int, int], object],
        batch_sizes: Sequence[int],
        L: int,
        M: int,
        n_max: int,
        *,
        ns: Sequence[int] | None = None,
        warmup: int = 3,
        iters: int = 10,
        device: torch.device | str | None = None,
        meta: dict[str, Any] | None = None,
        progress: Callable[[str], None] | None = None,
        graph: bool | None = None,
        gpu_warmup_ms: float = 200.0,
    ) -> CostTable:
        """Measure ``f(B, c, n)`` of ``target_fn`` and ``draft_fn`` (each runs one forward of ``n``
        new tokens per request at batch ``B`` and context ``c``; the draft's includes its LM head)
        on the grid of ``measure_grid`` and build the table (non-decreasing in n).

        On a CUDA device (``graph`` defaults to True there) every point is captured once into a
        CUDA graph and its replays are timed (``measure``), after ``gpu_warmup_ms`` of matmuls
        to raise the clocks; the callables must then be capturable (static inputs, no host
        syncs), points whose capture fails are timed eagerly and listed in
        ``meta["graph_fallbacks"]``. ``graph=False`` times eager calls (CUDA events on a GPU,
        ``perf_counter`` on the CPU). ``meta`` is stored with the GPU name, versions and the
        timing protocol (``timing_method``, ``warmup``, ``iters``, ``gpu_warmup_ms``) added.
        """
        dev = _device(device)
        use_graph = dev.type == "cuda" if graph is None else bool(graph)
        warmed = cls.warm_up_gpu(dev, gpu_warmup_ms)
        fallbacks: list[dict[str, Any]] = []
        kw = dict(
            ns=ns,
            warmup=warmup,
            iters=iters,
            device=dev,
            progress=progress,
            graph=use_graph,
            fallbacks=fallbacks,
        )
        tt = cls.measure_grid(target_fn, batch_sizes, L, M, n_max, name="target", **kw)
        dd = cls.measure_grid(draft_fn, batch_sizes, L, M, n_max, name="draft", **kw)
        info = default_meta(dev)
        info.update(meta or {})
        info.setdefault("measured_ns", sorted(set(ns)) if ns is not None else "all")
        info.update(timing_meta(dev, use_graph, warmup, iters, warmed, fallbacks))
        return cls(list(batch_sizes), L, tt, dd, info)

    # ---------------------------------------------------------------- save/load
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "treeops.CostTable/1",
            "units": "microseconds",
            "batch_sizes": self.batch_sizes,
            "L": self.L,
            "M": self.M,
            "n_max": self.n_max,
            "meta": self.meta,
            "target": self.target.tolist(),
            "draft": self.draft.tolist(),
        }

    def save(self, path: str | Path) -> None:
        """Write the table as JSON (times, grid, and ``meta``: GPU name, models, versions)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        d = json.loads(Path(path).read_text())
        if d.get("format") != "treeops.CostTable/1":
            raise ValueError(
                f"Invalid cost table file {path}: expected format "
                f"'treeops.CostTable/1', got {d.get('format')!r}"
            )
        return cls(
            d["batch_sizes"],
            int(d["L"]),
            torch.tensor(d["target"], dtype=torch.float64),
            torch.tensor(d["draft"], dtype=torch.float64),
            d.get("meta", {}),
        )


def default_meta(device: torch.device | str | None = None) -> dict[str, Any]:
    """GPU name and library versions, recorded with every calibrated table."""
    dev = _device(device)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({platform.processor()})"
    tv = __version__
    return {
        "gpu": gpu,
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "treeops": tv,
            "cuda": torch.version.cuda,
        },
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _device(device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _time_graph_replay(
    fn: Callable[[int, int, int], object],
    B: int,
    c: int,
    n: int,
    *,
    warmup: int,
    iters: int,
    device: torch.device,
) -> float:
    """Median µs of a CUDA-graph replay of ``fn(B, c, n)`` (``CostTable.measure``'s graph path).

    ``warmup`` (at least 1) eager calls on a side stream, capture on that stream, ``warmup``
    untimed replays, then ``iters`` samples: an untimed replay (so the GPU is busy while the
    timed one is queued: its CPU launch latency stays out of the time) followed by the timed
    replay between two CUDA events. Raises whatever the capture raises."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise RuntimeError(f"CUDA graph capture needs a CUDA device, got {dev}")
    with torch.cuda.device(dev):
        cur = torch.cuda.current_stream(dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            for _ in range(max(warmup, 1)):
                fn(B, c, n)
        cur.wait_stream(side)
        torch.cuda.synchronize(dev)
        g = torch.cuda.CUDAGraph()
        out = None
        try:
            with torch.cuda.graph(g, stream=side):
                out = fn(B, c, n)  # kept alive until the replays are done
            for _ in range(max(warmup, 1)):
                g.replay()
            torch.cuda.synchronize(dev)
            times = []
            for _ in range(iters):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                g.replay()
                start.record(cur)
                g.replay()
                end.record(cur)
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
        finally:
            del out
            del g
    return float(statistics.median(times))


def timing_meta(
    device: torch.device | str | None,
    graph: bool,
    warmup: int,
    iters: int,
    gpu_warmup_ms: float,
    fallbacks: Sequence[dict[str, Any]],
) -> dict[str, Any]:
    """The timing protocol of a calibration, for a table's ``meta``: ``method``
    (``"cuda_graph_replay"``, ``"cuda_events_eager"`` or ``"perf_counter_eager"``), a sentence
    saying what it means, ``warmup``, ``iters``, ``gpu_warmup_ms`` (clock warm-up done before
    the first point) and ``graph_fallbacks`` (the points whose capture failed and that were timed
    eagerly, with the error)."""
    dev = _device(device)
    if graph and dev.type == "cuda":
        method = "cuda_graph_replay"
        how = (
            f"each (B, c, n) point captured once into a CUDA graph after {max(warmup, 1)} eager "
            f"calls on a side stream; {max(warmup, 1)} untimed replays, then the median of "
            f"{iters} replays timed by CUDA events (each queued behind an untimed replay)"
        )
    elif dev.type == "cuda":
        method = "cuda_events_eager"
        how = f"{warmup} eager warm-up calls, then the median of {iters} eager calls (CUDA events)"
    else:
        method = "perf_counter_eager"
        how = f"{warmup} warm-up calls, then the median of {iters} calls (time.perf_counter)"
    if fallbacks:
        how += f"; {len(fallbacks)} points fell back to eager timing (graph_fallbacks)"
    return {
        "method": method,
        "timing": how,
        "warmup": warmup,
        "iters": iters,
        "gpu_warmup_ms": round(float(gpu_warmup_ms), 1),
        "graph_fallbacks": [dict(f) for f in fallbacks],
    }


# --------------------------------------------------------------------------------- Algorithm 1
