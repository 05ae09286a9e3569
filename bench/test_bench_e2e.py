"""bench/bench_e2e.py on the CPU: a tiny random pair, no CUDA graphs; rows, groups, the budget
rule and ``--step-graphs`` rows."""

from __future__ import annotations

import json

import bench_e2e as bench
import pytest

from treeops.decoder import Decoder, make_policy


def test_bench_e2e_random_model_writes_rows(tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--random-model", "--quick", "--no-graphs",
            "--batches", "1,2", "--new-tokens", "4", "--prompt-len", "8"]  # fmt: skip
    assert bench.main(argv) == 0
    doc = json.loads((tmp_path / "e2e.json").read_text())
    for key in ("gpu", "versions", "commit", "model", "rows", "cost_table", "settings"):
        assert key in doc, key
    assert "error" not in doc["cost_table"]
    assert (tmp_path / "e2e_cost_table.json").exists()
    rows = doc["rows"]
    want = {(p, B) for B in (1, 2) for p in ("autoregressive",) + bench.SPEC_POLICIES}
    assert {(r["policy"], r["B"]) for r in rows} == want
    for r in rows:
        assert "error" not in r, r
        for key in ("policy", "B", "tokens_per_s", "ar_tokens_per_s", "mean_accepted"):
            assert key in r
        assert r["tokens_per_s"] > 0 and r["mean_accepted"] >= 1.0
        assert r["undersized"] == 0
        if r["policy"] != "autoregressive":
            assert set(r["split"]) >= {"draft_s", "tree_ops_s", "verify_s", "host_wait_s"}
            d = r["divergence"]
            assert d["mismatch"] == 0 and d["requests"] == r["requests"]  # fp32 CPU: exact
        assert r["groups"] == -(-8 // r["B"]) and r["requests"] == r["groups"] * r["B"]
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].split()[0] in ("chain", "autoregressive", "EagleStatic", "Cast", "CastGraft")


def test_bench_e2e_min_requests_groups(tmp_path, pair):
    """--min-requests 4 at B = 1: four groups of one distinct prompt each, one decoder per policy;
    the row's tokens, steps and decode time are the sums over the groups, and each group's
    tokens are those of a decoder run on that group alone."""
    argv = ["--out", str(tmp_path), "--random-model", "--quick", "--no-graphs", "--batches",
            "1,4", "--new-tokens", "4", "--prompt-len", "8", "--min-requests", "4",
            "--policies", "Cast"]  # fmt: skip
    assert bench.main(argv) == 0
    doc = json.loads((tmp_path / "e2e.json").read_text())
    rows = {(r["policy"], r["B"]): r for r in doc["rows"]}
    assert set(rows) == {(p, B) for p in ("autoregressive", "Cast") for B in (1, 4)}
    for pol in ("autoregressive", "Cast"):
        r1, r4 = rows[(pol, 1)], rows[(pol, 4)]
        assert (r1["groups"], r1["requests"]) == (4, 4)
        assert (r4["groups"], r4["requests"]) == (1, 4)
        assert r1["tokens"] == 4 * 4 and r1["valid"] and r1["undersized"] == 0
        # the same four prompts, one group of four or four groups of one: same tokens
        assert r1["tokens"] == r4["tokens"]
    assert rows[("Cast", 1)]["divergence"]["requests"] == 4

    # the aggregation itself: four groups of one against their merged result
    target, draft = pair
    prompts = bench.random_prompts(target.cfg.vocab_size, 6, 8)
    groups = bench.groups_of(prompts, 1, 4)
    assert groups == [[p] for p in prompts[:4]]
    assert bench.groups_of(prompts, 4, 8) == [prompts[:4], prompts[4:] + prompts[:2]]
    dec = Decoder(target, draft, make_policy("Cast", depth=3, topk=3, budget=12))
    per = [dec.generate(g, 5) for g in groups]
    m = bench.merge_results(per)
    assert m.tokens == [t for r in per for t in r.tokens]
    assert sum(len(t) for t in m.tokens) == sum(r.stats()["tokens"] for r in per)
    assert m.steps == sum(r.steps for r in per) and m.emitted == [e for r in per for e in r.emitted]
    assert m.time_decode == pytest.approx(sum(r.time_decode for r in per))
    acc = sum(sum(sum(e) for e in r.emitted) for r in per) / sum(
        sum(1 for e in r.emitted for x in e if x > 0) for r in per
    )
    assert m.mean_accepted == pytest.approx(acc)
    row = bench.row_of("Cast", 1, m, m, 1.0, None, groups=len(groups))
    assert (row["groups"], row["requests"]) == (4, 4)
    assert row["tokens"] == sum(sum(len(t) for t in r.tokens) for r in per)


