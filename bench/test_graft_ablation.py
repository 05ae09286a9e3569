"""graft_ablation reads a bench_e2e run: verify times come from the run's cost table at each
plan's verify count, weighted by the plan's steps; the rest of the step is what lies beyond."""

from __future__ import annotations

import json

import pytest
from graft_ablation import CONTEXT, ablation, main

from treeops import CostTable


def table() -> CostTable:
    # S_T(B, c, n) = 1000 + 10 B n: every verify count has its own time
    return CostTable.from_functions(lambda B, c, n: 1000.0 + 10 * B * n, lambda B, c, n: 50.0,
                                    batch_sizes=[1, 8], L=128, M=4, n_max=96)  # fmt: skip


def rows() -> list[dict]:
    def row(policy, tps, plans, graft=0.0):
        return {"policy": policy, "B": 8, "tokens_per_s": tps, "mean_accepted": 7.0,
                "step_us": 3000.0, "plan_steps": plans, "grafted_per_step": graft,
                "slot_use": 0.5, "draft_forwards_per_step": 6.0}  # fmt: skip

    # plan_steps: [width, depth, verify, graft, chain, steps, step_us, accepted, λ]
    return [
        row("Cast", 100.0, [[1, 6, 7, 0, 1, 30, 0, 0, 0], [2, 6, 16, 0, 0, 10, 0, 0, 0]]),
        row("CastGraft", 110.0, [[2, 6, 16, 8, 0, 40, 0, 0, 0]], graft=20.0),
        {"policy": "chain", "B": 8, "tokens_per_s": 90.0},
    ]


def test_verify_time_is_the_step_weighted_table_time():
    got = {r["policy"]: r for r in ablation(rows(), table())}
    assert set(got) == {"Cast", "CastGraft"}  # the fixed policies are not Graft's ablation
    cast = (30 * (1000 + 80 * 7) + 10 * (1000 + 80 * 16)) / 40
    assert got["Cast"]["verify_us"] == pytest.approx(cast, abs=0.05)
    assert got["Cast"]["beyond_verify_us"] == pytest.approx(3000 - cast, abs=0.1)
    assert got["CastGraft"]["verify_us"] == pytest.approx(1000 + 80 * 16, abs=0.05)
    assert got["CastGraft"]["per_cast"] == 1.1
    assert got["CastGraft"]["grafted_per_request"] == 5.0  # 20 over 8 rows half in use
    assert CONTEXT // 128 < table().M  # the context read is inside the table's grid


def test_main_writes_the_rows(tmp_path, capsys):
    run, tab, out = tmp_path / "e2e.json", tmp_path / "e2e_cost_table.json", tmp_path / "a.json"
    run.write_text(json.dumps({"rows": rows()}))
    table().save(tab)
    assert main([str(run), "--out", str(out)]) == 0
    assert [r["policy"] for r in json.loads(out.read_text())["rows"]] == ["Cast", "CastGraft"]
    assert "CastGraft" in capsys.readouterr().out


def test_later_runs_replace_earlier_ones_batch_by_batch(tmp_path):
    def at(B, tps):
        return [dict(r, B=B, tokens_per_s=tps) for r in rows()]

    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"rows": at(1, 100.0) + at(8, 100.0)}))
    second.write_text(json.dumps({"rows": at(8, 200.0)}))
    t1, t2, out = tmp_path / "t1.json", tmp_path / "t2.json", tmp_path / "out.json"
    table().save(t1)
    table().save(t2)
    argv = [str(first), str(second), "--tables", str(t1), str(t2), "--out", str(out)]
    assert main(argv) == 0
    got = json.loads(out.read_text())["rows"]
    assert {(r["B"], r["source"]) for r in got} == {(1, "a.json"), (8, "b.json")}
    assert all(r["tokens_per_s"] == 200.0 for r in got if r["B"] == 8)
    assert main(argv[:5] + ["--batches", "8", "--out", str(out)]) == 0
    assert {r["B"] for r in json.loads(out.read_text())["rows"]} == {8}
    with pytest.raises(SystemExit):  # one table for two runs
        main([str(first), str(second), "--tables", str(t1)])
