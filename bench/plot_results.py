"""Plot treeops against its peers and the floor from a results JSON (tree attention).

python bench/plot_results.py RESULTS.json OUT.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SERIES = [
    ("floor_us", "floor (max of bytes, flops)", "black"),
    ("treeops_us", "treeops", "tab:green"),
    ("flashinfer_custom_us", "FlashInfer custom mask (paged)", "tab:red"),
    ("flashinfer_causal_us", "FlashInfer causal (no tree)", "tab:orange"),
    ("sdpa_us", "SDPA + bool mask", "tab:blue"),
]


def main(src: str, dst: str) -> None:
    data = json.load(open(src))
    rows = data["rows"]
    labels = [f"B{r['B']}\nctx{r['ctx']}\nn{r['n']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, 0.8 * len(rows)), 4.5))
    width = 0.8 / len(SERIES)
    for k, (key, name, color) in enumerate(SERIES):
        xs = [i + (k - len(SERIES) / 2 + 0.5) * width for i in range(len(rows))]
        ys = [r.get(key) or 0 for r in rows]
        ax.bar(xs, ys, width, label=name, color=color)
    ax.set_yscale("log")
    ax.set_ylabel("median µs (log)")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_title(
        f"Tree-masked attention, {data['gpu']}, H_q/H_kv 32/8, D 128, bf16, "
        f"commit {data['commit'][:7]}",
        fontsize=9,
    )
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
