"""bench_host.py runs on the CPU: every public op's eager call goes through its CUDA launcher's
host code (Triton's launch stubbed) and the JSON has a host time for each, in a fresh process
without the interpreter (the script times the GPU launchers' tile choices)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_bench_host_quick(tmp_path):
    from bench_host import OPS

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "host.json"
    proc = subprocess.run(
        [sys.executable, str(HERE / "bench_host.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=HERE.parent,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    rows = {r["op"]: r for r in doc["rows"]}
    assert sorted(rows) == sorted(OPS)
    for op, r in rows.items():
        assert "error" not in r, (op, r["error"])
        # two timings on a shared machine: an op without a Triton launch may time either first
        assert r["host_us"] > 0 and r["total_us"] > 0 and r["triton_us"] >= 0, (op, r)
        if op.endswith("_prepared"):  # its calls replayed the recorded launches (stub kernels)
            assert r["replayed"] is True, (op, r)


def test_host_profile_names_where_the_time_goes(tmp_path):
    """host_profile on the CPU (the ops' references): per op a loop time and the functions with
    the most own time, the op's own entry point among the calls."""
    from host_profile import main

    out = tmp_path / "profile.json"
    rows = main(["--ops", "cast_select,prune", "--calls", "20", "--top", "40", "--out", str(out)])
    assert [r["op"] for r in rows] == ["cast_select", "prune"]
    for r in rows:
        assert "error" not in r, r
        assert r["loop_us"] > 0 and r["top"]
        assert all(us >= 0 and n > 0 for _name, us, n in r["top"])
    names = " ".join(name for name, _us, _n in rows[1]["top"])
    assert "prune" in names
    assert json.loads(out.read_text())["rows"][0]["op"] == "cast_select"
