"""merge_e2e: a session's runs as one file (the later run's row wins, rows tagged with session
and commit, cost tables merged by batch size) and its batch sizes replacing the combined file's,
all policies of a B together."""

from __future__ import annotations

import json

import pytest
from merge_e2e import combine, main, merge_into, merge_tables


def run(commit: str, rows: list[tuple[str, int, float]], created: str = "2026-01-01T00:00:00Z"):
    out = [{"policy": p, "B": B, "tokens_per_s": t} for p, B, t in rows]
    return {"gpu": "G", "commit": commit, "created": created, "seconds": 10.0, "settings": {},
            "stopped": None, "rows": out}  # fmt: skip


def table(bs: list[int], tag: float) -> dict:
    return {"format": "treeops.CostTable/1", "L": 128, "M": 4, "n_max": 8, "batch_sizes": bs,
            "target": [[tag, B] for B in bs], "draft": [[tag, -B] for B in bs],
            "meta": {"layer_overhead_us": {str(B): tag for B in bs}, "seconds": 1.0}}  # fmt: skip


def test_later_runs_win_and_rows_carry_their_session_and_commit():
    a = run("a" * 40, [("Cast", 1, 1.0), ("chain", 1, 1.0), ("Cast", 8, 1.0)])
    b = run("a" * 40, [("Cast", 8, 2.0)], created="2026-01-02T00:00:00Z")
    doc = combine([a, b], session=7)
    got = {(r["policy"], r["B"]): r for r in doc["rows"]}
    assert set(got) == {("Cast", 1), ("chain", 1), ("Cast", 8)}
    assert got[("Cast", 8)]["tokens_per_s"] == 2.0
    assert all(r["session"] == 7 and r["commit"] == "a" * 8 for r in doc["rows"])
    assert doc["commit"] == "a" * 40 and len(doc["calls"]) == 2 and doc["seconds"] == 20.0
    assert doc["created"] == "2026-01-02T00:00:00Z"
    two = combine([a, run("b" * 40, [("Cast", 2, 1.0)])], session=7)
    assert two["commit"] is None and two["commits"] == ["a" * 40, "b" * 40]
    with pytest.raises(ValueError, match="runs"):
        combine([], session=7)


def test_a_batch_size_is_replaced_whole():
    old = {"rows": [{"policy": p, "B": B, "tokens_per_s": 0.0, "session": 5, "commit": "c" * 8}
                    for p in ("Cast", "chain", "CastPrune") for B in (1, 4)]}  # fmt: skip
    new = combine([run("d" * 40, [("Cast", 1, 3.0), ("chain", 1, 3.0)])], session=6)
    out = merge_into(new, old)
    got = {(r["policy"], r["B"]): r for r in out["rows"]}
    # B = 1 comes from session 6 alone: its stale CastPrune row is gone with the rest
    assert {k for k in got if k[1] == 1} == {("Cast", 1), ("chain", 1)}
    assert all(r["session"] == 6 for k, r in got.items() if k[1] == 1)
    assert all(r["session"] == 5 for k, r in got.items() if k[1] == 4)
    assert "B=1 session 6 (ddddddd)" in out["merged_from"]
    assert "B=4 session 5 (ccccccc)" in out["merged_from"]


def test_tables_merge_by_batch_size():
    t = merge_tables([table([1, 8], 1.0), table([8, 64], 2.0)])
    assert t["batch_sizes"] == [1, 8, 64]
    assert t["target"] == [[1.0, 1], [2.0, 8], [2.0, 64]]
    assert t["draft"][1] == [2.0, -8]
    assert t["meta"]["layer_overhead_us"] == {"1": 1.0, "8": 2.0, "64": 2.0}
    other = dict(table([2], 1.0), L=256)
    with pytest.raises(ValueError, match="grids"):
        merge_tables([table([1], 1.0), other])


def test_main_writes_the_session_file_its_table_and_the_merge(tmp_path):
    for i, (bs, rows) in enumerate((([1], [("Cast", 1, 1.0)]), ([64], [("Cast", 64, 2.0)]))):
        d = tmp_path / f"call{i}"
        d.mkdir()
        (d / "e2e.json").write_text(json.dumps(run("e" * 40, rows)))
        (d / "e2e_cost_table.json").write_text(json.dumps(table(bs, float(i))))
    into = tmp_path / "e2e.json"
    into.write_text(json.dumps({"rows": [{"policy": "Cast", "B": 4, "session": 1}]}))
    out = tmp_path / "e2e_s9.json"
    argv = [str(tmp_path / "call0" / "e2e.json"), str(tmp_path / "call1" / "e2e.json"),
            "--session", "9", "--out", str(out), "--into", str(into)]  # fmt: skip
    assert main(argv) == 0
    assert {r["B"] for r in json.loads(out.read_text())["rows"]} == {1, 64}
    assert json.loads((tmp_path / "e2e_cost_table_s9.json").read_text())["batch_sizes"] == [1, 64]
    assert {r["B"] for r in json.loads(into.read_text())["rows"]} == {1, 4, 64}
