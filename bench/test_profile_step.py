"""bench/profile_step.py's chain comparison on the CPU (tiny random pair, no graphs): the chain
policy, λ-CAST and CastGraft confined to the same chain all run it, and decode alike."""

from __future__ import annotations

import bench_e2e
import profile_step
import torch

from treeops.decoder.policies import synthetic_cost_table


def test_chain_steps_run_one_chain_three_ways():
    target, draft, _ = bench_e2e.random_pair(torch.device("cpu"), small=True)
    prompts = bench_e2e.random_prompts(target.cfg.vocab_size, 2, 8)
    rows = profile_step.chain_steps(target, draft, synthetic_cost_table(128), 2, 3, prompts, 12,
                                    graphs=False)  # fmt: skip
    assert [r["decoder"] for r in rows] == list(profile_step.CHAIN_DECODERS)
    for r in rows:
        assert r["steps"] > 0 and r["step_us"] > 0
        if r["decoder"] != "chain":  # every step of the λ decoders ran the chain (top-1)
            assert r["plans"] == [(1, 3, 4, 1)], r["plans"]
    assert rows[0]["tokens"] == rows[1]["tokens"] == rows[2]["tokens"]
