"""ab_table: one results file per A/B label, a row per shape, a column per label."""

from __future__ import annotations

import json

from ab_table import main, table


def _write(root, label, rows, key="rows"):
    d = root / label
    d.mkdir()
    (d / "r.json").write_text(json.dumps({key: rows}))


def test_rows_by_shape_across_labels(tmp_path, capsys):
    layer = {"op": "layer", "V": 32000}
    _write(tmp_path, "old", [{**layer, "B": 1, "treeops_us": 19.4},
                             {**layer, "B": 64, "treeops_us": 41.9}])  # fmt: skip
    step = {"op": "step", "B": 1, "N": 64, "V": 32000, "treeops_us": 142}
    _write(tmp_path, "new", [{**layer, "B": 64, "treeops_us": 39.8}, step])
    got = dict(table(str(tmp_path), "r.json", ["old", "new", "gone"], "treeops_us"))
    assert got[(("op", "layer"), ("B", 1), ("V", 32000))] == [19.4, None, None]
    assert got[(("op", "layer"), ("B", 64), ("V", 32000))] == [41.9, 39.8, None]
    assert got[(("op", "step"), ("B", 1), ("N", 64), ("V", 32000))] == [None, 142, None]
    assert main([str(tmp_path), "r.json", "old", "new"]) == 0
    assert "op=layer B=64 V=32000 | old=41.9 new=39.8" in capsys.readouterr().out


def test_latency_files_and_other_fields(tmp_path):
    _write(tmp_path, "a", [{"B": 1, "ctx": 512, "n": 8, "auto_cold": 9.6}], key="latency")
    got = table(str(tmp_path), "r.json", ["a"], "auto_cold")
    assert got == [((("B", 1), ("ctx", 512), ("n", 8)), [9.6])]
