"""Graft's ablation from a ``bench_e2e.py`` run: per batch size, what Cast, prune-only Graft
(``CastPrune``) and Graft (``CastGraft``) accept per step, what they draft and what their steps
cost outside the target's verification.

    python bench/graft_ablation.py RUN.json [RUN2.json ...] [--tables T.json ...] [--batches 1,8,64]
                                   [--out ablation.json]

Each ``RUN.json`` is a ``bench_e2e.py`` result holding those policies' rows (e.g. ``--policies
Cast,CastPrune,CastGraft``); ``--tables`` the cost tables those runs calibrated, in the same
order (default: each run's ``e2e_cost_table.json`` beside it). Each batch size is read from the
last run with rows of these policies at it, so a later run replaces an earlier one B by B and
no batch size mixes runs; ``--batches`` keeps the listed ones. Per row:

* ``mean_accepted``: tokens per request per step (the bonus token included);
* ``grafted_per_request``: grafted nodes verified per active request per step;
* ``draft_forwards_per_step``: draft forwards per step (the draft layers run);
* ``verify_us``: the target's verification forward at the step's verify count, from the run's
  own calibrated table (CUDA-graph replays of that forward on the same GPU), averaged over the
  steps of each plan the row ran (``plan_steps``); fixed-shape rows use ``mean_verify_bucket``;
* ``beyond_verify_us``: the measured step time (``step_us``, whole-step CUDA graphs) minus
  ``verify_us``: the draft forwards, tree build, pruning and grafting, acceptance, compaction and
  the catch-up forward. Under whole-step graphs the draft's share cannot be timed alone without
  syncing inside the step, so this is the draft time's measured upper bound;
* ``tokens_per_s`` and ``per_cast``: the row's throughput and its ratio to Cast's at that B.

Runs on a CPU; prints a table and writes the rows to ``--out`` when given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from treeops import CostTable

POLICIES = ("Cast", "CastPrune", "CastGraft", "CastRoot")
CONTEXT = 256
"""The context the verify times are read at: bench_e2e's prompts are 128 tokens and its requests
generate 256, so a step's context runs over 128-384 tokens."""


def verify_us(row: dict, table: CostTable) -> float:
    """The verification forward's calibrated time per step for ``row`` at its batch size."""
    S = table.S_T(row["B"], CONTEXT)
    plans = row.get("plan_steps") or []
    steps = sum(p[5] for p in plans)
    if steps:  # [width, depth, verify, graft, chain, steps, step_us, accepted, λ]
        return sum(p[5] * float(S[min(p[2], table.n_max) - 1]) for p in plans) / steps
    n = max(1, round(row.get("mean_verify_bucket") or 1))
    return float(S[min(n, table.n_max) - 1])


def ablation(rows: list[dict], table: CostTable) -> list[dict]:
    by = {(r["policy"], r["B"]): r for r in rows}
    out = []
    for B in sorted({r["B"] for r in rows if r["policy"] in POLICIES}):
        cast = by.get(("Cast", B))
        for pol in POLICIES:
            r = by.get((pol, B))
            if r is None:
                continue
            v = verify_us(r, table)
            out.append({
                "B": B, "policy": pol,
                "tokens_per_s": r["tokens_per_s"],
                "per_cast": round(r["tokens_per_s"] / cast["tokens_per_s"], 3) if cast else None,
                "mean_accepted": r["mean_accepted"],
                "mean_verified_nodes": r.get("mean_verified_nodes"),
                # the row's count is summed over the batch: per active request here
                "grafted_per_request": round(
                    r.get("grafted_per_step", 0) / (B * (r.get("slot_use") or 1.0)), 2
                ),
                "draft_forwards_per_step": r.get("draft_forwards_per_step"),
                "step_us": r.get("step_us"),
                "verify_us": round(v, 1),
                "beyond_verify_us": round(r["step_us"] - v, 1) if r.get("step_us") else None,
                "commit": r.get("commit"),
                "session": r.get("session"),
            })  # fmt: skip
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--tables", nargs="*", default=None)
    ap.add_argument("--batches", default=None, help="comma list of batch sizes to keep")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.tables and len(args.tables) != len(args.runs):
        ap.error(f"--tables: {len(args.tables)} tables for {len(args.runs)} runs")
    by_batch: dict[int, dict[int, list[dict]]] = {}  # B -> run index -> its rows
    for i, run in enumerate(args.runs):
        with open(run) as f:
            doc = json.load(f)
        rows = doc["rows"] if isinstance(doc, dict) else doc
        tab = args.tables[i] if args.tables else os.path.join(os.path.dirname(run),
                                                                "e2e_cost_table.json")  # fmt: skip
        for r in ablation(rows, CostTable.load(tab)):
            r["source"] = os.path.basename(run)
            by_batch.setdefault(r["B"], {}).setdefault(i, []).append(r)
    keep = {int(b) for b in args.batches.split(",")} if args.batches else None
    out = [r for B in sorted(by_batch) if keep is None or B in keep
           for r in by_batch[B][max(by_batch[B])]]  # fmt: skip
    if not out:
        sys.exit(f"{', '.join(args.runs)}: no rows of {', '.join(POLICIES)}")
    cols = ("B", "policy", "tokens_per_s", "per_cast", "mean_accepted", "grafted_per_request",
            "draft_forwards_per_step", "step_us", "verify_us", "beyond_verify_us")  # fmt: skip
    print(" | ".join(cols))
    for r in out:
        print(" | ".join(str(r[c]) for c in cols))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"sources": [os.path.basename(r) for r in args.runs], "context": CONTEXT,
                       "rows": out}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
