"""bench/standing.py on synthetic result files: the worst row per target, absent files."""

from __future__ import annotations

import json

import standing


def _write(folder, name, rows, **fields):
    (folder / f"{name}.json").write_text(json.dumps(dict(gpu="GPU", date="d", rows=rows, **fields)))


def test_standings_pick_the_worst_row(tmp_path):
    attn = [
        dict(B=1, ctx=1024, n=64, D=128, H_q=32, hkv=8, floor_us=1.4, treeops_us=14.0,
             flashinfer_custom_us=28.0, flashinfer_causal_us=21.0),
        dict(B=8, ctx=4096, n=64, D=128, H_q=32, hkv=8, floor_us=44.0, treeops_us=110.0,
             flashinfer_custom_us=440.0, flashinfer_causal_us=99.0),
        dict(B=32, ctx=2048, n=64, D=256, H_q=16, hkv=4, floor_us=90.0, treeops_us=300.0,
             flashinfer_custom_us=420.0),
    ]  # fmt: skip
    _write(tmp_path, "tree_attention", attn)
    build = [
        dict(op="layer", B=1, V=32000, policy="eagle", floor_us=0.6, treeops_us=12.0),
        dict(op="layer", B=64, V=32000, policy="eagle", floor_us=9.5, treeops_us=30.0),
        dict(op="step", B=64, N=64, V=32000, floor_us=70.0, treeops_us=190.0),
        dict(op="layer_sweep", B=64, V=32000, floor_us=9.5, treeops_us=1.0),
    ]
    _write(tmp_path, "tree_build_cast", build, ceilings=dict(source="GPU, measured"))
    _write(tmp_path, "accept", [dict(op="greedy", B=1, V=32000, floor_us=1.0, treeops_us=6.0)])
    table, notes = standing.standings(str(tmp_path))
    got = {what: now for what, now, _ in table}
    assert got["tree attention vs FlashInfer custom mask, the issue's five shapes"] == (
        "2.00–4.00× (2 of 5 shapes)"
    )
    assert got["tree attention vs FlashInfer causal, every row"].startswith("0.90× (B 8")
    assert got["tree attention vs FlashInfer causal, every row"].endswith("1 of 2 rows ≥ 1")
    assert got["tree attention, floor ≥ 20 µs"].startswith("3.33× (B 32, ctx 2,048, n 64, D 256)")
    assert got["tree attention, floor < 5 µs"] == "14.0 µs (B 1, ctx 1,024, n 64)"
    assert got["tree attention, head dim 256 vs FlashInfer custom mask"].startswith("1.40×")
    # ratios to max(floor, 3 µs): B 1 12 / 3 = 4 beats B 64 30 / 9.5; sweeps are not rows
    assert got["build layer"] == "4.00× (B 1, V 32,000, eagle: 12.0 µs)"
    assert got["greedy accept"] == "2.00× (B 1, V 32,000: 6.0 µs)"
    assert got["whole EAGLE step, B 64, N 64"] == "190 µs (V 32,000)"
    assert "sampling accept" not in got and "table update" not in got
    assert "graft.json: absent" in notes and "host.json: absent" in notes
    assert any(n.startswith("tree_build_cast.json: GPU") and "GPU, measured" in n for n in notes)
    md = standing.markdown(table)
    assert md.splitlines()[0] == "| target | now (the worst row) | goal |"
    assert len(md.splitlines()) == 2 + len(table)


def test_eager_rows_from_host_json(tmp_path):
    _write(tmp_path, "host", [dict(op="a", overhead_us=14.6), dict(op="b", overhead_us=40.2)])
    table, _ = standing.standings(str(tmp_path))
    assert table == [("eager − replay, one op", "15–40 µs (1 of 2 rows ≤ 25)", "≤ 25 µs")]