def test_bench_e2e_budget_stops_adding_rows(tmp_path):
    argv = ["--out", str(tmp_path), "--random-model", "--quick", "--no-graphs",
            "--batches", "1,2,4", "--new-tokens", "3", "--prompt-len", "6", "--budget-s", "0",
            "--policies", "chain", "--first-batch-s", "0"]  # fmt: skip
    assert bench.main(argv) == 0
    doc = json.loads((tmp_path / "e2e.json").read_text())
    assert doc["stopped"] and {r["B"] for r in doc["rows"]} == {1}
    # the first batch size too is skipped when its estimate does not fit
    assert bench.main(argv[:-1] + ["60"]) == 0
    doc = json.loads((tmp_path / "e2e.json").read_text())
    assert doc["stopped"] and doc["rows"] == []


def test_bench_e2e_deadline_ends_rounds(pair):
    """Within a batch size a passed deadline starts no round after the first: the rows keep
    the round they have (``repeats`` 1 of 3), where the caller's limit would lose them all."""
    import copy
    import time

    target, draft = pair
    args = bench.parser().parse_args(["--out", "unused", "--repeats", "3", "--new-tokens", "4",
                                      "--no-profile"])  # fmt: skip
    groups = bench.groups_of(bench.random_prompts(target.cfg.vocab_size, 4, 8), 2, 4)
    prompts = [p for g in groups for p in g]
    ref32 = copy.deepcopy(target).float().eval()
    args.continuous = True
    for deadline, repeats in ((None, 3), (time.time() - 1.0, 1)):
        rows = bench.run_batch(["autoregressive", "chain"], 2, groups, prompts, target, draft,
                               ref32, args, None, False, None, None, {}, deadline)  # fmt: skip
        assert [(r["policy"], r["repeats"]) for r in rows] == [
            ("autoregressive", repeats),
            ("chain", repeats),
        ]
        # continuous batching: the full-batch window ends before the list drains
        ar, chain = rows
        assert ar["steady_speedup"] == 1.0 and 0 < chain["steady_step_share"] <= 1.0
        assert chain["steady_tokens_per_s"] > 0 and len(chain["steady_speedup_repeats"]) == repeats


def test_bench_e2e_step_graphs_rows(tmp_path):
    """``--step-graphs`` (on the CPU: the whole-step body eagerly) marks the fixed-shape rows
    ``step_graphs: true`` (λ-CAST always runs whole steps); tokens stay exact (fp32); two
    interleaved repeats give each row its per-repeat speedups, λ-CAST's row its λ̂ and mean
    plan."""
    argv = ["--out", str(tmp_path), "--random-model", "--quick", "--no-graphs", "--batches", "2",
            "--new-tokens", "4", "--prompt-len", "8", "--min-requests", "2", "--step-graphs",
            "--policies", "chain,EagleStatic,Cast", "--repeats", "2", "--cast-depth", "4",
            "--cast-budget", "16"]  # fmt: skip
    assert bench.main(argv) == 0
    doc = json.loads((tmp_path / "e2e.json").read_text())
    assert doc["step_graphs"] is True
    rows = {r["policy"]: r for r in doc["rows"]}
    assert set(rows) == {"autoregressive", "chain", "EagleStatic", "Cast"}
    for pol, r in rows.items():
        assert "error" not in r, r
        assert r["step_graphs"] is True
        assert r["repeats"] == 2 and len(r["speedup_repeats"]) == 2
        if pol != "autoregressive":
            assert r["divergence"]["mismatch"] == 0
            assert "step_s" in r["split"]
    cast = rows["Cast"]
    assert cast["lambda_hat"] > 0 and 1 <= cast["mean_depth"] <= 4
    assert 1 <= cast["mean_width"] <= 3 and cast["mean_verified_nodes"] <= 16
    assert isinstance(cast["planner_probes"], list)  # CastPlanner.describe's probe log


def test_bench_e2e_continuous_rows(tmp_path):
    """``--continuous``: a row's requests in one generate of max_batch = B (refilled rows): one
    step covers B rows, tokens stay exact (fp32) and the refills' time is recorded and left out
    of tokens/s. One group's worth of requests asked for, CONTINUOUS_MIN_GROUPS groups run (else
    no row would be refilled)."""
    argv = ["--out", str(tmp_path), "--random-model", "--quick", "--no-graphs", "--batches", "2",
            "--new-tokens", "6", "--prompt-len", "8", "--min-requests", "2", "--step-graphs",
            "--policies", "chain,Cast", "--repeats", "1", "--cast-depth", "4",
            "--cast-budget", "16", "--continuous"]  # fmt: skip
    assert bench.main(argv) == 0
    doc = json.loads((tmp_path / "e2e.json").read_text())
    assert doc["settings"]["continuous"] is True
    for r in doc["rows"]:
        assert "error" not in r, r
        n = 2 * bench.CONTINUOUS_MIN_GROUPS
        assert r["requests"] == n and r["tokens"] == n * 6 and r["refill_s"] > 0
        host = r["host_us_per_step"]  # its parts are host times within the busy time
        assert host["refill"] > 0 and (host["planner"] > 0) == (r["policy"] == "Cast")
        assert host["launch"] + host["absorb"] + host["planner"] + host["refill"] <= host["busy"]
        if r["policy"] != "autoregressive":
            assert r["divergence"]["mismatch"] == 0


