"""bench/calibrate_cost_table.py's dry run on the CPU: a tiny model, the table written and read
back, the sanity check against docs/benchmarks.md's per-layer time."""

from __future__ import annotations

import calibrate_cost_table as cal
import pytest
import torch

import treeops


@pytest.mark.parametrize("timing", [None, "graph"])
def test_calibration_script_dry_run(tmp_path, capsys, timing):
    argv = ["--dry-run", "--out", str(tmp_path)] + (["--timing", timing] if timing else [])
    table = cal.main(argv)
    u = treeops.CostTable.load(tmp_path / "cost_table_dry_run.json")
    assert u.batch_sizes == table.batch_sizes and torch.equal(u.target, table.target)
    m = u.meta
    assert m["method"] == "perf_counter_eager" and m["iters"] == 2 and m["warmup"] == 1
    s = m["sanity"]
    assert s["reference_us"] == 129.0 and s["applies"] is False and s["suspicious"] is False
    assert s["point"] == {"B": 1, "c": 64, "n": 1}
    assert s["per_layer_us"] == pytest.approx(m["target_per_layer_us"][0][0][0], abs=0.06)
    out = capsys.readouterr().out
    assert "sanity: per-layer target time at B=1, n=1" in out
    if timing == "graph":  # no CUDA here: every point falls back, and the script says so
        assert len(m["graph_fallbacks"]) == 2 * 2 * 3 * 3 and "eager_per_layer_us" in s
        assert "WARNING: 36 points fell back to eager timing" in out
    else:
        assert m["graph_fallbacks"] == []


def test_calibration_sanity_check_flags_eager_overhead():
    d = cal.Dims()
    layers = torch.full((1, 1, 4), 2 * 950.0)  # 2 layers, B=1: an eager (launch-bound) figure
    s = cal.sanity_check(layers, [1], 2, 8192, "NVIDIA H200", d, eager_us=1900.0)
    assert s["per_layer_us"] == 950.0 and s["ratio"] == pytest.approx(950 / 129, abs=0.01)
    assert s["suspicious"] is True and "SUSPICIOUS" in s["verdict"]
    s = cal.sanity_check(torch.full((1, 1, 4), 2 * 140.0), [1], 2, 8192, "NVIDIA H200", d)
    assert s["suspicious"] is False and s["verdict"].endswith("-- OK")
    s = cal.sanity_check(layers, [2, 4], 2, 8192, "NVIDIA H200", d)
    assert s["per_layer_us"] is None and s["verdict"] == "no B = 1 measured"
