"""End-to-end speed of the example decoder: tokens/s per policy and batch size against
plain autoregressive decoding of the same target, with the same paged cache and CUDA graphs.

    python bench/bench_e2e.py --out DIR [--quick] [--budget-s S]       # H200: trains the pair
    python bench/bench_e2e.py --out DIR --random-model --quick --no-graphs   # CPU smoke test
    python bench/bench_e2e.py --out bench/results/h200x2 --tp 2 [...]   # 2 GPUs, NCCL (e2e_tp.py)

On the H200 (treeops must be installed: ``pip install -e .``, as ``bench/run_h200.sh`` does):
``OUT=DIR E2E_ARGS="--quick --budget-s 500" bash bench/run_h200.sh bench_e2e@580``.

Steps (each logged; ``DIR/e2e.json`` is rewritten after every row, so a run cut short keeps
what it measured):

1. Graph failures do not lose the run: a CUDA-graph capture error turns graphs off for the rest
   of the run (the row is redone eagerly; ``graphs_disabled`` in the JSON says where and why).
   ``--preflight`` also checks graphs against eager decoding on a tiny random fp32 pair (every
   policy, B = 2) before training: a capture error, a replay that changes the output or an
   under-sized bucket turns graphs off; token differences are recorded as warnings.
   ``--step-graphs``: autoregressive, chain and EagleStatic run with ``Decoder(step_graphs=True)``
   (one CUDA graph per whole decoding step; each row says ``step_graphs``; their profiled split
   puts the step's time in ``step_s``); Cast and CastGraft without thresholds (λ-CAST, and Graft
   over λ-CAST) always run whole-step graphs, with or without the flag. A whole-step capture
   error turns all graphs off like any other capture error.
2. The pair: ``treeops.decoder.train.train_pair(PairConfig.h200(), "cuda", cache_dir)`` (or a
   tiny random pair with ``--random-model``); decoding runs in bf16 on CUDA (fp32 on the CPU),
   the fp32 target is kept as the reference for divergences.
3. CAST's cost table for this model at the sizes the decoder runs (``calibrate``: the
   target's tree forward and the draft's frontier forward at every token bucket up to the
   capacity, at ``--contexts`` M context buckets of ``--context-len`` L tokens, CUDA-graph
   replays, and one draft layer's tree ops, the expand, per B), saved as
   ``DIR/e2e_cost_table.json``. ``Cast`` without ``--C1/2/3`` is λ-CAST (``CastPlanner``, its
   ``layer_overhead_us`` from this table), always in whole-step graphs (one per plan), its
   ``max_depth`` ``--cast-depth`` and capacity ``--cast-budget``.
4. For each B (priority order 1, 64, 8, 4, 16, 32, 2; ``--quick``: 1, 64, 8): groups of B
   held-out prompts (at least ``--min-requests`` requests, and enough groups that each
   (policy, B) row generates ``--min-tokens`` over its repeats; group g holds prompts
   ``(g * B + i) % len(prompts)``, the last ``--prompt-len`` tokens of each), greedy,
   ``--new-tokens`` each. One decoder per policy, warmed up on the first group (captures;
   λ-CAST until its planner has seen ``--planner-warmup-steps`` steps at this B, measured a
   chain and the chains its probes compare next to its plan (``CastPlanner.unprobed``), and a
   group kept its plan; its timed runs then move among the plans the warm-up ran),
   then
   ``--repeats`` rounds: in each, every policy decodes every group (autoregressive, chain,
   EagleStatic, Cast, CastGraft, the order rotated by one per round). A row merges its rounds:
   tokens/s = all generated tokens / the summed decode-loop wall times (prefill and captures
   excluded); ``speedup`` = the mean over rounds of its tokens/s ÷ the same round's
   autoregressive tokens/s, ``speedup_repeats`` and ``speedup_spread`` ((max - min) / mean);
   with ``--continuous`` also ``steady_tokens_per_s`` and ``steady_speedup``, the same over
   the full-batch window (``steady_tokens_per_s``: before the request list drains);
   λ-CAST rows add ``lambda_hat``, ``mean_width``, ``mean_depth``, the plans seen, the
   calibrated acceptance rates, the learnt step-time correction (a, b, c, e µs) and the
   planner's last probes (``planner_probes``: ``CastPlanner.describe``'s ``probes``). Without
   ``--no-profile`` each policy is decoded once more with ``profile=True`` (a device sync at
   every boundary) for the time split.
5. Greedy correctness in bf16: each request's output against the autoregressive output of the
   same request (same group); at its first divergence (after it the contexts differ), the fp32
   target's logits at that position decide: a *near-tie* if ``|l[a] - l[p]| < 0.05 * scale``
   (a = the autoregressive token, p = the policy's, scale = the standard deviation of that
   logits row: bf16 rounds a logit of size |l| by up to 2^-9 |l| and the tree forward sums in
   another order), otherwise a *mismatch* (a bug). Top-2 gaps are recorded too.

6. Kernels and the floor (CUDA; ``--no-kernel-count`` skips the count): each row's
   ``kernels_per_step`` (autoregressive rows), counted with ``torch.profiler`` over two
   ``generate`` calls after the warm-up (graph replays' kernels included, as CUPTI lists
   them; ``count_kernels``), with ``kernels_per_layer`` (÷ ``target_layers``), the per-step
   kernel mix and graph launches;
   ``step_us`` (decode time per step) beside ``weight_read_floor_us``: the target's weight
   bytes (layers, final norm, LM head) ÷ the copy rate (``harness.ceilings``), the floor of an
   autoregressive step. The autoregressive row of every B prints all three.

Writes ``DIR/e2e.json`` (``gpu``, ``versions``, ``commit``, ``model``, ``cost_table``, ``rows``)
and ``DIR/e2e.png`` (speedup over autoregressive against B, per policy; needs matplotlib), and
prints a table last. ``--budget-s`` (wall clock from the start, training included) stops adding
rows once the next B would not fit: 1.2 × the last batch size's time (``--first-batch-s``
before the first; the first B pays most of the kernel compiles, so the longest overstates the
rest: on the H200 B = 1 took 243 s, then B = 64 60 s). Each B's rows are written as it ends.
Within a B the same budget ends λ-CAST's warm-up early and starts no round that would end
after it (a row's ``repeats`` says how many ran), so a batch that outgrew its estimate keeps
rows instead of being killed by the caller's limit.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import sys
import time
import traceback
from collections import Counter

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import e2e_tp  # noqa: E402
import harness as H  # noqa: E402
from e2e_cost_table import calibrate  # noqa: E402
from e2e_divergence import MAX_DIVERGENCES_CHECKED, NEAR_TIE_REL, divergences  # noqa: E402

from treeops import CostTable, RankTemplate  # noqa: E402
from treeops.decoder import (  # noqa: E402
    CastGraft,
    Decoder,
    Draft,
    ModelConfig,
    Target,
    calibrate_checkpoints,
    make_policy,
)
from treeops.decoder.engine import DecodeResult, synthetic_cost_table  # noqa: E402
from treeops.decoder.tp import shard_target, with_tp_degree  # noqa: E402

SPEC_POLICIES = ("chain", "EagleStatic", "Cast", "CastGraft")
BATCHES = (1, 64, 8, 4, 16, 32, 2)  # priority order: the claims are about B = 1 and the largest
QUICK_BATCHES = (1, 64, 8)
CONTINUOUS_MIN_GROUPS = 8
"""With ``--continuous`` at least this many groups of B requests per timed run: the first B fill
the rows and 7 B wait, so every row is refilled (with a single group, as ``--min-tokens`` gives
from B = 22 on at 256 new tokens, nothing would wait and the run is a static batch). The run's
drain (once the queue is empty, rows idle as their last requests end) is no decode at batch
size B and its length is set by a few requests' end times: at 4 groups it was 11-31 % of a
B = 64 run's steps, and the policies' slot use ranged 0.75-0.91 on the same requests; twice the
groups halve its share."""


def log(msg: str) -> None:
    if e2e_tp.rank() == 0:  # --tp: the ranks run in lockstep; rank 0 speaks for them
        print(msg, flush=True)


# ------------------------------------------------------------------------------------ models
def random_pair(device: torch.device, small: bool) -> tuple[Target, Draft, dict]:
    """A target close to its bigram part (layers scaled by 0.1) and its bigram draft: drafts are
    often right, as with a trained pair (the tests' construction)."""
    if small:
        cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=64, tie_word_embeddings=False)  # fmt: skip
    else:
        cfg = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=64, tie_word_embeddings=False)  # fmt: skip
    target = Target(cfg, seed=0)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
    draft = Draft(cfg, seed=1).bigram_init(target)
    report = {"name": "random", "config": cfg.to_dict(), "note": "untrained: bigram draft"}
    return target.to(device), draft.to(device), report


