"""Where each op stands against the targets of issues #15 and #16, from one folder of results.

Reads ``tree_attention.json``, ``tree_build_cast.json``, ``accept.json``, ``graft.json`` and
``host.json`` of a results folder (``bench/results/h200`` or another GPU's) and prints the
README's table of standings as Markdown: per target the worst row (which row, and the figure),
with the same rules as the targets:

* tree attention: speedup over FlashInfer's custom-mask prefill on the issue's five shapes
  (the range; target >= 3x), over its causal prefill on every row (the least; >= 1x), its
  time over its floor where the floor is >= 20 us (the most; <= 1.5x), its time where the floor
  is < 5 us (the most; < 8 us), head dim 256 over FlashInfer's custom mask (>= 1.2x);
* bookkeeping: each op's time over max(floor, 3 us) (the most; build layer <= 2x, greedy
  acceptance <= 1.5x, sampling <= 3x, compact_kv <= 2x, the table update <= 3x) and the whole
  EAGLE step at B 64, N 64 (<= 200 us at V 32,000);
* eager calls: ``host.json``'s eager - replay per op (<= 25 us).

A file that is absent leaves its rows out. The floors are the ones the rows carry (bytes over
the rates the file's ``ceilings`` name, or the H200's where a file predates them).

    python bench/standing.py [bench/results/h200]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

ISSUE_SHAPES = ((1, 1024, 64), (1, 16384, 64), (8, 4096, 64), (32, 4096, 64), (64, 2048, 32))
"""(B, ctx, n) of issue #16's first five rows (32 query / 8 KV heads, D 128)."""

Row = dict


def _load(folder: str, name: str) -> dict | None:
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _num(r: Row, k: str) -> bool:
    return isinstance(r.get(k), int | float)


def _attn_label(r: Row) -> str:
    extra = f", D {r['D']}" if r.get("D") != 128 else ""
    return f"B {r['B']}, ctx {r['ctx']:,}, n {r['n']}{extra}"


def _extreme(rows: list[Row], num: str, den: str, pick=min) -> tuple[float, Row] | None:
    """The row whose ``num / den`` is ``pick``'s (min or max) among rows with both, and it."""
    xs = [r for r in rows if _num(r, num) and _num(r, den)]
    if not xs:
        return None
    w = pick(xs, key=lambda r: r[num] / r[den])
    return w[num] / w[den], w


def attention(rows: list[Row]) -> list[tuple[str, str, str]]:
    """The tree-attention standings: (what, now, target) rows."""
    out = []
    d128 = [r for r in rows if r.get("D") == 128 and r.get("H_q") == 32 and r.get("hkv") == 8]
    five = [r for r in d128 if (r["B"], r["ctx"], r["n"]) in ISSUE_SHAPES]
    lo = _extreme(five, "flashinfer_custom_us", "treeops_us", min)
    hi = _extreme(five, "flashinfer_custom_us", "treeops_us", max)
    if lo and hi:
        n = sum(_num(r, "flashinfer_custom_us") and _num(r, "treeops_us") for r in five)
        now = f"{lo[0]:.2f}–{hi[0]:.2f}× ({n} of 5 shapes)"
        out.append(
            ("tree attention vs FlashInfer custom mask, the issue's five shapes", now, "≥ 3×")
        )
    causal = _extreme(rows, "flashinfer_causal_us", "treeops_us", min)
    if causal:
        both = [r for r in rows if _num(r, "flashinfer_causal_us") and _num(r, "treeops_us")]
        n_ok = sum(r["flashinfer_causal_us"] >= r["treeops_us"] for r in both)
        now = f"{causal[0]:.2f}× ({_attn_label(causal[1])}); {n_ok} of {len(both)} rows ≥ 1"
        out.append(("tree attention vs FlashInfer causal, every row", now, "≥ 1×"))
    big = _extreme([r for r in rows if r.get("floor_us", 0) >= 20], "treeops_us", "floor_us", max)
    if big:
        now = f"{big[0]:.2f}× ({_attn_label(big[1])})"
        out.append(("tree attention, floor ≥ 20 µs", now, "≤ 1.5×"))
    small = [r for r in rows if _num(r, "treeops_us") and r.get("floor_us", 99) < 5]
    if small:
        w = max(small, key=lambda r: r["treeops_us"])
        now = f"{w['treeops_us']:.1f} µs ({_attn_label(w)})"
        out.append(("tree attention, floor < 5 µs", now, "< 8 µs"))
    d256 = _extreme([r for r in rows if r.get("D") == 256], "flashinfer_custom_us", "treeops_us")
    if d256:
        now = f"{d256[0]:.2f}× ({_attn_label(d256[1])})"
        out.append(("tree attention, head dim 256 vs FlashInfer custom mask", now, "≥ 1.2×"))
    return out


