"""planner_sim feeds λ-CAST's planner a measured plan set: it runs only those plans, every step
counted, and its probes compare plans of the set."""

from __future__ import annotations

import json

from planner_sim import main, simulate

from treeops import Plan

PLANS = {Plan.chain(7): (1574.0, 6.6, 1314), Plan.chain(8): (1780.0, 6.7, 49),
         Plan(4, 9, 64): (2056.0, 9.2, 411)}  # fmt: skip


def test_simulate_runs_the_measured_plans_only():
    count, probes = simulate(PLANS, 1, seed=0, steps=600, cv=0.4, max_width=8)
    assert sum(count.values()) == 600 and set(count) <= set(PLANS)
    sizes = {(p.width, p.depth, p.verify, p.graft) for p in PLANS}
    for e in probes:
        assert tuple(e[1]) in sizes and tuple(e[2]) in sizes and e[-1] in ("probe", "home")


def test_main_reads_a_row(tmp_path, capsys):
    steps = [[p.width, p.depth, p.verify, p.graft, int(p.is_chain), n, us, tok, 0.0]
             for p, (us, tok, n) in PLANS.items()]  # fmt: skip
    run = tmp_path / "e2e.json"
    run.write_text(json.dumps({"rows": [{"policy": "Cast", "B": 1, "plan_steps": steps}]}))
    assert main([str(run), "--seeds", "1", "--steps", "200"]) == 0
    assert "seed 0: chains" in capsys.readouterr().out
