"""Graft's rank-path template against alternatives, on the CPU with the trained tiny pair.

    python bench/template_acceptance.py [--out bench/results/cpu/template_acceptance.json]

Two measures, the same five templates (``bench_graft.py --template-coverage``'s set: the default
80-node ``RankTemplate.default()``, ``balanced(4, 3)``, ``balanced(8, 2)``, ``chain(9)``, and
``from_rank_probs`` of flatter probabilities):

1. Acceptance in the example decoder. ``treeops.decoder.Decoder`` decodes held-out prompts
   greedily with the tiny pair of ``treeops demo`` (loaded from its cache, trained there if
   absent) under ``Cast`` (no graft: the baseline) and ``CastGraft`` with each template, at two
   tree sizes: the demo's (depth 5, top-k 4, budget 24) and a budget of 60 (depth 8, top-k 8).
   Graft adds nodes only where a checkpoint pruned the request (the budget is CAST's verify
   count of the unpruned tree), in template (breadth-first) order while there is room.
   Per run: tokens emitted per request-step (accepted + bonus, as ``DecodeResult.mean_accepted``),
   the grafted nodes per request-step and how many emitted tokens sat on grafted nodes. The
   decoder reports grafted nodes per step only; which accepted nodes were grafted is read here by
   wrapping the decoder's ``prune``/``graft``/``accept_greedy`` calls (the merged tree keeps the
   pruned tree's nodes first, so an accepted node of index >= the pruned tree's size was grafted).
   Every output is checked against autoregressive greedy decoding, token for token. The spread:
   the standard error over prompts of each template's mean, and per-prompt paired differences
   against the default (mean, standard error, prompts better / worse).
2. Coverage of real continuations at the token level (``bench_graft.template_coverage`` on the
   pair's BPE tokens instead of bytes): a successor table [512, 8] of each token's 8 most frequent
   successors in the training split's token stream (bigram counts), retrieval from random
   held-out positions, each retrieved tree walked along the true continuation; the mean accepted
   length of retrieval alone, with the whole template and with its first 16 nodes only (about
   what a pruned request has room for under these budgets).

Writes the JSON (command, date, machine, the pair's report, every per-prompt number) and prints
a table last. About two minutes on two CPU cores (one thread).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_graft import walk_lengths  # noqa: E402  (the same walk as the byte-level coverage)

from treeops import NO_PRUNE, AdjacencyTable, RankTemplate
from treeops._graft_types import DEFAULT_RANK_PROBS  # the default template's probabilities
from treeops.decoder import Decoder, make_policy
from treeops.decoder import engine as _engine  # the decoder's refill calls graft here
from treeops.decoder import step as _step  # and its steps prune and accept_greedy here
from treeops.decoder.train import (
    PairConfig,
    TrainedPair,
    encode_stream,
    heldout_prompts,
    python_sources,
    train_pair,
)

FLAT_PROBS = (0.4, 0.2, 0.12, 0.08, 0.06, 0.05, 0.04, 0.03)


def templates() -> dict[str, RankTemplate]:
    return {
        "default (80)": RankTemplate.default(),
        "balanced 4x3 (85)": RankTemplate.balanced(4, 3),
        "balanced 8x2 (73)": RankTemplate.balanced(8, 2),
        "chain 9 (10)": RankTemplate.chain(9),
        "flatter probs (80)": RankTemplate.from_rank_probs(FLAT_PROBS, 80, 9),
    }


SETTINGS = {
    "demo: depth 5, top-k 4, budget 24": dict(depth=5, topk=4, budget=24),
    "depth 8, top-k 8, budget 60": dict(depth=8, topk=8, budget=60),
}


# ------------------------------------------------------------------------------------ data
def load_data(
    cfg: PairConfig, cache_dir: Path, num_prompts: int
) -> tuple[TrainedPair, list[list[int]], torch.Tensor, torch.Tensor]:
    """The pair, ``num_prompts`` held-out prompts and the train / held-out token streams.

    The pair's own prompts (one per held-out file) come first; more are drawn from the same
    held-out files at other seeded line starts (``heldout_prompts`` with seeds 1, 2, ...)."""
    pair = train_pair(cfg, "cpu", cache_dir, log=lambda m: print(f"  {m}", file=sys.stderr))
    train_texts, held_texts = python_sources(
        cfg.data_bytes, cfg.heldout_fraction, cfg.seed, max_file_bytes=cfg.max_file_bytes
    )
    tok = pair.tokenizer
    if heldout_prompts(tok, held_texts, cfg) != pair.prompts:
        raise RuntimeError("the held-out files read here are not the pair's: retrain the pair")
    prompts = [list(p) for p in pair.prompts]
    seen = {tuple(p) for p in prompts}
    seed = cfg.seed
    while len(prompts) < num_prompts and seed < cfg.seed + 20:
        seed += 1
        for p in heldout_prompts(tok, held_texts, cfg.replace(seed=seed)):
            if tuple(p) not in seen and len(prompts) < num_prompts:
                seen.add(tuple(p))
                prompts.append(p)
    return pair, prompts, encode_stream(tok, train_texts), encode_stream(tok, held_texts)


# ------------------------------------------------------------------------------ decoding
@contextlib.contextmanager
def _graft_log(log: list[dict[str, list[int]]]):
    """Wrap the decoder's prune / graft / accept_greedy: per step and request, the draft and
    pruned tree sizes, the grafted nodes and the accepted nodes that were grafted."""
    prune0, graft0, accept0 = _step.prune, _engine.graft, _step.accept_greedy
    step: dict[str, Any] = {}

    def prune(tree, keep, **kw):
        out = prune0(tree, keep, **kw)
        step["draft"], step["pruned"] = tree.num_nodes.tolist(), out.num_nodes.tolist()
        step["was_pruned"] = (keep < NO_PRUNE).tolist() if torch.is_tensor(keep) else None
        return out

    def graft(pruned, *a, **kw):
        out = graft0(pruned, *a, **kw)
        step["hybrid"] = out.num_nodes.tolist()
        return out

    def accept_greedy(tree, *a, **kw):
        acc = accept0(tree, *a, **kw)
        alen = acc.accept_len.tolist()
        path = acc.accepted.tolist()
        row = {"emitted": alen, "nodes": tree.num_nodes.tolist()}
        if "hybrid" in step:
            row.update(step)
            row["grafted"] = [h - p for h, p in zip(step["hybrid"], step["pruned"])]
            # accepted nodes path[1:alen] (the root is path[0]); grafted ones follow the pruned
            row["acc_grafted"] = [
                sum(1 for i in path[b][1:n] if i >= step["pruned"][b]) for b, n in enumerate(alen)
            ]
        log.append(row)
        step.clear()
        return acc

    _step.prune, _engine.graft, _step.accept_greedy = prune, graft, accept_greedy
    try:
        yield
    finally:
        _step.prune, _engine.graft, _step.accept_greedy = prune0, graft0, accept0


def decode(
    pair: TrainedPair,
    prompts: list[list[int]],
    policy: str,
    template: RankTemplate | None,
    setting: dict[str, int],
    batch: int,
    new_tokens: int,
) -> dict[str, Any]:
    """Decode ``prompts`` in batches of ``batch``; per prompt: its tokens, request-steps, tokens
    emitted, grafted nodes, emitted tokens that were grafted nodes, steps it was pruned."""
    eos = pair.target.cfg.eos_token_id
    stop = [eos] if eos is not None else None
    per: dict[str, list] = {k: [] for k in ("tokens", "steps", "emitted", "grafted", "acc_grafted")}
    per["pruned_steps"] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        B = len(chunk)
        kw = dict(setting) if policy != "autoregressive" else {}
        # the templates are root-anchored (``graft``); the decoder's default grafts below the leaf
        pol = make_policy(policy, template=template, anchor="root", **kw)
        dec = Decoder(pair.target, pair.draft, pol)
        log: list[dict[str, list[int]]] = []
        with _graft_log(log):
            res = dec.generate(chunk, new_tokens, stop_ids=stop)
        for b in range(len(chunk)):
            rows = [r for r in log if r["emitted"][b] > 0]
            per["tokens"].append(res.tokens[b])
            per["steps"].append(len(rows))
            per["emitted"].append(sum(r["emitted"][b] for r in rows))
            per["grafted"].append(sum(r.get("grafted", [0] * len(chunk))[b] for r in rows))
            per["acc_grafted"].append(sum(r.get("acc_grafted", [0] * len(chunk))[b] for r in rows))
            per["pruned_steps"].append(sum(1 for r in rows if (r.get("was_pruned") or [0] * B)[b]))
    per["seconds"] = time.perf_counter() - t0
    return per


def _mean_se(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n)


def _median(xs: list[float]) -> float:
    s, n = sorted(xs), len(xs)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def summarise(run: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    """Template-level numbers from a ``decode`` run; ``base``: the default template's run."""
    steps, emitted = run["steps"], run["emitted"]
    rate = [e / max(1, s) for e, s in zip(emitted, steps)]
    m, se = _mean_se(rate)
    tot_steps = sum(steps)
    out: dict[str, Any] = {
        "accepted_per_step": m,  # mean over prompts of tokens emitted per step
        "accepted_per_step_se": se,
        "accepted_per_step_pooled": sum(emitted) / max(1, tot_steps),
        "request_steps": tot_steps,
        "pruned_fraction": sum(run["pruned_steps"]) / max(1, tot_steps),
        "grafted_per_step": sum(run["grafted"]) / max(1, tot_steps),
        "grafted_accepted_per_step": sum(run["acc_grafted"]) / max(1, tot_steps),
        "grafted_share_of_accepted": sum(run["acc_grafted"])
        / max(1, sum(emitted) - tot_steps),  # accepted draft/graft nodes (bonus excluded)
        "seconds": run["seconds"],
        "per_prompt_accepted_per_step": rate,
    }
    if base is not None:
        brate = [e / max(1, s) for e, s in zip(base["emitted"], base["steps"])]
        d = [a - b for a, b in zip(rate, brate)]
        dm, dse = _mean_se(d)
        out["vs_default"] = {
            "mean_diff": dm,
            "se": dse,
            "median_diff": sorted(d)[len(d) // 2]
            if len(d) % 2
            else sum(sorted(d)[len(d) // 2 - 1 : len(d) // 2 + 1]) / 2,
            "better": sum(x > 1e-12 for x in d),
            "worse": sum(x < -1e-12 for x in d),
        }
    return out


def measure_acceptance(
    pair: TrainedPair,
    prompts: list[list[int]],
    tpls: dict[str, RankTemplate],
    settings: dict[str, dict[str, int]],
    batch: int,
    new_tokens: int,
) -> dict[str, Any]:
    """Every (setting, policy/template) run, summarised, with the greedy check."""
    ar = decode(pair, prompts, "autoregressive", None, {}, batch, new_tokens)
    out: dict[str, Any] = {"autoregressive_seconds": ar["seconds"], "settings": {}}
    default = next(iter(tpls))
    for sname, setting in settings.items():
        runs: dict[str, dict[str, Any]] = {}
        runs["Cast (no graft)"] = decode(pair, prompts, "Cast", None, setting, batch, new_tokens)
        for tname, tpl in tpls.items():
            runs[tname] = decode(pair, prompts, "CastGraft", tpl, setting, batch, new_tokens)
        rows = {}
        for name, run in runs.items():
            rows[name] = summarise(run, runs[default])
            bad = [i for i, (x, y) in enumerate(zip(run["tokens"], ar["tokens"])) if x != y]
            rows[name]["same_as_greedy"] = not bad
            rows[name]["differs_from_greedy"] = bad
        out["settings"][sname] = {"setting": setting, "rows": rows}
        print(f"  {sname}: done", file=sys.stderr, flush=True)
    return out


# ------------------------------------------------------------------------------ coverage
def token_coverage(
    train: torch.Tensor,
    held: torch.Tensor,
    vocab_size: int,
    tpls: dict[str, RankTemplate],
    k: int = 8,
    positions: int = 4000,
    count: int | None = None,
    seed: int = 0,
) -> dict[str, list[int]]:
    """``bench_graft.template_coverage`` over tokens: per held-out position, the accepted length
    of retrieval alone (a table of each token's top-k successors by training-split bigram count;
    successors never seen stay empty). ``count``: retrieve at most that many nodes."""
    train, held = train.long(), held.long()
    counts = torch.zeros(vocab_size, vocab_size, dtype=torch.float64)
    counts.index_put_(
        (train[:-1], train[1:]), torch.ones(len(train) - 1, dtype=torch.float64), accumulate=True
    )
    val, idx = counts.topk(k, dim=1)  # ties: torch's order; counts rarely tie among the top k
    table = AdjacencyTable(vocab_size, k)
    table.table.copy_(torch.where(val > 0, idx, -1).to(torch.int32))
    g = torch.Generator().manual_seed(seed)
    depth = max(t.max_depth for t in tpls.values())
    pos = torch.randint(0, len(held) - depth - 1, (positions,), generator=g)
    out = {}
    for name, tpl in tpls.items():
        out[name] = walk_lengths(table.retrieve(held[pos], tpl, count), held, pos)
    return out


def summarise_coverage(lens: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    base = next(iter(lens.values()))
    out = {}
    for name, xs in lens.items():
        m, se = _mean_se([float(x) for x in xs])
        dm, dse = _mean_se([float(a - b) for a, b in zip(xs, base)])
        out[name] = {"mean": m, "se": se, "diff_vs_default": dm, "diff_se": dse}
    return out


# ---------------------------------------------------------------------------------- main
def _machine() -> dict[str, Any]:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": 1,  # main() decodes and counts on one intra-op thread
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def _commit() -> str:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, text=True
        ).strip()
    return "unknown"


def print_table(res: dict[str, Any]) -> None:
    for sname, s in res["acceptance"]["settings"].items():
        n = len(next(iter(s["rows"].values()))["per_prompt_accepted_per_step"])
        print(f"\nacceptance, {sname} ({n} prompts; mean ± standard error over prompts)")
        hdr = (
            f"{'template':<20}{'tokens/step':>15}{'vs default: mean, median':>28}{'+/-':>7}"
            f"{'pruned':>8}{'grafted/step':>13}{'from graft/step':>16}{'greedy':>8}"
        )
        print(hdr)
        print("-" * len(hdr))
        for name, r in s["rows"].items():
            v = r.get("vs_default", {})
            vs = f"{v['mean_diff']:+.3f} ± {v['se']:.3f}, {v['median_diff']:+.2f}" if v else ""
            pm = f"{v['better']}/{v['worse']}" if v else ""
            same = "yes" if r["same_as_greedy"] else "NO"
            print(
                f"{name:<20}{r['accepted_per_step']:>9.3f} ± {r['accepted_per_step_se']:.3f}"
                f"{vs:>28}{pm:>7}{r['pruned_fraction']:>8.0%}{r['grafted_per_step']:>13.2f}"
                f"{r['grafted_accepted_per_step']:>16.3f}{same:>8}"
            )
    cov = res["coverage"]
    print(
        f"\ntoken-level coverage: mean accepted length of retrieval alone at {cov['positions']} "
        f"held-out positions (± standard error; paired difference vs default)"
    )
    hdr = f"{'template':<20}{'whole template':>26}{'first 16 nodes':>26}"
    print(hdr)
    print("-" * len(hdr))
    for name in cov["full"]:
        cells = []
        for key in ("full", "first16"):
            c = cov[key][name]
            cells.append(f"{c['mean']:.3f} ({c['diff_vs_default']:+.3f}±{c['diff_se']:.3f})")
        print(f"{name:<20}{cells[0]:>26}{cells[1]:>26}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/cpu/template_acceptance.json")
    ap.add_argument("--preset", default="tiny", choices=["tiny", "micro"])
    ap.add_argument("--cache-dir", help="the pair's cache (default: treeops demo's)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--positions", type=int, default=4000)
    args = ap.parse_args(argv)
    from treeops.demo import DEFAULT_CACHE

    cfg = {"tiny": PairConfig.tiny, "micro": PairConfig.micro}[args.preset]()
    cache = Path(args.cache_dir) if args.cache_dir else DEFAULT_CACHE / f"{args.preset}-pair"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second OpenMP thread only spin-waits
    t0 = time.perf_counter()
    try:
        pair, prompts, train, held = load_data(cfg, cache, args.prompts)
        tpls = templates()
        print(
            f"{len(prompts)} held-out prompts of {len(prompts[0])} tokens, {args.new_tokens} new "
            f"tokens, batch {args.batch}",
            file=sys.stderr,
        )
        acc = measure_acceptance(pair, prompts, tpls, SETTINGS, args.batch, args.new_tokens)
        V = pair.target.cfg.vocab_size
        full = token_coverage(train, held, V, tpls, positions=args.positions)
        first16 = token_coverage(train, held, V, tpls, positions=args.positions, count=16)
    finally:
        torch.set_num_threads(threads)
    res = {
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "machine": _machine(),
        "model": {"config": cfg.to_dict(), "report": pair.report},
        "prompts": len(prompts),
        "prompt_len": len(prompts[0]),
        "new_tokens": args.new_tokens,
        "batch": args.batch,
        "templates": {n: repr(t) for n, t in tpls.items()},
        "default_rank_probs": list(DEFAULT_RANK_PROBS),
        "flatter_rank_probs": list(FLAT_PROBS),
        "acceptance": acc,
        "coverage": {
            "positions": args.positions,
            "train_tokens": int(train.numel()),
            "heldout_tokens": int(held.numel()),
            "full": summarise_coverage(full),
            "first16": summarise_coverage(first16),
        },
        "seconds": time.perf_counter() - t0,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out} in {res['seconds']:.0f} s", file=sys.stderr)
    print_table(res)
    ok = all(r["same_as_greedy"] for s in acc["settings"].values() for r in s["rows"].values())
    if not ok:
        print("\nFAILED: a run's output differs from autoregressive greedy decoding")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
