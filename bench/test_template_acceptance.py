"""bench/template_acceptance.py's core on the CPU in seconds: the decoder runs on the tiny random
pair (no training), the token-level coverage on a stream whose answers are known."""

from __future__ import annotations

from types import SimpleNamespace

import template_acceptance as ta
import torch

from treeops import RankTemplate


def test_acceptance_rows_are_greedy_and_account_grafts(pair):
    target, draft = pair
    p = SimpleNamespace(target=target, draft=draft)
    prompts = [[5, 17, 3, 99, 42, 7, 8], [11, 64, 9], [23, 1, 2, 3], [40, 41]]
    tpls = {"default": RankTemplate.default(), "chain 9": RankTemplate.chain(9)}
    setting = {"small": dict(depth=4, topk=4, budget=24)}
    res = ta.measure_acceptance(p, prompts, tpls, setting, batch=2, new_tokens=10)
    rows = res["settings"]["small"]["rows"]
    assert list(rows) == ["Cast (no graft)", "default", "chain 9"]
    for name, r in rows.items():
        assert r["same_as_greedy"], (name, r["differs_from_greedy"])
        assert len(r["per_prompt_accepted_per_step"]) == len(prompts)
        assert 1.0 <= r["accepted_per_step"] <= 5.0
        assert 0 <= r["grafted_accepted_per_step"] <= r["grafted_per_step"]
    cast = rows["Cast (no graft)"]
    assert cast["grafted_per_step"] == 0 and cast["pruned_fraction"] == 0
    assert rows["default"]["vs_default"]["mean_diff"] == 0
    assert rows["default"]["pruned_fraction"] > 0


def test_token_coverage_on_a_cycle():
    # every token has one successor: a template's rank-0 chain is accepted to its full depth
    stream = torch.arange(10).repeat(50)
    tpls = {
        "default": RankTemplate.default(),
        "chain 9": RankTemplate.chain(9),
        "balanced 8x2": RankTemplate.balanced(8, 2),
    }
    lens = ta.token_coverage(stream, stream, 10, tpls, positions=50)
    assert set(lens["default"]) == {9} and set(lens["chain 9"]) == {9}
    assert set(lens["balanced 8x2"]) == {2}
    s = ta.summarise_coverage(lens)
    assert s["balanced 8x2"]["diff_vs_default"] == -7 and s["balanced 8x2"]["diff_se"] == 0
    # at most 3 retrieved nodes: empty ranks (1..7 here) are skipped with their subtrees, so the
    # default's first three nodes left are its rank-0 chain
    short = ta.token_coverage(stream, stream, 10, tpls, positions=50, count=3)
    assert set(short["default"]) == {3} and set(short["chain 9"]) == {3}
    assert set(short["balanced 8x2"]) == {2}