def test_bench_e2e_graft_ablation_rows(tmp_path):
    """Graft's ablation with thresholds: Cast, CastPrune (pruned at the checkpoints, nothing
    grafted: a root-only template), CastGraft (grafting below the best leaf) and CastRoot (from
    the root's successors) each get a lossless row; CastPrune's grafted count is 0."""
    argv = ["--out", str(tmp_path), "--random-model", "--quick", "--no-graphs", "--batches", "2",
            "--new-tokens", "4", "--prompt-len", "8", "--min-requests", "2",
            "--policies", "Cast,CastPrune,CastGraft,CastRoot", "--C1", "0.3", "--cast-depth",
            "4", "--cast-budget", "16"]  # fmt: skip
    assert bench.main(argv) == 0
    rows = {r["policy"]: r for r in json.loads((tmp_path / "e2e.json").read_text())["rows"]}
    assert set(rows) == {"autoregressive", "Cast", "CastPrune", "CastGraft", "CastRoot"}
    for r in rows.values():
        assert "error" not in r, r
        assert r["policy"] == "autoregressive" or r["divergence"]["mismatch"] == 0
    assert rows["CastPrune"]["grafted_per_step"] == 0 and "grafted_per_step" not in rows["Cast"]
    # thresholds fitted on the pair before the runs (calibrate_checkpoints), one per checkpoint
    ck = rows["CastGraft"]["checkpoints"]
    assert len(ck["thresholds"]) == len(ck["steps"]) == len(ck["keeps"]) >= 1
    assert all(0.0 <= t <= 1.0 + 1e-6 for t in ck["thresholds"])


def test_warm_up_planner_runs_until_the_neighbouring_chains_are_measured(pair):
    """λ-CAST's warm-up (the GPU path of run_batch) decodes groups until its planner has the
    steps asked for, a measured chain, no unprobed neighbouring chain and a group that kept its
    plan; with no time left it decodes none."""
    import time

    target, draft = pair
    args = bench.parser().parse_args(["--out", "unused", "--new-tokens", "16", "--cast-depth",
                                      "4", "--cast-budget", "16", "--planner-warmup-steps",
                                      "40"])  # fmt: skip
    table = bench.synthetic_cost_table(64)
    groups = bench.groups_of(bench.random_prompts(target.cfg.vocab_size, 4, 8), 2, 8)
    dec = bench.make_decoder("Cast", target, draft, args, table, False)
    assert bench.warm_up_planner(dec, 2, groups, args, time.time() - 1.0) == 0
    n = bench.warm_up_planner(dec, 2, groups, args, time.time() + 120.0)
    pl = dec.planner
    d = pl.describe(2)
    assert n >= 1 and d["steps"] >= 40 and not pl.unprobed(2)
    assert any(row[7] == 1 for row in d["plans_measured"])


def test_continuous_warm_up_decodes_as_the_timed_runs(pair, monkeypatch):
    """With ``--continuous`` the warm-up decodes WARMUP_CONTINUOUS_GROUPS groups per generate,
    continuously batched at B (rows refilled), as the timed runs do."""
    import time

    target, draft = pair
    args = bench.parser().parse_args(["--out", "unused", "--new-tokens", "16", "--cast-depth",
                                      "4", "--cast-budget", "16", "--planner-warmup-steps",
                                      "40", "--continuous"])  # fmt: skip
    table = bench.synthetic_cost_table(64)
    groups = bench.groups_of(bench.random_prompts(target.cfg.vocab_size, 4, 8), 2, 8)
    dec = bench.make_decoder("Cast", target, draft, args, table, False)
    calls = []
    real = dec.generate

    def spy(prompts, *a, **kw):
        calls.append((len(prompts), kw.get("max_batch")))
        return real(prompts, *a, **kw)

    monkeypatch.setattr(dec, "generate", spy)
    n = bench.warm_up_planner(dec, 2, groups, args, time.time() + 120.0)
    want = bench.WARMUP_CONTINUOUS_GROUPS
    assert n >= want and n % want == 0
    assert calls and all(c == (2 * want, 2) for c in calls)