def random_prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length,), generator=g).tolist() for _ in range(n)]


def trained_pair(device: torch.device, cache_dir: str, train_seconds: str | None = None):
    from treeops.decoder.train import PairConfig, train_pair

    cfg = PairConfig.h200()
    if train_seconds:  # "T,D": the target's and the draft's wall-clock caps (1,500 steps each)
        t, d = (float(x) for x in train_seconds.split(","))
        cfg = dataclasses.replace(cfg, target_seconds=t, draft_seconds=d)
    pair = train_pair(cfg, device=str(device), cache_dir=cache_dir)
    prompts = getattr(pair, "heldout_prompts", None) or pair.prompts
    report = dict(pair.report)
    return pair.target, pair.draft, prompts, report


# ----------------------------------------------------------------------------------- rows
# the fixed-shape policies ``--step-graphs`` runs with Decoder(step_graphs=True)
STEP_GRAPH_POLICIES = ("autoregressive", "chain", "EagleStatic")


def lambda_cast(args) -> bool:
    """Cast runs as λ-CAST (no thresholds given), and CastGraft as Graft over λ-CAST: always
    whole-step graphs, one per plan."""
    return args.C1 is None and args.C2 is None and args.C3 is None


ABLATION_POLICIES = ("CastPrune", "CastRoot")
"""Graft's variants beside Cast and CastGraft (which grafts below the best leaf, its default
``anchor="leaf"``: the g slots hold a chain of table successors extending the path most likely
accepted whole): ``CastPrune`` is CastGraft whose successor template is the root alone, so it
prunes (at the checkpoints with thresholds; under λ-CAST, the g slots its plans free) and grafts
nothing; ``CastRoot`` is CastGraft filling the slots with the root's successors
(``anchor="root"``, trie-merged by ``graft``)."""


def make_decoder(policy, target, draft, args, table, graphs, profile=False, calib_prompts=None):
    """The decoder of ``policy`` (a bench name) for these args. Graft over thresholded CAST
    (not λ-CAST) with ``calib_prompts``: its checkpoints' thresholds fitted on this pair first
    (``calibrate_checkpoints``, eager, nothing pruned)."""
    lam = policy in ("Cast", "CastGraft") + ABLATION_POLICIES and lambda_cast(args)
    prune_only = policy == "CastPrune"
    pol = make_policy("CastGraft" if policy in ABLATION_POLICIES else policy, depth=args.depth,
                      topk=args.topk, budget=args.budget, cost_table=table, C1=args.C1,
                      C2=args.C2, C3=args.C3, cast_depth=args.cast_depth,
                      cast_budget=args.cast_budget,
                      template=RankTemplate([-1], [-1]) if prune_only else None,
                      lambda_graft=lam,
                      anchor="root" if policy == "CastRoot" else "leaf")  # fmt: skip
    tp = getattr(target, "tp_group", None) is not None
    if isinstance(pol, CastGraft) and not lam and calib_prompts and not tp:
        ck = calibrate_checkpoints(target, draft, pol, calib_prompts, args.new_tokens)
        pol = dataclasses.replace(pol, checkpoints=ck)
    kw = dict(page_size=16)
    if (getattr(args, "step_graphs", False) and policy in STEP_GRAPH_POLICIES) or lam:
        # one graph per whole step (eager step body, static shapes, without graphs)
        kw.update(step_graphs=True, static_shapes=True,
                  launch_ahead=not getattr(args, "no_launch_ahead", False))  # fmt: skip
    if lam:
        ov = table.meta.get("layer_overhead_us") or {}
        ov = {int(b): float(v) for b, v in ov.items()}
        kw["planner_options"] = {
            "layer_overhead_us": (lambda B: ov.get(B, max(ov.values()))) if ov else 0.0
        }
    if getattr(target, "tp_group", None) is not None:  # --tp: the sharded target's group
        kw["tp_group"] = target.tp_group
    return Decoder(target, draft if policy != "autoregressive" else None, pol,
                   cuda_graphs=graphs, profile=profile, **kw)  # fmt: skip