def _worst(rows: list[Row], op: str, label: Callable[[Row], str]) -> tuple[float, str] | None:
    xs = [r for r in rows if r.get("op") == op and _num(r, "floor_us") and _num(r, "treeops_us")]
    if not xs:
        return None
    w = max(xs, key=lambda r: r["treeops_us"] / max(r["floor_us"], 3.0))
    return w["treeops_us"] / max(w["floor_us"], 3.0), f"{label(w)}: {w['treeops_us']:.1f} µs"


def _op_label(r: Row) -> str:
    parts = [f"B {r['B']}"]
    if r.get("V"):
        parts.append(f"V {r['V']:,}")
    if r.get("policy"):
        parts.append(str(r["policy"]).upper() if r["policy"] == "cast" else str(r["policy"]))
    if r.get("top_k"):
        parts.append("top-k/top-p")
    return ", ".join(parts)


def bookkeeping(build: list[Row], accept: list[Row], graft: list[Row]) -> list[tuple[str, ...]]:
    """The bookkeeping standings: each op's worst ratio to max(floor, 3 µs), and the step."""
    out = []
    for what, rows, op, target in (
        ("build layer", build, "layer", "≤ 2×"),
        ("greedy accept", accept, "greedy", "≤ 1.5×"),
        ("sampling accept", accept, "sampling", "≤ 3×"),
        ("compact_kv", accept, "compact_kv", "≤ 2×"),
        ("table update", graft, "update", "≤ 3×"),
    ):
        w = _worst(rows, op, _op_label)
        if w is not None:
            out.append((what, f"{w[0]:.2f}× ({w[1]})", target))
    steps = sorted(
        (
            r
            for r in build
            if r.get("op") == "step"
            and r.get("B") == 64
            and r.get("N") == 64
            and _num(r, "treeops_us")
        ),
        key=lambda r: r["V"],
    )
    if steps:
        now = ", ".join(f"{r['treeops_us']:.0f} µs (V {r['V']:,})" for r in steps)
        out.append(("whole EAGLE step, B 64, N 64", now, "≤ 200 µs (V 32,000)"))
    return out


def eager(host: dict) -> list[tuple[str, ...]]:
    """``host.json``'s eager - replay per op: the range and how many meet 25 µs."""
    over = [r["overhead_us"] for r in host.get("rows", []) if _num(r, "overhead_us")]
    if not over:
        return []
    n_ok = sum(x <= 25 for x in over)
    return [
        (
            "eager − replay, one op",
            f"{min(over):.0f}–{max(over):.0f} µs ({n_ok} of {len(over)} rows ≤ 25)",
            "≤ 25 µs",
        )
    ]


def standings(folder: str) -> tuple[list[tuple[str, ...]], list[str]]:
    """The table's rows and the notes on where they come from (GPU, date, floors' rates)."""
    docs = {
        n: _load(folder, f"{n}.json")
        for n in ("tree_attention", "tree_build_cast", "accept", "graft", "host")
    }
    rows = lambda n: (docs[n] or {}).get("rows", [])  # noqa: E731
    table = attention(rows("tree_attention"))
    table += bookkeeping(rows("tree_build_cast"), rows("accept"), rows("graft"))
    table += eager(docs["host"] or {})
    notes = []
    for n, d in docs.items():
        if d is None:
            notes.append(f"{n}.json: absent")
            continue
        rates = d.get("ceilings", {}).get("source", "the H200's (the file predates `ceilings`)")
        notes.append(
            f"{n}.json: {d.get('gpu')}, {d.get('date')}, commit "
            f"{str(d.get('commit'))[:10]}, floors' rates: {rates}"
        )
    return table, notes


def markdown(table: list[tuple[str, ...]]) -> str:
    lines = ["| target | now (the worst row) | goal |", "| --- | --- | --- |"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in table]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("folder", nargs="?", default=os.path.join(here, "results", "h200"))
    args = ap.parse_args(argv)
    table, notes = standings(args.folder)
    print(markdown(table))
    print()
    for n in notes:
        print(f"- {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
