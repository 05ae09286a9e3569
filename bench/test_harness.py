"""The harness's host-side logic on the CPU: rotation, floors, result files, the commit rule,
and the pytest-benchmark bridge (with a stand-in for the CUDA graph)."""

from __future__ import annotations

import json
import statistics

import harness as H
import pytest


def test_rotation_spans_the_l2():
    copies, reps = H.rotation(16 << 20)
    assert copies * (16 << 20) >= H.ROTATE_BYTES and copies == 8 and reps == 3
    assert H.rotation(1 << 20) == (32, 1)  # at most 32 copies
    assert H.rotation(10**9) == (1, 1)  # one copy, one call per graph
    assert H.rotation(0)[0] == 32


def test_floors():
    assert H.bytes_floor_us(4.3e12) == pytest.approx(1e6)
    assert H.flops_floor_us(790e12) == pytest.approx(1e6)
    assert H.floor_us(4.3e6, 0, empty_us=0.5) == pytest.approx(1.0)
    assert H.floor_us(4.3e5, 0, empty_us=0.5) == 0.5
    assert H.floor_us(0, 790e9) == pytest.approx(1e3)
    assert H.empty_kernel_us("cpu") == 0.0
    # without a GPU (and on an H200) the rates are the H200's measured constants
    assert H.ceilings()["hbm_bytes_per_s"] == H.HBM_BYTES_PER_S
    assert H.ceilings()["flops_per_s"] == H.ATTENTION_FLOPS_PER_S


def test_wall_and_eager_timing_on_the_cpu():
    calls = []
    assert H.wall_us([lambda: calls.append(1)] * 3, rounds=2) >= 0 and len(calls) == 6
    n = []
    assert H.eager_us(lambda: n.append(1), iters=5, warmup=2, device="cpu") >= 0
    assert len(n) == 7
    assert H.graph_us([lambda: None], device="cpu") >= 0  # a CPU device: wall clock
    assert H.time_any(lambda: None, device="cpu")[1] == "wall"


def test_result_doc_and_write_json(tmp_path, monkeypatch):
    monkeypatch.setenv("TREEOPS_COMMIT", "abc123")
    doc = H.result_doc("cpu", rows=[{"B": 1}])
    assert doc["commit"] == "abc123" and doc["gpu"] == "cpu (dry run)"
    assert set(doc) >= {"gpu", "gpu_facts", "versions", "commit", "date", "rows"}
    assert {"torch", "triton", "python", "treeops", "flashinfer"} <= set(doc["versions"])
    assert H.result_doc("cpu", commit_id="explicit")["commit"] == "explicit"
    path = H.write_json(str(tmp_path / "sub" / "x.json"), doc)
    assert json.loads(open(path).read())["rows"] == [{"B": 1}]
    assert not (tmp_path / "sub" / "x.json.tmp").exists()


def test_commit_without_env(monkeypatch):
    monkeypatch.delenv("TREEOPS_COMMIT", raising=False)
    c = H.commit()
    assert c == "unknown" or len(c.split()[0]) == 40


def test_ratios_and_record():
    rows = [dict(treeops_us=2.0, floor_us=1.0, torch_us=4.0), dict(treeops_us=None)]
    H.ratios(rows, ("torch", "flashinfer"))
    assert rows[0]["treeops_over_floor"] == 2.0 and rows[0]["treeops_over_torch"] == 0.5
    assert "treeops_over_flashinfer" not in rows[0] and "treeops_over_floor" not in rows[1]

    class Fake:
        extra_info: dict = {}

    b = Fake()
    H.record(b, dict(a=1, s="x", t=(1, 2), bad=object()))
    assert b.extra_info == {"a": 1, "s": "x", "t": [1, 2]} or b.extra_info["t"] == (1, 2)
    assert "bad" not in b.extra_info


class _FakeGraph:
    """Stands in for ``GraphTimer``: replays "take" 10, 20, 30, ... µs per call."""

    def __init__(self, calls, reps=1):
        self.calls_per_replay = reps * len(calls)
        self.n = 0

    def replay_us(self):
        self.n += 1
        return 10.0 * self.n


def test_benchmark_graph_reports_replay_times(benchmark, monkeypatch, request):
    """The fixture's statistics are the replays' device times (not host time), and the median
    of the timed rounds lands in extra_info."""
    if request.config.getoption("benchmark_only"):
        pytest.skip("a test of the harness, not a benchmark (kept out of the results)")
    monkeypatch.setattr(H, "GraphTimer", _FakeGraph)
    med = H.benchmark_graph(benchmark, [lambda: None] * 4, reps=2, rounds=5, warmup_rounds=2)
    # rounds 3..7 of the fake: 30 .. 70 µs
    assert med == pytest.approx(50.0)
    assert benchmark.extra_info["treeops_us"] == pytest.approx(50.0)
    assert "8 calls per replay" in benchmark.extra_info["timing"]
    if benchmark.enabled and benchmark.stats is not None:
        data = benchmark.stats.stats.data
        assert statistics.median(data) == pytest.approx(50e-6)


def test_every_bench_script_is_in_the_benchmarks_doc():
    """Each runnable script under bench/ is named in docs/benchmarks.md (its table of scripts)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parent
    doc = (root.parent / "docs" / "benchmarks.md").read_text()
    scripts = [p.name for p in sorted(root.glob("*.py"))
               if not p.name.startswith("test_") and "__main__" in p.read_text()]  # fmt: skip
    assert scripts, "no scripts found under bench/"
    missing = [name for name in scripts if f"bench/{name}" not in doc]
    assert not missing, f"not in docs/benchmarks.md: {missing}"


def test_saved_rows_rewrite_their_file_with_each_row(tmp_path):
    """A sweep stopped at its time limit keeps the rows it measured: the file holds every row
    appended so far, after each append."""
    path = str(tmp_path / "sweep.json")
    rows = H.SavedRows(path, lambda rs: {"gpu": "x", "rows": rs})
    rows.append({"B": 1, "us": 2.0})
    assert json.load(open(path)) == {"gpu": "x", "rows": [{"B": 1, "us": 2.0}]}
    rows.append({"B": 8, "us": 3.0})
    assert [r["B"] for r in json.load(open(path))["rows"]] == [1, 8]
    assert rows == [{"B": 1, "us": 2.0}, {"B": 8, "us": 3.0}]