def groups_of(prompts, B: int, min_requests: int) -> list[list]:
    """``ceil(min_requests / B)`` groups of B held-out prompts, decoded one after another: group
    g holds ``prompts[(g * B + i) % len(prompts)]`` (distinct while the prompts last)."""
    n = max(1, -(-max(1, min_requests) // B))
    return [[prompts[(g * B + i) % len(prompts)] for i in range(B)] for g in range(n)]


def merge_results(results: list[DecodeResult]) -> DecodeResult:
    """One result for groups decoded one after another: requests (tokens) and steps concatenated,
    times and counts summed, so ``tokens_per_s`` is total tokens / total decode time and
    ``mean_accepted`` is over every request-step of every group."""
    if len(results) == 1:
        return results[0]
    out = DecodeResult(tokens=[])
    for f in dataclasses.fields(DecodeResult):
        vals = [getattr(r, f.name) for r in results]
        if isinstance(vals[0], list):
            merged = [x for v in vals for x in v]
        elif isinstance(vals[0], bool):
            merged = all(vals)
        else:
            merged = sum(vals)
        setattr(out, f.name, merged)
    return out


# -------------------------------------------------------------------------- kernels, floors
_COPY_EVENTS = ("Memcpy", "Memset", "memcpy", "memset")


def count_kernels(dec, prompts, new_tokens: int) -> dict:
    """Device kernels per decoding step, counted with ``torch.profiler`` (CUPTI lists every
    kernel a CUDA-graph replay launches as a kernel event of its own, graph kernels included):
    two ``generate`` calls of the same prompts after the warm-up (no capture), ``hi`` =
    min(new_tokens, 32) and ``lo`` = hi // 4 new tokens; kernels_per_step = (kernels_hi -
    kernels_lo) / (steps_hi - steps_lo), so the prefill and per-call work cancel. Memcpy /
    memset events are not kernels. Also: the per-step mix of the most frequent kernel names and
    the per-step ``cudaGraphLaunch`` calls (a check: graphs launched but next to no kernels
    counted would mean CUPTI did not trace the graphs' kernels)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    hi = max(2, min(new_tokens, 32))
    lo = max(1, hi // 4)
    runs = []
    for n in (lo, hi):
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            res = dec.generate(prompts, n)
            sync()
        kern: Counter = Counter()
        launches = 0
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                if not e.name.startswith(_COPY_EVENTS):
                    kern[e.name[:100]] += 1
            elif e.name == "cudaGraphLaunch":
                launches += 1
        runs.append((kern, res.steps, launches, res.graphs_captured))
    (k_lo, s_lo, l_lo, g_lo), (k_hi, s_hi, l_hi, g_hi) = runs
    out: dict = {"kernel_count_steps": [s_lo, s_hi], "kernel_count_captures": g_lo + g_hi}
    if s_hi <= s_lo:
        out["kernels_per_step"] = None
        return out
    ds = s_hi - s_lo
    out["kernels_per_step"] = round((sum(k_hi.values()) - sum(k_lo.values())) / ds, 2)
    out["graph_launches_per_step"] = round((l_hi - l_lo) / ds, 2)
    mix = k_hi.copy()
    mix.subtract(k_lo)
    out["kernel_mix_per_step"] = {k: round(v / ds, 2) for k, v in mix.most_common(24) if v > 0}
    return out


def weight_read_bytes(target: Target) -> int:
    """Bytes of target weights one forward reads: every layer's, the final norm and the LM head
    (the tied embedding, or ``lm_head``; an untied embedding table only gathers B rows)."""
    skip = "model.embed_tokens.weight" if target.lm_head is not None else None
    return sum(p.numel() * p.element_size() for n, p in target.named_parameters() if n != skip)


def weight_read_floor_us(target: Target) -> float:
    """The weight-read floor of one target forward (an autoregressive step): weight bytes /
    the copy rate (``harness.ceilings``: 4.3 TB/s on the H200), in µs."""
    return H.bytes_floor_us(weight_read_bytes(target))


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def tokens_per_s(res) -> float:
    """Generated tokens per second of decoding: captures and the prefills of refilled rows
    (``--continuous``) excluded, as the first prefill is."""
    ntok = sum(len(t) for t in res.tokens)
    t = max(res.time_decode - res.time_capture - res.time_refill, 1e-9)
    return ntok / t


def steady_tokens_per_s(res) -> float | None:
    """Generated tokens per second of the full-batch window (``DecodeResult.steps_full``: until
    a row first idles with no request waiting; captures and refills excluded as in
    ``tokens_per_s``): the throughput of a batch kept full, as an engine under steady load keeps
    it, without the drain of a finite request list, where rows idle while the last requests
    finish (more so for plans whose tokens per step vary more). None without such a window."""
    t = res.time_full - res.capture_full - res.time_refill
    return res.tokens_full / t if res.tokens_full and t > 0 else None


def plan_steps(plans: list) -> list[list]:
    """Per plan a λ-CAST row's timed steps ran (``DecodeResult.plans``): [width, depth, verify,
    graft, topk, steps, mean measured step µs, mean tokens per request, their ratio in tokens
    per ms], over the steps with a measure (step time and tokens > 0) for the last three: what
    each plan delivered in the timed runs, next to what the planner believed."""
    acc: dict[tuple, list[float]] = {}
    for p in plans:
        a = acc.setdefault((*p[:3], *p[4:6]), [0, 0, 0.0, 0.0])
        a[0] += 1
        if len(p) > 7 and p[6] > 0 and p[7] > 0:
            a[1] += 1
            a[2] += p[6]
            a[3] += p[7]
    out = []
    for k, (n, m, t, tok) in sorted(acc.items()):
        us = 1e6 * t / m if m else None
        out.append([*k, n, us and round(us, 1), round(tok / m, 3) if m else None,
                    round(tok / t / 1e3, 4) if m else None])  # fmt: skip
    return out


def host_split(res: DecodeResult) -> dict:
    """``row_of``'s host time per step (µs): ``busy`` = loop wall time less captures and host
    waits; ``launch`` (enqueueing whole steps), ``absorb`` (reading and absorbing results),
    ``planner`` (λ-CAST's observe), ``refill`` (enqueueing refills) are parts of it."""
    n = max(1, res.steps)
    busy = res.time_decode - res.time_capture - res.time_host_wait
    parts = {"busy": busy, "launch": res.time_step, "absorb": res.time_tree,
             "planner": res.time_plan, "refill": res.time_refill_host}  # fmt: skip
    return {k: round(1e6 * v / n, 1) for k, v in parts.items()}


def row_of(policy, B, res, prof, ar_tps, div, graphs=None, groups=1, kernels=None,
           floor_us=None, layers=None) -> dict:  # fmt: skip
    """One row from the results merged over its ``groups`` groups of B requests; ``kernels``
    from ``count_kernels`` (CUDA), ``floor_us`` the target's weight-read floor per step and
    ``layers`` its layer count."""
    tps = tokens_per_s(res)
    st = res.stats()
    row = {
        "policy": policy,
        "B": B,
        "groups": groups,
        "requests": len(res.tokens),
        "graphs": graphs,
        "step_graphs": res.step_graphs,
        "tokens_per_s": round(tps, 1),
        "ar_tokens_per_s": round(ar_tps, 1),
        "speedup": round(tps / ar_tps, 3) if ar_tps else None,
        "mean_accepted": round(res.mean_accepted, 3),
        "steps": res.steps,
        # the share of (request row, step) slots with an active request: a static batch runs
        # until its last request ends, the finished rows idle (deeper plans finish less evenly)
        "slot_use": round(st["tokens"] / max(res.mean_accepted * res.steps * B, 1e-9), 3),
        "tokens": st["tokens"],
        "decode_s": round(res.time_decode, 4),
        "host_wait_s": round(res.time_host_wait, 4),
        "host_waits": res.host_waits,
        # host time blocked per decision wait in the timed run: mostly the GPU work it waits for
        "host_blocked_us_per_wait": round(st["host_wait_us_per_wait"], 1),
        "captures_in_timed_run": res.graphs_captured,
        "refill_s": round(res.time_refill, 4),
        # the host's work per step, µs (wall minus the waits: with launch-ahead the device
        # idles only where this exceeds its step), and its parts: enqueueing the step,
        # reading and absorbing its results, λ-CAST's planner, enqueueing refills
        "host_us_per_step": host_split(res),
        "undersized": res.undersized,
        "mean_verify_bucket": round(sum(res.verify_buckets) / max(1, len(res.verify_buckets)), 2),
        "mean_verified_nodes": round(
            sum(sum(r) for r in res.verified)
            / max(1, sum(sum(1 for x in r if x) for r in res.verified)),
            2,
        ),
        # (None where no draft forward ran: autoregressive rows)
        "draft_forwards_per_step": round(
            sum(len(x) for x in res.draft_buckets) / max(1, res.steps), 2
        )
        if res.draft_buckets
        else None,
        # decode-loop time per step (an autoregressive step: one target forward)
        "step_us": round(
            1e6
            * max(res.time_decode - res.time_capture - res.time_refill, 0.0)
            / max(1, res.steps),
            1,
        ),
        "target_layers": layers,
        "weight_read_floor_us": None if floor_us is None else round(floor_us, 2),
        "kernels_per_step": None,
        "kernels_per_layer": None,
    }
    if kernels:
        row.update(kernels)
        kps = kernels.get("kernels_per_step")
        if kps is not None and layers:
            row["kernels_per_layer"] = round(kps / layers, 2)
    if prof is not None:
        tot = prof.time_decode
        # profiled run: the device is synced before each wait, so this is the wait's own cost
        row["host_wait_cost_us"] = round(1e6 * prof.time_host_wait / max(1, prof.host_waits), 1)
        row["profiled_tokens_equal"] = prof.tokens == res.tokens
        row["split"] = {
            "profiled_decode_s": round(tot, 4),
            "draft_s": round(prof.time_draft, 4),
            "tree_ops_s": round(prof.time_tree, 4),
            "verify_s": round(prof.time_verify, 4),
            "host_wait_s": round(prof.time_host_wait, 4),
            # --step-graphs: the whole step's graph (draft + tree ops + verify), not split
            "step_s": round(prof.time_step, 4),
            "other_s": round(
                tot
                - prof.time_draft
                - prof.time_tree
                - prof.time_verify
                - prof.time_host_wait
                - prof.time_step,
                4,
            ),
        }
    if div is not None:
        row["divergence"] = div
    # a row whose tokens differ from autoregressive decoding beyond near-ties, or between its
    # timed and profiled runs, is reported but not plotted
    row["valid"] = (div is None or div.get("mismatch", 0) == 0) and row.get(
        "profiled_tokens_equal", True
    )
    return row


# ------------------------------------------------------------------------------- preflight
def preflight(device) -> dict:
    """Graphs on vs off on a tiny random fp32 pair, every policy, B = 2: equal outputs."""
    t0 = time.time()
    target, draft, _ = random_pair(device, small=False)
    prompts = random_prompts(target.cfg.vocab_size, 2, 24, seed=5)
    out = {"ok": True, "policies": {}}
    table = synthetic_cost_table(64)
    for pol in ("autoregressive",) + SPEC_POLICIES:
        kw = dict(depth=4, topk=4, budget=16, cost_table=table) if pol != "autoregressive" else {}
        try:
            policy = make_policy(pol, **kw)
            eager = Decoder(target, draft if kw else None, policy).generate(prompts, 16)
            dec = Decoder(target, draft if kw else None, policy, cuda_graphs=True)
            g1 = dec.generate(prompts, 16)
            g2 = dec.generate(prompts, 16)  # replays only
            # fp32: the graphs' bucketed GEMMs may round differently from the eager ones, so a
            # token difference is a warning (the rows' divergence analysis classifies them);
            # a capture error, a changed replay or an under-sized bucket turns graphs off
            same = eager.tokens == g1.tokens
            out["policies"][pol] = {"same_as_eager": same, "replay_same": g1.tokens == g2.tokens,
                                    "graphs": g1.graphs_captured, "undersized": g1.undersized,
                                    "mean_accepted": round(g1.mean_accepted, 3)}  # fmt: skip
            if not same:
                out["warnings"] = out.get("warnings", 0) + 1
            if g1.undersized or g1.tokens != g2.tokens or g2.graphs_captured:
                out["ok"] = False
        except Exception as e:
            out["ok"] = False
            out["policies"][pol] = {"error": f"{type(e).__name__}: {e}"[:600]}
            traceback.print_exc()
    out["seconds"] = round(time.time() - t0, 1)
    return out


# ------------------------------------------------------------------------------------- io
def env_info(device) -> dict:
    return {
        "gpu": H.gpu_name(device) if device.type == "cuda" else "cpu",
        "versions": H.versions(),
        "commit": H.commit(mark_dirty=True),
    }


def write(out_dir, doc):
    H.write_json(os.path.join(out_dir, "e2e.json"), doc)


def plot(out_dir, rows) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    flagged = False
    for pol in SPEC_POLICIES + ABLATION_POLICIES:
        pts = sorted(
            (r["B"], r["speedup"], min(r.get("speedup_repeats") or [r["speedup"]]),
             max(r.get("speedup_repeats") or [r["speedup"]]), r.get("valid", True))
            for r in rows
            if r["policy"] == pol and r.get("speedup")
        )  # fmt: skip
        if pts:
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            err = [[y - p[2] for y, p in zip(ys, pts)], [p[3] - y for y, p in zip(ys, pts)]]
            label = "λ-CAST" if pol == "Cast" else pol
            line = ax.errorbar(xs, ys, yerr=err, fmt="o-", capsize=3, label=label)
            bad = [(x, y) for x, y, p in zip(xs, ys, pts) if not p[4]]
            if bad:  # a divergence beyond the near-tie bound: the point ringed
                flagged = True
                ax.plot(*zip(*bad), "o", ms=13, mfc="none", color=line[0].get_color())
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size B")
    ax.set_ylabel("speedup over autoregressive (tokens/s; bars: repeats' range)")
    ax.set_title("treeops example decoder, greedy"
                 + (" (ringed: a bf16 divergence past the near-tie bound)" if flagged else ""),
                 fontsize=10)  # fmt: skip
    if ax.get_lines()[1:]:
        ax.legend()
    path = os.path.join(out_dir, "e2e.png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def table_text(rows) -> str:
    lines = [f"{'policy':<15}{'B':>4}{'req':>5}{'tok/s':>10}{'AR tok/s':>10}{'speedup':>9}"
             f"{'steady':>8}{'acc/step':>9}{'blk us':>9}{'diverged':>9}{'mismatch':>9}"
             f"{'step us':>9}"
             f"{'floor us':>9}{'kern/step':>10}{'kern/L':>8}"]  # fmt: skip

    def num(x, w, f=".1f"):
        return f"{'-':>{w}}" if x is None else f"{x:>{w}{f}}"

    for r in sorted(rows, key=lambda r: (r["B"], r["policy"])):
        d = r.get("divergence") or {}
        if "error" in r:
            lines.append(f"{r['policy']:<15}{r['B']:>4}  ERROR {r['error'][:80]}")
            continue
        lines.append(
            f"{r['policy']:<15}{r['B']:>4}{r.get('requests', r['B']):>5}"
            f"{r['tokens_per_s']:>10.1f}{r['ar_tokens_per_s']:>10.1f}"
            f"{r['speedup'] or 0:>9.2f}{num(r.get('steady_speedup'), 8, '.2f')}"
            f"{r['mean_accepted']:>9.2f}"
            f"{r['host_blocked_us_per_wait']:>9.1f}{d.get('diverged', 0):>9}"
            f"{d.get('mismatch', 0):>9}{num(r.get('step_us'), 9)}"
            f"{num(r.get('weight_read_floor_us'), 9)}{num(r.get('kernels_per_step'), 10)}"
            f"{num(r.get('kernels_per_layer'), 8, '.2f')}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ main
def parser() -> argparse.ArgumentParser:
    """The command line (``--help``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel degree: N ranks (one GPU each, NCCL; e2e_tp.py)",
    )
    ap.add_argument("--quick", action="store_true", help="B in {1, 64, 8}, fewer cost points")
    ap.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget (s)")
    ap.add_argument("--random-model", action="store_true", help="tiny random pair, no training")
    ap.add_argument("--no-graphs", action="store_true", help="eager forwards (no CUDA graphs)")
    ap.add_argument("--step-graphs", action="store_true",
                    help="autoregressive, chain and EagleStatic with Decoder(step_graphs=True): "
                    "one CUDA graph per whole decoding step (rows say step_graphs: true; the "
                    "autoregressive baseline of speedup too)")  # fmt: skip
    ap.add_argument("--free-plans", action="store_true",
                    help="λ-CAST's timed runs may move to plans the warm-up did not run "
                    "(capturing their graphs there, the capture left out of tokens/s; default: "
                    "only the warm-up's plans, as graphs captured at start-up)")  # fmt: skip
    ap.add_argument("--no-launch-ahead", action="store_true",
                    help="whole-step graphs one step at a time (launch, wait, read): the host's "
                    "per-step work not overlapped with the device's next step")  # fmt: skip
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled (split) runs")
    ap.add_argument("--continuous", action="store_true",
                    help="timed runs as continuous batching: all of a row's requests (at least "
                         "CONTINUOUS_MIN_GROUPS x B) in one generate(max_batch=B), a finished "
                         "request's row refilled")  # fmt: skip
    ap.add_argument("--no-kernel-count", action="store_true",
                    help="skip the torch.profiler kernel count per step (CUDA)")  # fmt: skip
    ap.add_argument("--preflight", action="store_true",
                    help="graphs vs eager on a random pair before training (a capture error "
                    "later falls back to eager anyway)")  # fmt: skip
    ap.add_argument("--batches", default=None, help="comma list (default: by --quick)")
    ap.add_argument(
        "--policies",
        default=",".join(SPEC_POLICIES),
        help="comma list of " + ", ".join(SPEC_POLICIES + ABLATION_POLICIES),
    )
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128 (CPU: 16)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 96 (CPU: 8)")
    ap.add_argument("--min-requests", type=int, default=8,
                    help="per B, ceil(R / B) groups of B distinct prompts, decoded one after "
                    "another and aggregated (default 8)")  # fmt: skip
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--topk", type=int, default=10)
    ap.add_argument("--budget", type=int, default=60, help="tree capacity (EAGLE-2: 60)")
    ap.add_argument("--C1", type=float, default=None,
                    help="CAST thresholds (all three None, the default: λ-CAST, and CastGraft "
                    "over λ-CAST; one given: thresholded CAST, CastGraft's others 0.3, 0.2, "
                    "0.1)")  # fmt: skip
    ap.add_argument("--C2", type=float, default=None)
    ap.add_argument("--C3", type=float, default=None)
    ap.add_argument("--cast-depth", type=int, default=10, help="Cast's max_depth")
    ap.add_argument("--cast-budget", type=int, default=96, help="Cast's capacity")
    ap.add_argument("--planner-warmup-steps", type=int, default=200,
                    help="λ-CAST's warm-up decodes groups until its planner has seen this many "
                    "steps at the batch size and a whole group kept its plan (at most "
                    "--planner-warmup-s): the timed runs see its settled plans, as an engine "
                    "would after its first requests")  # fmt: skip
    ap.add_argument("--planner-warmup-s", type=float, default=120.0,
                    help="cap on λ-CAST's warm-up per batch size (each new plan's first capture "
                    "compiles its kernels)")  # fmt: skip
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="per B, every policy's timed run repeated this many times, the "
        "policies interleaved (order rotated per repeat); ratios with spreads "
        "(default 3; 1 with --quick)",
    )
    ap.add_argument("--min-tokens", type=int, default=0,
                    help="per (policy, B) row, at least this many generated tokens over the "
                    "repeats (more groups of B prompts)")  # fmt: skip
    ap.add_argument("--table", default=None,
                    help="load the cost table from this JSON instead of calibrating (a table "
                    "an earlier run of the same pair wrote; also written to "
                    "$TREEOPS_TABLE_CACHE, default /tmp/treeops-e2e-table.json); calibrates "
                    "when the file is missing")  # fmt: skip
    ap.add_argument("--resume", default=None,
                    help="an earlier run's e2e.json: its rows are kept and its batch sizes "
                    "skipped (a run split over two device calls)")  # fmt: skip
    ap.add_argument("--first-batch-s", type=float, default=120.0,
                    help="the budget check's estimate of the first batch size's rows (later "
                    "ones: the longest batch so far); 0 always runs the first")  # fmt: skip
    ap.add_argument("--contexts", type=int, default=4, help="cost table context buckets M")
    ap.add_argument("--context-len", type=int, default=128, help="cost table bucket length L")
    ap.add_argument("--cache-dir", default=None, help="train_pair cache (/tmp/treeops-e2e-pair)")
    ap.add_argument("--train-only", action="store_true",
                    help="train (or load) the pair into its cache and stop: a later run in the "
                    "same machine then starts at the cost table; the GPU tests may run beside "
                    "the training, never beside the timings")  # fmt: skip
    ap.add_argument(
        "--train-seconds", default=None, help="T,D: training budgets (default: PairConfig.h200)"
    )
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.tp > 1 and not e2e_tp.active() and "WORLD_SIZE" not in os.environ:
        return e2e_tp.launch(sys.argv[1:] if argv is None else list(argv), args.tp)
    t_start = time.time()
    if args.tp > 1:  # a rank (e2e_tp.py): rank 0 writes --out, the others a scratch directory
        args.out = e2e_tp.init(args.out)
    os.makedirs(args.out, exist_ok=True)
    cuda = torch.cuda.is_available()
    device = e2e_tp.device() if args.tp > 1 else torch.device("cuda" if cuda else "cpu")
    if not cuda and not args.random_model:
        ap.error("without CUDA only --random-model runs (the trained pair is the H200's)")
    graphs = cuda and not args.no_graphs
    if not cuda:
        torch.set_num_threads(1)  # tiny matmuls: one thread (see tests/test_decoder.py)
    args.prompt_len = args.prompt_len or (128 if cuda else 16)
    args.new_tokens = args.new_tokens or (96 if cuda else 8)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if not cuda and args.budget == 60:  # the CPU references are slow: a smaller tree
        args.depth, args.topk, args.budget = 3, 3, 12
    batches = (
        [int(b) for b in args.batches.split(",")]
        if args.batches
        else list(QUICK_BATCHES if args.quick else BATCHES)
    )
    policies = [p for p in args.policies.split(",") if p]
    doc = env_info(device)
    doc.update({"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": [],
                "settings": {k: v for k, v in vars(args).items() if k != "out"},
                "graphs": graphs, "step_graphs": args.step_graphs,
                "launch_ahead": not args.no_launch_ahead,
                "near_tie_rule": f"|l[a] - l[p]| < {NEAR_TIE_REL} * std(fp32 "
                "logits row) at a request's first divergence (a: AR token, p: policy token)",
                "tokens_per_s_rule": "generated tokens / decode-loop wall time (prefill and "
                "graph captures excluded), summed over the row's groups of B requests, run "
                "one after another by one decoder warmed up on the first group",
                "steady_rule": "with --continuous: the same over the full-batch window, the "
                "steps before a row first idles with no request waiting (steady_step_share of "
                "the steps); steady_speedup against the autoregressive row's, per round",
            })  # fmt: skip

    # 1. preflight
    if graphs and args.preflight:
        log("preflight: CUDA graphs vs eager on a tiny random pair")
        pf = preflight(device)
        doc["preflight"] = pf
        log(json.dumps(pf))
        if not pf["ok"]:
            graphs = False
            doc["graphs"] = False
            log("PREFLIGHT FAILED: CUDA graphs turned OFF for this run (see e2e.json preflight)")
        write(args.out, doc)

    # 2. the pair
    t0 = time.time()
    if args.random_model:
        target, draft, report = random_pair(device, small=not cuda)
        prompts = random_prompts(target.cfg.vocab_size, 16, args.prompt_len + 4)
    else:
        # not under DIR: hundreds of MB of fp32 weights must not travel back with the results
        cache = args.cache_dir or os.environ.get("TREEOPS_PAIR_CACHE", "/tmp/treeops-e2e-pair")
        log(f"training / loading the pair (cache {cache})")
        target, draft, prompts, report = e2e_tp.rank0_first(
            lambda: trained_pair(device, cache, args.train_seconds)
        )
    report = dict(report)
    report["seconds_to_get"] = round(time.time() - t0, 1)
    ref32 = copy.deepcopy(target).float().eval()
    if cuda:
        target = target.to(torch.bfloat16).eval()
        draft = draft.to(torch.bfloat16).eval()
    report["decode_dtype"] = str(target.model.embed_tokens.weight.dtype)
    if args.tp > 1:  # heads and MLP split, the rest and the draft replicated; ref32 whole
        target = shard_target(target, e2e_tp.group())
        report["tp"] = args.tp
    layers = target.cfg.num_hidden_layers
    floor_us = weight_read_floor_us(target)
    report["target_layers"] = layers
    report["weight_read_bytes"] = weight_read_bytes(target)
    report["weight_read_floor_us"] = round(floor_us, 2)
    doc["model"] = report
    prompts = [p[-args.prompt_len :] for p in prompts if len(p) >= 2]
    if not prompts:
        raise SystemExit("no held-out prompts")
    log(f"pair ready in {report['seconds_to_get']} s; {len(prompts)} prompts")
    write(args.out, doc)
    if args.train_only:
        return 0

    # 3. cost table
    n_max = max(args.budget, args.topk, args.cast_budget)  # CAST: n_max >= capacity, max width
    cache = os.environ.get("TREEOPS_TABLE_CACHE", "/tmp/treeops-e2e-table.json")
    if args.tp > 1:  # a table per TP degree
        cache = cache.replace(".json", f"-tp{args.tp}.json")
    try:
        if args.table and os.path.exists(args.table):
            table = CostTable.load(args.table)
            log(f"cost table loaded from {args.table}")
        else:
            if args.table:  # (a device call on a fresh machine: its /tmp is empty)
                log(f"no cost table at {args.table}: calibrating")
            table = calibrate(target, draft, sorted(batches), n_max, args.context_len,
                              args.contexts, device, args.quick, topk=args.topk,
                              width=args.topk)  # fmt: skip
            table = with_tp_degree(table, args.tp) if args.tp > 1 else table
            if cuda and e2e_tp.rank() == 0:
                table.save(cache)
        table.save(os.path.join(args.out, "e2e_cost_table.json"))
        doc["cost_table"] = {"file": "e2e_cost_table.json", **table.meta}
    except Exception as e:
        traceback.print_exc()
        table = synthetic_cost_table(n_max)
        table = with_tp_degree(table, args.tp) if args.tp > 1 else table
        doc["cost_table"] = {"error": f"{type(e).__name__}: {e}"[:500], "used": "synthetic"}
        log("COST TABLE CALIBRATION FAILED: the synthetic table is used")
    write(args.out, doc)

    # 4. rows: per B, one decoder per policy (warmed up once), then ``repeats`` rounds of every
    # policy's timed run over the same groups, interleaved (the order rotated each round)
    order = ["autoregressive"] + [p for p in policies if p != "autoregressive"]
    if args.resume and not os.path.exists(args.resume):
        log(f"no earlier run at {args.resume}: every batch size runs")
    elif args.resume:
        with open(args.resume) as f:
            earlier = json.load(f)
        doc["rows"] = earlier.get("rows", [])
        doc["resumed_from"] = {"commit": earlier.get("commit"), "created": earlier.get("created")}
        done = {r["B"] for r in doc["rows"]}
        batches = [b for b in batches if b not in done]
        log(f"resumed: {len(doc['rows'])} rows kept, batch sizes left {batches}")
    stopped = None
    b_seconds: list[float] = []
    for B in batches:
        per_group = B * args.new_tokens * max(1, args.repeats)
        n_groups = max(-(-args.min_requests // B), -(-args.min_tokens // per_group))
        if args.continuous:
            n_groups = max(n_groups, CONTINUOUS_MIN_GROUPS)
        groups = groups_of(prompts, B, n_groups * B)
        bprompts = [p for g in groups for p in g]  # every request of the row, group by group
        est = b_seconds[-1] if b_seconds else args.first_batch_s
        if e2e_tp.agree(est > 0 and time.time() - t_start + 1.2 * est > args.budget_s):
            stopped = f"budget: B={B} and later not run ({time.time() - t_start:.0f} s used)"
            log(stopped)
            break
        t_b = time.time()
        try:
            deadline = t_start + args.budget_s if args.budget_s else None
            rows = run_batch(order, B, groups, bprompts, target, draft, ref32, args, table,
                             graphs, floor_us, layers, doc, deadline)  # fmt: skip
        except Exception as e:
            traceback.print_exc()
            rows = [{"policy": "autoregressive", "B": B, "error": f"{type(e).__name__}: {e}"[:500]}]
        doc["rows"].extend(rows)
        write(args.out, doc)
        b_seconds.append(time.time() - t_b)
        for r in rows:
            keys = ("tokens_per_s", "speedup", "speedup_spread", "mean_accepted",
                    "mean_verified_nodes", "lambda", "kernels_per_layer", "error")  # fmt: skip
            log(f"B={B} {r['policy']}: " + json.dumps({k: r.get(k) for k in keys if k in r}))
        if e2e_tp.agree(time.time() - t_start > args.budget_s):
            stopped = f"budget: stopped after B={B}"
            break
    doc["stopped"] = stopped
    doc["seconds"] = round(time.time() - t_start, 1)
    png = plot(args.out, [r for r in doc["rows"] if "error" not in r])
    doc["plot"] = os.path.basename(png) if png else "matplotlib not available"
    write(args.out, doc)
    log(f"\nwrote {os.path.join(args.out, 'e2e.json')}" + (f" and {png}" if png else ""))
    log(f"gpu {doc['gpu']}, graphs {doc['graphs']}, {doc['seconds']} s")
    log(table_text(doc["rows"]))
    return 0


def timed_run(dec, groups, args) -> DecodeResult:
    """Every request of ``groups`` decoded once: group after group (a static batch each), or with
    ``--continuous`` all in one ``generate`` of ``max_batch`` = the group size, a finished
    request's row taking the next waiting one (as an engine's continuous batching)."""
    if getattr(args, "continuous", False):
        res = dec.generate([p for g in groups for p in g], args.new_tokens,
                           max_batch=len(groups[0]))  # fmt: skip
        sync()
        return res
    out = []
    for g in groups:
        out.append(dec.generate(g, args.new_tokens))
        sync()
    return merge_results(out)


WARMUP_CONTINUOUS_GROUPS = 2
"""With ``--continuous``, the groups of requests one warm-up decode takes, continuously batched
as the timed runs are: each row decodes two requests, the second from a refill, so the planner
measures its plans on mixed contexts and refilled rows (a static group's rows all start
together, with the shortest contexts: trees measure relatively cheaper there than in the runs
they are chosen for)."""


def warm_up_planner(dec, B: int, groups: list, args, until: float) -> int:
    """λ-CAST's warm-up at batch size ``B``: ``dec`` decodes one group after another (from the
    second; with ``--continuous``, ``WARMUP_CONTINUOUS_GROUPS`` groups at a time in one
    ``generate(max_batch=B)``) until its planner has seen ``args.planner_warmup_steps`` steps,
    measured a chain (where it probes them) and the chains its probes compare next to its plan
    (``CastPlanner.unprobed``), and a whole decode kept its plan, or ``time.time()`` passes
    ``until``. Returns the groups decoded."""
    planner = dec.planner
    g, last = 1, None
    while time.time() < until:
        d = planner.describe(B)
        # a chain measured too where the planner probes them: the timed runs keep to the plans
        # the warm-up ran
        probed = not planner.chain_probes or any(row[7] == 1 for row in d["plans_measured"])
        if (d["steps"] >= args.planner_warmup_steps and d["plan"] == last and probed
                and not planner.unprobed(B)):  # fmt: skip
            # enough steps, a chain measured, a whole group kept its plan and the chains next
            # to it (depth ± 1) measured: the timed runs, restricted to the warm-up's plans, can
            # still move to a deeper or shallower chain
            break
        last = d["plan"]
        if getattr(args, "continuous", False):
            take = [groups[(g + i) % len(groups)] for i in range(WARMUP_CONTINUOUS_GROUPS)]
            dec.generate([p for grp in take for p in grp], args.new_tokens, max_batch=B)
            g += WARMUP_CONTINUOUS_GROUPS
        else:
            dec.generate(groups[g % len(groups)], args.new_tokens)
            g += 1
    return g - 1


def run_batch(order, B, groups, bprompts, target, draft, ref32, args, table, graphs, floor_us,
              layers, doc, deadline: float | None = None) -> list[dict]:  # fmt: skip
    """The rows of one batch size: decoders built and warmed up (graphs captured), then
    ``args.repeats`` rounds of every policy over ``groups`` (the order rotated per round), then
    per policy its row (results merged over the rounds; ``speedup`` = the mean over rounds of
    tokens/s ÷ the same round's autoregressive tokens/s, with ``speedup_repeats`` and
    ``speedup_spread`` = (max - min) / mean). A policy that fails is an error row. Before
    ``deadline`` (``time.time()``; None: none) λ-CAST's warm-up ends early, from a third of the
    time left, and a round that would end after it is not started (at least one runs)."""
    cuda = torch.cuda.is_available()
    decs, warm, errors = {}, {}, {}
    for pol in order:
        t0 = time.time()
        try:
            decs[pol] = make_decoder(pol, target, draft, args, table, graphs,
                                     calib_prompts=groups[0])  # fmt: skip
            if cuda:
                # graphs captured, Triton compiled (continuous: over every request, so the
                # static batch is sized for the longest, as in the timed runs)
                if getattr(args, "continuous", False):
                    timed_run(decs[pol], groups, args)
                else:
                    decs[pol].generate(groups[0], args.new_tokens)
                sync()
                planner = decs[pol].planner
                cap = args.planner_warmup_s
                if deadline is not None:  # the rounds need the rest
                    cap = min(cap, max(0.0, (deadline - time.time()) / 3))
                if planner is not None:
                    warm_up_planner(decs[pol], B, groups, args, t0 + cap)
                sync()
                if planner is not None and not args.free_plans:
                    # as an engine with its graphs captured at start-up: the timed runs move
                    # among the plans the warm-up ran (each captured), none is captured there
                    planner.restrict(B, planner.plans_run(B))
        except Exception as e:
            traceback.print_exc()
            errors[pol] = f"{type(e).__name__}: {e}"[:500]
            decs.pop(pol, None)
        warm[pol] = round(time.time() - t0, 1)
    rounds: dict[str, list[DecodeResult]] = {p: [] for p in decs}
    live = [p for p in order if p in decs]
    t_rounds = time.time()
    for r in range(max(1, args.repeats)):
        # a round that would not end before the deadline is not started: the row keeps the
        # rounds it has (``repeats`` says how many), where a kill would lose the batch
        per_round = (time.time() - t_rounds) / r if r else 0.0
        if r and deadline is not None and e2e_tp.agree(time.time() + 1.2 * per_round > deadline):
            log(f"B={B}: deadline: {r} of {args.repeats} rounds run")
            break
        k = r % len(live)
        for pol in live[k:] + live[:k]:
            rounds[pol].append(timed_run(decs[pol], groups, args))
    rows = []
    if "autoregressive" not in rounds:
        return [{"policy": p, "B": B, "error": e} for p, e in errors.items()]
    ar_r = [tokens_per_s(x) for x in rounds["autoregressive"]]
    ar_all = merge_results(rounds["autoregressive"])
    ar_tps = tokens_per_s(ar_all)
    for pol in order:
        if pol in errors:
            rows.append({"policy": pol, "B": B, "error": errors[pol]})
            continue
        res = merge_results(rounds[pol])
        kernels = None
        if cuda and not args.no_kernel_count and pol == "autoregressive":
            try:
                kernels = count_kernels(decs[pol], groups[0], args.new_tokens)
            except Exception as e:  # the count is a diagnostic: never lose the row for it
                kernels = {"kernel_count_error": f"{type(e).__name__}: {e}"[:300]}
        prof = None
        if cuda and not args.no_profile:
            decs[pol].profile = True
            prof = timed_run(decs[pol], groups, args)
            decs[pol].profile = False
        div = None
        if pol != "autoregressive":
            first = rounds[pol][0]
            div = divergences(ref32, bprompts, rounds["autoregressive"][0].tokens, first.tokens,
                              MAX_DIVERGENCES_CHECKED)  # fmt: skip
        row = row_of(pol, B, res, prof if prof is not None else (None if cuda else res), ar_tps,
                     div, graphs, len(groups), kernels=kernels, floor_us=floor_us,
                     layers=layers)  # fmt: skip
        tps_r = [tokens_per_s(x) for x in rounds[pol]]
        ratios = [t / a for t, a in zip(tps_r, ar_r)]
        mean = sum(ratios) / len(ratios)
        steady = [steady_tokens_per_s(x) for x in rounds[pol]]
        steady_ar = [steady_tokens_per_s(x) for x in rounds["autoregressive"]]
        if getattr(args, "continuous", False) and all(steady) and all(steady_ar):
            sr = [t / a for t, a in zip(steady, steady_ar)]
            row.update(
                steady_tokens_per_s=round(steady_tokens_per_s(res) or 0.0, 1),
                steady_speedup=round(sum(sr) / len(sr), 3),
                steady_speedup_repeats=[round(x, 3) for x in sr],
                steady_step_share=round(res.steps_full / max(res.steps, 1), 3),
            )
        row.update(
            repeats=len(ratios),
            tokens_per_s_repeats=[round(t, 1) for t in tps_r],
            speedup=round(mean, 3),
            speedup_repeats=[round(x, 3) for x in ratios],
            speedup_spread=round((max(ratios) - min(ratios)) / mean, 4) if mean else None,
            warmup_s=warm[pol],
        )
        if res.grafted and res.steps:  # Graft's rows: nodes the table added per step (batch)
            row["grafted_per_step"] = round(sum(res.grafted) / res.steps, 3)
        dec = decs[pol]
        if dec.graft is not None and dec.planner is None:  # thresholded Graft: its checkpoints
            ck = dec.graft.checkpoints
            row["checkpoints"] = {"steps": list(ck.steps), "keeps": list(ck.keeps),
                                  "thresholds": [round(t, 5) for t in ck.thresholds]}  # fmt: skip
        if dec.planner is not None and res.plans:
            d = dec.planner.describe(B)
            row.update(
                lambda_hat=d["lambda"], lambda_per_step_last=res.plans[-1][3],
                mean_width=round(sum(p[0] for p in res.plans) / len(res.plans), 3),
                mean_depth=round(sum(p[1] for p in res.plans) / len(res.plans), 3),
                mean_graft=round(sum(p[4] for p in res.plans) / len(res.plans), 3),
                plans_seen=sorted({(*p[:3], *p[4:6]) for p in res.plans}),
                plan_steps=plan_steps(res.plans),
                final_plan=d["plan"], rates=d["rates"],
                cost_correction_us=d["cost_correction_us"],
                plans_measured=d["plans_measured"], graft_rate=d["graft_rate"],
                planner_probes=d["probes"],
            )  # fmt: skip
        rows.append(row)
    del decs
    gc.collect()  # the decoders and their static batches reference each other
    if cuda:
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    sys.exit(main())
