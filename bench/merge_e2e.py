"""Several ``bench_e2e.py`` runs of one session as one file, and that file's rows merged into the
combined ``e2e.json`` (the newest rows per batch size).

    python bench/merge_e2e.py RUN.json [RUN.json ...] --session N --out e2e_sN.json
                              [--into bench/results/h200/e2e.json] [--note TEXT]

* ``--out``: the runs' rows, each tagged with ``session`` and its run's ``commit`` (8 hex
  digits); where two runs have a row of the same (policy, B), the later run's wins. The first
  run's metadata (GPU, versions, model, rules), ``calls`` (each run's created, seconds, settings
  and stopped), ``commit`` if every run ran the same tree (else ``None`` and ``commits``). The
  cost tables beside the runs (``e2e_cost_table.json``), when there, are merged by batch size
  into ``e2e_cost_table_sN.json`` beside ``--out`` (the later run's entry wins).
* ``--into``: every row of the batch sizes the runs measured replaces that file's rows at those
  batch sizes (all policies of a B come from one session, so a B never mixes trees); the other
  batch sizes keep theirs. ``merged_from`` is rewritten from the rows' sessions and commits.

Device-call results are read-only copies; this writes only ``--out``, its cost table and
``--into``.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import sys


def combine(runs: list[dict], session: int) -> dict:
    """The runs as one document (see the module docstring)."""
    if not runs:
        raise ValueError("runs: expected at least one bench_e2e result, got none")
    rows: dict[tuple[str, int], dict] = {}
    for run in runs:
        commit = (run.get("commit") or "")[:8] or None
        for r in run.get("rows", []):
            if "error" in r:
                continue
            rows[(r["policy"], r["B"])] = dict(r, session=session, commit=commit)
    doc = copy.deepcopy({k: v for k, v in runs[0].items() if k not in ("rows", "merged_from")})
    commits = sorted({run.get("commit") for run in runs if run.get("commit")})
    doc["commit"] = commits[0] if len(commits) == 1 else None
    if len(commits) > 1:
        doc["commits"] = commits
    doc["calls"] = [{k: run.get(k) for k in ("created", "seconds", "settings", "stopped")}
                    for run in runs]  # fmt: skip
    doc["created"] = max(run.get("created") or "" for run in runs) or None
    doc["seconds"] = round(sum(run.get("seconds") or 0.0 for run in runs), 1)
    doc["stopped"] = None
    doc["plot"] = None
    doc["rows"] = sorted(rows.values(), key=lambda r: (r["B"], r["policy"]))
    return doc


def merge_tables(tables: list[dict]) -> dict:
    """Cost tables of one pair merged by batch size (a later table's entry wins)."""
    out = copy.deepcopy(tables[0])
    by_b: dict[int, tuple] = {}
    overhead: dict = {}
    for t in tables:
        if (t["L"], t["M"], t["n_max"]) != (out["L"], out["M"], out["n_max"]):
            raise ValueError("tables: cost tables of different grids (L, M, n_max) cannot merge")
        for i, B in enumerate(t["batch_sizes"]):
            by_b[B] = (t["target"][i], t["draft"][i])
        overhead.update(t.get("meta", {}).get("layer_overhead_us", {}))
    out["batch_sizes"] = sorted(by_b)
    out["target"] = [by_b[B][0] for B in out["batch_sizes"]]
    out["draft"] = [by_b[B][1] for B in out["batch_sizes"]]
    out.setdefault("meta", {})["layer_overhead_us"] = overhead
    out["meta"]["seconds"] = round(sum(t.get("meta", {}).get("seconds", 0.0) for t in tables), 1)
    return out


def merge_into(combined: dict, doc: dict) -> dict:
    """``doc`` with every row at the batch sizes ``combined`` measured taken from it."""
    new_bs = {r["B"] for r in combined["rows"]}
    out = copy.deepcopy(doc)
    kept = [r for r in doc.get("rows", []) if r["B"] not in new_bs]
    out["rows"] = sorted(
        kept + copy.deepcopy(combined["rows"]), key=lambda r: (r["B"], r["policy"])
    )
    out["commit"] = combined.get("commit") or out.get("commit")
    out["created"] = combined.get("created") or out.get("created")
    by_source: dict[tuple, set] = collections.defaultdict(set)
    for r in out["rows"]:
        by_source[(r.get("session"), (r.get("commit") or "?")[:7])].add(r["B"])
    newest_first = sorted(by_source.items(), key=lambda kv: -(kv[0][0] or 0))
    parts = [f"B={','.join(map(str, sorted(bs)))} session {s} ({c})"
             for (s, c), bs in newest_first]  # fmt: skip
    out["merged_from"] = (
        "the newest H200 rows per batch size, each row with its commit and session: "
        + "; ".join(parts)
    )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--session", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--into", default=None)
    ap.add_argument("--note", default=None, help="a line on the runs, kept in --out")
    args = ap.parse_args(argv)
    runs = []
    for path in args.runs:
        with open(path) as f:
            runs.append(json.load(f))
    combined = combine(runs, args.session)
    if args.note:
        combined["note"] = args.note
    with open(args.out, "w") as f:
        json.dump(combined, f, indent=1)
    tables = []
    for path in args.runs:
        tab = os.path.join(os.path.dirname(path), "e2e_cost_table.json")
        if os.path.exists(tab):
            with open(tab) as f:
                tables.append(json.load(f))
    if tables:
        tab_out = os.path.join(os.path.dirname(args.out) or ".",
                               f"e2e_cost_table_s{args.session}.json")  # fmt: skip
        with open(tab_out, "w") as f:
            json.dump(merge_tables(tables), f, indent=1)
    if args.into:
        with open(args.into) as f:
            doc = json.load(f)
        merged = merge_into(combined, doc)
        with open(args.into, "w") as f:
            json.dump(merged, f, indent=1)
        print(merged["merged_from"])
    bs = sorted({r["B"] for r in combined["rows"]})
    print(f"{args.out}: {len(combined['rows'])} rows at B = {bs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
