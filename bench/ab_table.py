"""Side by side: one results file (``tree_build_cast.json``, ``attention_latency.json``, ...) from
each variant of an A/B (``bench/ab_trees.sh`` writes ``DIR/<label>/``), a row per measured shape
and a column per label.

    python bench/ab_table.py DIR tree_build_cast.json old new new2 [--field treeops_us]

A row is keyed by the fields that name a shape (``KEY_FIELDS``, those present); a label whose
file is missing or lacks the row prints ``-``.
"""

from __future__ import annotations

import argparse
import json
import os

KEY_FIELDS = ("op", "policy", "B", "N", "V", "ctx", "n", "D", "H_q", "H_kv")


def row_key(row: dict) -> tuple:
    return tuple((k, row[k]) for k in KEY_FIELDS if row.get(k) is not None)


def table(root: str, name: str, labels: list[str], field: str) -> list[tuple[tuple, list]]:
    """(key, [value per label]) in the order rows first appear."""
    values: dict[tuple, dict[str, object]] = {}
    for label in labels:
        path = os.path.join(root, label, name)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            doc = json.load(f)
        for row in doc.get("rows", doc.get("latency", [])):
            if field in row:
                values.setdefault(row_key(row), {})[label] = row[field]
    return [(k, [v.get(label) for label in labels]) for k, v in values.items()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root")
    ap.add_argument("name")
    ap.add_argument("labels", nargs="+")
    ap.add_argument("--field", default="treeops_us")
    args = ap.parse_args(argv)
    for key, vals in table(args.root, args.name, args.labels, args.field):
        shape = " ".join(f"{k}={v}" for k, v in key)
        cells = " ".join(f"{lab}={'-' if v is None else v}" for lab, v in zip(args.labels, vals))
        print(f"{shape} | {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
