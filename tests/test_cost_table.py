"""The CAST cost table (treeops.cost_table): lookups, normalisation, storage, calibration and its
CUDA-graph timing."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import treeops
from treeops.reference import cast as ref


# ------------------------------------------------------------------------------ cost table
def table(**kw):
    kw.setdefault("batch_sizes", [1, 4, 16])
    return treeops.CostTable.from_functions(
        lambda B, c, n: 100 + c / 1024 + max(0, n - 8) * B,
        lambda B, c, n: 10 + c / 4096 + n * B / 8,
        L=kw.pop("L", 1024),
        M=kw.pop("M", 4),
        n_max=kw.pop("n_max", 32),
        **kw,
    )


@given(st.integers(0, 10**6), st.integers(1, 4096), st.integers(1, 40))
def test_select_formula(c, L, M):
    t = treeops.CostTable([1], L, torch.ones(1, M, 2), torch.ones(1, M, 2))
    want = L * (min(c // L, M - 1) + 1)
    assert t.select(c) == want
    assert t.select(c) % L == 0 and L <= t.select(c) <= L * M
    if c >= L and c < L * M:
        assert t.select(c) > c - L  # the bucket's grid point is within one step above


def test_batch_between_measured_uses_next_larger():
    t = table(batch_sizes=[1, 2, 4, 8, 16, 32, 64])
    assert [t.batch_index(B) for B in (1, 2, 3, 5, 8, 9, 33, 64, 65)] == [0, 1, 2, 3, 3, 4, 6, 6, 6]
    assert torch.equal(t.S_T(3, 2047), t.target[2, 1])  # select(2047) = 2048 = 2L
    assert torch.equal(t.S_D(7, 99999), t.draft[3, 3])


def test_costs_are_normalised_by_the_target_single_token():
    t = table()
    wc = t.width_costs(4, 2100, 10)
    assert torch.allclose(wc, t.draft[1, 2, :10] / t.target[1, 2, 0])
    rc = t.rerank_costs(4, 2100, 32)
    assert float(rc[0]) == 1.0 and torch.allclose(rc, t.target[1, 2] / t.target[1, 2, 0])
    with pytest.raises(ValueError, match=r"Invalid value of N: expected 1 <= N <= n_max = 32"):
        t.rerank_costs(4, 0, 33)


def test_stored_non_decreasing_in_n():
    g = torch.Generator().manual_seed(1)
    noisy = 100 + torch.rand(2, 3, 50, generator=g) * 5
    t = treeops.CostTable([1, 8], 512, noisy, noisy / 10)
    assert (t.target[:, :, 1:] >= t.target[:, :, :-1]).all()
    assert (t.draft[:, :, 1:] >= t.draft[:, :, :-1]).all()
    assert torch.equal(t.target, torch.cummax(noisy.double(), dim=2).values)


def test_save_load_roundtrip(tmp_path):
    t = table()
    t.meta.update({"gpu": "NVIDIA H200", "target": "llama-8b-shape", "versions": {"torch": "x"}})
    p = tmp_path / "t.json"
    t.save(p)
    u = treeops.CostTable.load(p)
    assert u.batch_sizes == t.batch_sizes and u.L == t.L and u.meta == t.meta
    assert torch.equal(u.target, t.target) and torch.equal(u.draft, t.draft)
    d = json.loads(p.read_text())
    assert d["format"] == "treeops.CostTable/1" and d["units"] == "microseconds"
    d["format"] = "other"
    p.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"expected format 'treeops.CostTable/1', got 'other'"):
        treeops.CostTable.load(p)


def test_calibrate_interpolates_and_records_metadata(monkeypatch):
    calls = []

    def fake_measure(fn, B, c, n, **kw):
        calls.append((fn.__name__, B, c, n))
        return float(100 * B + c / 1000 + (n if n != 9 else 50))  # a noisy spike at n = 9

    monkeypatch.setattr(treeops.CostTable, "measure", staticmethod(fake_measure))

    def target(B, c, n):
        return None

    def draft(B, c, n):
        return None

    t = treeops.CostTable.calibrate(
        target, draft, [1, 2], L=1000, M=2, n_max=17, ns=[1, 9, 17], meta={"target": "toy"}
    )
    assert len(calls) == 2 * 2 * 2 * 3
    assert {c for _, _, c, _ in calls} == {1000, 2000}
    row = t.target[0, 1].tolist()  # B=1, c=2000: 103 at n=1, 152 at n=9, 119 at n=17
    assert row[0] == 103 and row[8] == 152
    assert row[4] == pytest.approx(103 + 0.5 * 49)  # interpolated between n = 1 and 9
    assert all(v == 152 for v in row[9:])  # running max flattens the spike's far side
    for key in ("gpu", "versions", "created", "measured_ns"):
        assert key in t.meta
    assert t.meta["target"] == "toy"


def test_measure_runs_the_callable_on_cpu():
    hits = []
    us = treeops.CostTable.measure(
        lambda B, c, n: hits.append((B, c, n)), 2, 64, 3, warmup=2, iters=5, device="cpu"
    )
    assert len(hits) == 7 and hits[0] == (2, 64, 3) and us >= 0


# ---------------------------------------------------- calibration timing: CUDA-graph replay path
class _FakeCuda:
    """Stand-ins for the torch.cuda calls of ``CostTable.measure``'s graph path, so that its
    control flow runs on the CPU: a fake clock advances 1000 µs per eager ``fn`` call and 200 µs
    per graph replay; ``fail`` makes the capture raise (as a host sync inside capture does)."""

    EAGER_MS, REPLAY_MS = 1.0, 0.2

    def __init__(self, monkeypatch, fail=lambda B, c, n: False):
        self.clock, self.log, self.capturing, self.fail = 0.0, [], False, fail
        fake = self

        class Stream:
            def __init__(self, name="side"):
                self.name = name

            def wait_stream(self, other):
                fake.log.append(("wait", self.name, other.name))

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.t = None

            def record(self, stream=None):
                self.t = fake.clock

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return end.t - self.t

        class CUDAGraph:
            def replay(self):
                fake.log.append(("replay",))
                fake.clock += fake.REPLAY_MS

        class graph:
            def __init__(self, g, stream=None):
                assert isinstance(g, CUDAGraph) and stream is not None
                self.stream = stream

            def __enter__(self):
                fake.capturing = True
                fake.log.append(("capture_begin", self.stream.name))

            def __exit__(self, *exc):
                fake.capturing = False
                fake.log.append(("capture_end",))

        class stream_ctx:
            def __init__(self, s):
                self.s = s

            def __enter__(self):
                fake.log.append(("enter", self.s.name))

            def __exit__(self, *exc):
                fake.log.append(("exit", self.s.name))

        class device_ctx:
            def __init__(self, d):
                pass

            def __enter__(self):
                pass

            def __exit__(self, *exc):
                pass

        for name, val in {
            "Stream": lambda dev=None: Stream(),
            "current_stream": lambda dev=None: Stream("cur"),
            "stream": stream_ctx,
            "device": device_ctx,
            "synchronize": lambda dev=None: fake.log.append(("sync",)),
            "Event": Event,
            "CUDAGraph": CUDAGraph,
            "graph": graph,
            "get_device_name": lambda dev=None: "Fake H200",
        }.items():
            monkeypatch.setattr(torch.cuda, name, val)

    def fn(self, B, c, n):
        if self.capturing:
            self.log.append(("captured_call", B, c, n))
            if self.fail(B, c, n):
                raise RuntimeError("operation not permitted when stream is capturing")
            return torch.zeros(1)
        self.log.append(("eager_call", B, c, n))
        self.clock += self.EAGER_MS
        return torch.zeros(1)


def test_measure_graph_path_captures_once_and_times_replays(monkeypatch):
    fake = _FakeCuda(monkeypatch)
    fell = []
    us = treeops.CostTable.measure(
        fake.fn, 4, 128, 8, warmup=3, iters=5, device="cuda", fallbacks=fell
    )
    assert us == pytest.approx(fake.REPLAY_MS * 1e3) and fell == []  # graph is the CUDA default
    kinds = [e[0] for e in fake.log]
    assert kinds.count("captured_call") == 1 and kinds.count("eager_call") == 3
    # warm-up on the side stream, then capture on that same stream, then replays
    assert fake.log[:2] == [("wait", "side", "cur"), ("enter", "side")]
    first_capture = kinds.index("capture_begin")
    assert fake.log[first_capture] == ("capture_begin", "side")
    assert max(i for i, k in enumerate(kinds) if k == "eager_call") < first_capture
    assert kinds.count("replay") == 3 + 2 * 5  # warm-up replays, then (untimed, timed) pairs


def test_measure_falls_back_to_eager_when_capture_fails(monkeypatch):
    fake = _FakeCuda(monkeypatch, fail=lambda B, c, n: True)
    fell = []
    us = treeops.CostTable.measure(
        fake.fn, 2, 64, 3, warmup=2, iters=4, device="cuda", fallbacks=fell
    )
    assert us == pytest.approx(fake.EAGER_MS * 1e3)  # CUDA events around eager calls
    assert fell == [
        {
            "B": 2,
            "c": 64,
            "n": 3,
            "error": "RuntimeError: operation not permitted when stream is capturing",
        }
    ]
    assert [e[0] for e in fake.log].count("replay") == 0
    # graph=False never captures
    fake.log.clear()
    treeops.CostTable.measure(fake.fn, 2, 64, 3, warmup=1, iters=2, device="cuda", graph=False)
    assert [e[0] for e in fake.log].count("capture_begin") == 0


def test_measure_graph_on_cpu_falls_back_with_a_note():
    hits, fell = [], []
    us = treeops.CostTable.measure(
        lambda B, c, n: hits.append(n),
        1,
        8,
        2,
        warmup=1,
        iters=3,
        device="cpu",
        graph=True,
        fallbacks=fell,
    )
    assert us >= 0 and len(hits) == 1 + 3  # refused before any call, then timed eagerly
    assert len(fell) == 1 and "needs a CUDA device" in fell[0]["error"]


def test_calibrate_records_graph_method_and_fallbacks(monkeypatch):
    fake = _FakeCuda(monkeypatch, fail=lambda B, c, n: fake_draft[0] and n == 4)
    fake_draft = [False]
    warmups = []
    monkeypatch.setattr(
        treeops.CostTable,
        "warm_up_gpu",
        staticmethod(lambda dev, ms: warmups.append((str(dev), ms)) or ms),
    )

    def target(B, c, n):
        fake_draft[0] = False
        return fake.fn(B, c, n)

    def draft(B, c, n):
        fake_draft[0] = True
        return fake.fn(B, c, n)

    t = treeops.CostTable.calibrate(
        target, draft, [1, 2], L=64, M=2, n_max=8, ns=[1, 4, 8], warmup=2, iters=3, device="cuda"
    )
    assert warmups == [("cuda", 200.0)]
    m = t.meta
    assert m["method"] == "cuda_graph_replay" and m["iters"] == 3 and m["warmup"] == 2
    assert m["gpu_warmup_ms"] == 200.0 and m["gpu"] == "Fake H200"
    fb = m["graph_fallbacks"]
    assert sorted((f["name"], f["B"], f["c"]) for f in fb) == [
        ("draft", B, c) for B in (1, 2) for c in (64, 128)
    ]
    assert all(f["n"] == 4 and "capturing" in f["error"] for f in fb)
    assert "4 points fell back" in m["timing"]
    # replayed points cost 200 µs, fallen-back ones 1000 µs (then the running max in n)
    assert t.target[0, 0].tolist() == pytest.approx([200.0] * 8)
    assert float(t.draft[0, 0, 0]) == pytest.approx(200.0)
    assert float(t.draft[0, 0, 3]) == pytest.approx(1000.0)
    json.dumps(t.to_dict())  # the meta stays serialisable


def test_calibrate_on_cpu_is_eager_and_says_so():
    t = treeops.CostTable.calibrate(
        lambda B, c, n: None,
        lambda B, c, n: None,
        [1],
        L=8,
        M=1,
        n_max=2,
        warmup=1,
        iters=2,
        device="cpu",
    )
    m = t.meta
    assert m["method"] == "perf_counter_eager" and m["graph_fallbacks"] == []
    assert m["gpu_warmup_ms"] == 0.0 and treeops.CostTable.warm_up_gpu("cpu") == 0.0


@pytest.mark.gpu
def test_graph_timing_on_the_gpu_and_fallback_after_a_failed_capture():
    dev = torch.device("cuda")
    a = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16) * 0.01
    x0 = torch.zeros(1, device=dev)

    def matmuls(B, c, n):
        return [torch.mm(a, a) for _ in range(4)]

    def tiny(B, c, n):  # 300 tiny kernels: eager timing is launch overhead
        x = x0
        for _ in range(300):
            x = x + 1
        return x

    def host_sync(B, c, n):
        return float(torch.mm(a, a).sum())  # .item() inside a capture: not capturable

    fell = []
    g_us = treeops.CostTable.measure(matmuls, 1, 1, 1, device=dev, fallbacks=fell)
    assert fell == [] and g_us > 0
    assert treeops.CostTable.measure(host_sync, 2, 3, 4, device=dev, fallbacks=fell) > 0
    assert len(fell) == 1 and (fell[0]["B"], fell[0]["c"], fell[0]["n"]) == (2, 3, 4)
    # the device is usable after the failed capture: graphs and eager work both still run
    fell2 = []
    assert treeops.CostTable.measure(matmuls, 1, 1, 1, device=dev, fallbacks=fell2) > 0
    assert fell2 == []
    eager = treeops.CostTable.measure(tiny, 1, 1, 1, device=dev, graph=False)
    graph = treeops.CostTable.measure(tiny, 1, 1, 1, device=dev, fallbacks=fell2)
    assert fell2 == [] and graph < eager, (graph, eager)
    assert treeops.CostTable.warm_up_gpu(dev, 20.0) >= 20.0


def test_table_rejects_bad_input():
    with pytest.raises(ValueError, match=r"Invalid value of batch_sizes: expected increasing"):
        treeops.CostTable([4, 2], 8, torch.ones(2, 1, 1), torch.ones(2, 1, 1))
    with pytest.raises(ValueError, match=r"Invalid shape of draft: expected \[1, M, n_max\]"):
        treeops.CostTable([1], 8, torch.ones(1, 1, 1), torch.ones(2, 1, 1))
    with pytest.raises(ValueError, match=r"Invalid value in target: expected finite non-negative"):
        treeops.CostTable([1], 8, torch.full((1, 1, 1), float("nan")), torch.ones(1, 1, 1))
    with pytest.raises(ValueError, match=r"expected S_T\(B\)\[c\]\[1\] > 0"):
        treeops.CostTable([1], 8, torch.zeros(1, 1, 2), torch.ones(1, 1, 2))


def test_device_tables_are_float32_rows():
    t = table()
    tt, dd = t.device_tables(5, "cpu")
    assert tt.dtype == torch.float32 and tt.shape == (4, 32)
    assert torch.equal(tt, t.target[2].float()) and torch.equal(dd, t.draft[2].float())
    assert t.device_tables(16, "cpu")[0] is tt  # cached


def test_reference_module_is_the_public_one():
    assert treeops.CostTable is treeops.cost_table.CostTable
    r = random.Random(0)
    s = torch.tensor([[r.randrange(64) / 64 for _ in range(5)] for _ in range(3)])
    c = torch.tensor([1.0, 1.0, 2.0, 2.0, 3.0])
    assert int(treeops.cast_width(s, c, 0.5)) == int(ref.cast_width(s, c, 0.5))
