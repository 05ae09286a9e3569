"""λ-CAST's planner against a measured plan set: which plans it runs, step by step, when each
plan's throughput is what a GPU run measured and a step's tokens are as noisy as one request's.

    python bench/planner_sim.py RUN.json --batch 1 [--policy Cast] [--seeds 8] [--steps 2200]

Reads the λ row of ``--policy`` at ``--batch`` in a ``bench_e2e.py`` result: its ``plan_steps``
(each plan's steps, µs per step and measured tokens per step). A ``CastPlanner`` (the decoder's
buckets, ``--max-width`` (default 10, as bench_e2e), depth 10, capacity 96) is restricted to
those plans, starts on the plan the row ran most, runs ``--warmup`` steps uncounted, and is fed,
each step, the chosen plan's measured step time (±1 %) and its measured tokens per request
times 1 + ``--cv`` / sqrt(B) × a normal draw (one request's accept length
at B = 1 varies by about ±40 %). The layer and verify curves the rules read come from a fixed
geometric acceptance model: on a tree the rules move the plan within the allowed set; on a chain
only probes do. Prints, per seed, the share of steps on chains, the mean measured throughput of
the plans run (tokens per µs of step, in the row's units) against the best plan's, and the most
run plans; ``--probes`` also each seed's probe log (``CastPlanner.describe``). Runs on a CPU.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

import treeops
from treeops import Plan
from treeops.decoder.engine import synthetic_cost_table
from treeops.decoder.graphs import token_buckets

ACCEPT = 0.8
"""Per-layer acceptance of the best candidate in the curves' model (later candidates decay)."""


def curves(pl: treeops.CastPlanner, rng: np.random.Generator) -> np.ndarray:
    """One step's ``cast_step_stats`` vector from the geometric model, 10 % noise."""
    lay = pl.layout
    x = np.zeros(pl.size)
    x[lay["active"]] = 1
    q = 0.5 ** np.arange(pl.W)
    layers = np.array([np.cumsum(ACCEPT ** (i + 1) * q) for i in range(pl.D)])
    x[lay["layers"]] = np.clip(
        layers * (1 + 0.1 * rng.standard_normal(layers.shape)), 0, None
    ).ravel()
    cand = np.sort(np.concatenate([ACCEPT ** (i + 1) * q for i in range(pl.D)]))[::-1]
    vc = np.concatenate([[1.0], 1 + np.cumsum(np.pad(cand, (0, pl.N))[: pl.N - 1])])
    x[lay["verify"]] = vc * (1 + 0.1 * rng.standard_normal())
    return x


def plan_of(entry) -> Plan:
    w, d, n, g, chain = entry[:5]
    return Plan.chain(d) if chain else Plan(w, d, n, g)


def simulate(plans: dict, B: int, seed: int, steps: int, cv: float, max_width: int,
             warmup: int = 0):  # fmt: skip
    """``plans``: Plan -> (µs per step, tokens per request per step, steps in the run). After
    ``warmup`` steps not counted (bench_e2e's warm-up: the planner keeps what it measured), runs
    ``steps``; returns the steps per plan and the planner's probe log."""
    pol = treeops.Cast(cost_table=synthetic_cost_table(96), topk=max_width, max_width=max_width,
                       max_depth=10, capacity=96)  # fmt: skip
    pl = treeops.CastPlanner(pol, verify_buckets=token_buckets(96),
                             width_buckets=token_buckets(max_width))  # fmt: skip
    start = max(plans, key=lambda p: plans[p][2])
    pl.restrict(B, [start])
    pl.restrict(B, list(plans))
    trees = [p for p in plans if not p.is_chain]
    if trees:
        pl._state(B).last_tree = max(trees, key=lambda p: plans[p][2])
    rng = np.random.default_rng(seed)
    count: dict = {}
    for i in range(warmup + steps):
        p = pl.plan(B)
        if i >= warmup:
            count[p] = count.get(p, 0) + 1
        us, tok, _ = plans[p]
        step_s = us * 1e-6 * (1 + 0.01 * rng.standard_normal())
        noisy = tok * max(0.05, 1 + cv / np.sqrt(B) * rng.standard_normal())
        pl.observe(B, curves(pl, rng), p, noisy, step_s, ctx=100)
    return count, pl.describe(B)["probes"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("run")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--policy", default="Cast")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2200)
    ap.add_argument("--warmup", type=int, default=400, help="steps run before counting")
    ap.add_argument("--cv", type=float, default=0.4)
    ap.add_argument("--max-width", type=int, default=10)
    ap.add_argument("--probes", action="store_true")
    args = ap.parse_args(argv)
    with open(args.run) as f:
        doc = json.load(f)
    rows = [r for r in doc["rows"] if r["policy"] == args.policy and r["B"] == args.batch]
    if not rows or not rows[0].get("plan_steps"):
        sys.exit(f"{args.run}: no λ row of {args.policy} at B = {args.batch}")
    # plan_steps: [width, depth, verify, graft, chain, steps, µs per step, accepted, λ]
    plans = {plan_of(e): (e[6], e[7], e[5]) for e in rows[0]["plan_steps"]}
    rate = {p: tok / us for p, (us, tok, _) in plans.items()}
    best = max(rate.values())
    for p in sorted(plans, key=lambda p: -rate[p]):
        print(f"{p}: {plans[p][2]} steps in the run, {1e3 * rate[p]:.3f} tokens per ms")
    for seed in range(args.seeds):
        count, probes = simulate(plans, args.batch, seed, args.steps, args.cv, args.max_width,
                                 args.warmup)  # fmt: skip
        n = sum(count.values())
        chain = sum(v for p, v in count.items() if p.is_chain) / n
        mean = sum(rate[p] * v for p, v in count.items()) / n
        top = sorted(count.items(), key=lambda kv: -kv[1])[:3]
        runs = ", ".join(f"{p.width, p.depth, p.verify} {v}" for p, v in top)
        print(f"seed {seed}: chains {chain:.2f} of the steps, throughput {mean / best:.3f} of "
              f"the best plan's; {runs}")  # fmt: skip
        if args.probes:
            for e in probes:
                print("   ", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
