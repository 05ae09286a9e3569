"""Where a whole decoding step's time goes, per plan shape: the measured step time of fixed
trees (``EagleStatic(depth, topk, verify, width)``, whole-step CUDA graphs) next to what a cost
table predicts for it, and the device time per kernel name of two plans under ``torch.profiler``.

The pair has the trained pair's shapes (``PairConfig.h200()``) and random weights: a fixed-shape
step graph costs the same whatever the weights, and no training is needed. Used to find what the
λ-CAST planner's cost model misses (the residual's intercept and its slope per draft layer).

``--chains D`` instead times one chain of depth D three ways (``chain_steps``): the chain
policy's step, and λ-CAST's and CastGraft's (over λ-CAST) steps confined to ``Plan.chain(D)``,
which draft the same tree; what the λ steps cost beyond the chain policy's is what the planner's
statistics, Graft's table and the λ buffers add, per kernel name at ``--profile-batch``.

    python bench/profile_step.py --table bench/results/h200/e2e_cost_table.json --out DIR
    python bench/profile_step.py --table bench/results/h200/e2e_cost_table.json --out DIR --chains 6
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from treeops import EagleStatic, Plan  # noqa: E402
from treeops.cost_table import CostTable  # noqa: E402
from treeops.decoder import Decoder  # noqa: E402
from treeops.decoder.graphs import bucket_for  # noqa: E402
from treeops.decoder.model import Draft, Target  # noqa: E402
from treeops.decoder.train import PairConfig  # noqa: E402

PLANS = [(1, 2, 8), (1, 6, 8), (1, 10, 16), (2, 6, 16), (2, 10, 16), (4, 10, 64), (10, 6, 64)]


def predicted_us(table: CostTable, ov: float, B: int, ctx: int, w: int, d: int, n: int) -> float:
    """The table's step: verify at n, catch-up at bucket(d + 1), the root layer at 1 row and
    d - 1 layers at w rows, each with the measured tree-op overhead ``ov``."""
    ST, SD = table.S_T(B, ctx), table.S_D(B, ctx)
    nb = bucket_for(n, table.n_max)
    return float(
        ST[nb - 1] + SD[bucket_for(d + 1, table.n_max) - 1] + SD[0] + ov
        + (d - 1) * (SD[w - 1] + ov)
    )  # fmt: skip


def kernel_mix(dec, prompts, new_tokens) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        res = dec.generate(prompts, new_tokens)
        torch.cuda.synchronize()
    us: Counter = Counter()
    cnt: Counter = Counter()
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            us[e.name[:60]] += e.device_time_total if hasattr(e, "device_time_total") else 0
            cnt[e.name[:60]] += 1
    s = max(1, res.steps)
    top = us.most_common(30)
    return {
        "steps": res.steps,
        "device_us_per_step": round(sum(us.values()) / s, 1),
        "kernels_per_step": round(sum(cnt.values()) / s, 1),
        "top": {k: [round(v / s, 1), round(cnt[k] / s, 2)] for k, v in top},
    }


CHAIN_DECODERS = ("chain", "Cast", "CastGraft")
"""The decoders ``chain_steps`` compares: the chain policy, λ-CAST, Graft over λ-CAST."""


def chain_steps(target, draft, table: CostTable, B: int, depth: int, prompts, new_tokens: int,
                graphs: bool, mix: bool = False) -> list[dict]:  # fmt: skip
    """One chain of ``depth`` drafted tokens, decoded by each of ``CHAIN_DECODERS`` (the λ ones
    confined to ``Plan.chain(depth)`` by ``CastPlanner.restrict``; whole-step graphs with
    ``graphs``): a row per decoder with its step time, the tokens it emitted (equal across the
    three: same draft, same tree) and, with ``mix``, its kernels per step by name."""
    from argparse import Namespace

    from bench_e2e import make_decoder

    args = Namespace(depth=depth, topk=10, budget=60, C1=None, C2=None, C3=None, cast_depth=10,
                     cast_budget=96, step_graphs=True, no_launch_ahead=False)  # fmt: skip
    rows = []
    for name in CHAIN_DECODERS:
        dec = make_decoder(name, target, draft, args, table, graphs)
        if dec.planner is not None:
            dec.planner.restrict(B, [Plan.chain(depth)])
        dec.generate(prompts, 8)  # captures
        if graphs:
            torch.cuda.synchronize()
        res = dec.generate(prompts, new_tokens)
        row = {"decoder": name, "B": B, "depth": depth, "steps": res.steps,
               "step_us": round(1e6 * res.time_decode / max(1, res.steps), 1),
               "mean_accepted": round(res.mean_accepted, 3), "captures": res.graphs_captured,
               "plans": sorted({tuple(p[:3]) + (p[5],) for p in res.plans}),
               "tokens": res.tokens}  # fmt: skip
        if mix:
            row["kernel_mix"] = kernel_mix(dec, prompts, 16)
        rows.append(row)
        del dec
        if graphs:
            torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--table", required=True)
    ap.add_argument("--out", default=".")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--profile-batch", type=int, default=64)
    ap.add_argument(
        "--chains",
        type=int,
        default=0,
        help="time a chain of this depth three ways instead (chain_steps)",
    )
    args = ap.parse_args()
    dev = torch.device("cuda")
    table = CostTable.load(args.table)
    ov_of = {int(k): v for k, v in table.meta.get("layer_overhead_us", {}).items()}
    cfg = PairConfig.h200().model_config()
    target = Target(cfg, seed=0, std=0.02).to(dev, torch.bfloat16)
    draft = Draft(cfg, seed=2, std=0.02).to(dev, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    rows, mixes = [], {}
    for B in [int(x) for x in args.batches.split(",")]:
        prompts = [torch.randint(1, cfg.vocab_size, (128,), generator=g).tolist() for _ in range(B)]
        if args.chains:
            got = chain_steps(target, draft, table, B, args.chains, prompts, args.new_tokens,
                              graphs=True, mix=B == args.profile_batch)  # fmt: skip
            for r in got:
                r.pop("tokens")
                print(json.dumps({k: v for k, v in r.items() if k != "kernel_mix"}), flush=True)
            rows += got
            continue
        for w, d, n in PLANS:
            pol = EagleStatic(depth=d, topk=10, budget=n, width=w)
            dec = Decoder(target, draft, pol, cuda_graphs=True, step_graphs=True,
                          static_shapes=True, page_size=16)  # fmt: skip
            dec.generate(prompts, 8)  # capture
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            res = dec.generate(prompts, args.new_tokens)
            dt = time.perf_counter() - t0
            step_us = 1e6 * res.time_decode / max(1, res.steps)
            ctx = 128 + args.new_tokens // 2
            pred = predicted_us(table, ov_of.get(B, 0.0), B, ctx, w, d, n)
            row = {"B": B, "plan": [w, d, n], "steps": res.steps, "step_us": round(step_us, 1),
                   "predicted_us": round(pred, 1), "residual_us": round(step_us - pred, 1),
                   "host_wait_us": round(1e6 * res.time_host_wait / max(1, res.steps), 1),
                   "wall_s": round(dt, 2), "captures": res.graphs_captured}  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
            if B == args.profile_batch and (w, d, n) in ((1, 6, 8), (2, 10, 16)):
                mixes[f"B{B}_{w}_{d}_{n}"] = kernel_mix(dec, prompts, 16)
                print(json.dumps({k: v for k, v in mixes[f"B{B}_{w}_{d}_{n}"].items()
                                  if k != "top"}), flush=True)  # fmt: skip
            del dec
            torch.cuda.empty_cache()
    out = {"gpu": torch.cuda.get_device_name(dev), "table": args.table, "rows": rows,
           "kernel_mix": mixes, "commit": os.environ.get("TREEOPS_COMMIT")}  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile_step.json"), "w") as f:
        json.dump(out, f, indent=1)
    for r in rows:
        if "decoder" in r:
            print(f"B={r['B']:3d} {r['decoder']:10s} chain d={r['depth']} step={r['step_us']:8.1f}"
                  f" kernels={r.get('kernel_mix', {}).get('kernels_per_step', '-')}")  # fmt: skip
            continue
        print(
            f"B={r['B']:3d} plan={r['plan']} step={r['step_us']:8.1f}"
            f" pred={r['predicted_us']:8.1f} resid={r['residual_us']:7.1f}"
            f" wait={r['host_wait_us']:7.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
