"""Tensor-parallel decoding (treeops.decoder.tp) on the CPU: 2 gloo ranks, tiny random fp32 models.

One spawn of two processes runs every case (seconds in all): for each policy and path, greedy
output at TP = 2 (target sharded, draft replicated, ``check_lockstep=True``) equals the
single-process decoder's token for token, and both ranks report the same tokens and λ-CAST
plans; a logits perturbation injected on one rank at one step is caught by the lockstep check
at that step; a cost table of another TP degree is refused. The workers write their results to
files; the tests below assert on them. A hung collective cannot stall the suite: the spawn has a
deadline, after which its processes are killed and the tests fail.
"""

from __future__ import annotations

import copy
import json
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from treeops import CostTable, PruneCheckpoints
from treeops.decoder import Decoder, Draft, ModelConfig, Target, make_policy
from treeops.decoder.tp import check_cost_table, shard_target, with_tp_degree

pytestmark = pytest.mark.dist

WORLD = 2
DEADLINE_S = 120.0
PROMPTS = [[5, 17, 3, 99, 42, 7, 8], [11, 64], [23, 1, 2, 3]]
NEW = 10
STOP = 9  # also a stop id, so stop handling runs under TP

# name -> (policy name, make_policy extras, Decoder keywords)
CASES = {
    "autoregressive": ("autoregressive", {}, {}),
    "chain": ("chain", {}, {}),
    "EagleStatic": ("EagleStatic", {}, {}),
    "EagleStatic-step": ("EagleStatic", {}, {"static_shapes": True, "step_graphs": True}),
    "Cast": ("Cast", {"C1": 0.1, "C2": 0.05, "C3": 0.05}, {}),
    "CastGraft": ("CastGraft", {"C1": 0.1, "C2": 0.05, "C3": 0.05}, {}),
    "lambda-Cast": ("Cast", {}, {"static_shapes": True, "step_graphs": True}),
    "lambda-CastGraft": (
        "CastGraft",
        {"lambda_graft": True},
        {"static_shapes": True, "step_graphs": True},
    ),
}


def _costs(tp: int) -> CostTable:
    def target(B: int, c: int, n: int) -> float:
        return 100.0 + 5.0 * B * n

    table = CostTable.from_functions(
        target, lambda B, c, n: target(B, c, n) / 4, [1, 2, 4, 8], L=64, M=2, n_max=64
    )
    return with_tp_degree(table, tp) if tp != 1 else table


def _policy(name: str, extra: dict, tp: int):
    return make_policy(
        name, depth=3, topk=3, budget=12, cast_depth=4, cast_budget=16, cost_table=_costs(tp),
        checkpoints=PruneCheckpoints(steps=(0, 1), keeps=(2, 4), thresholds=(0.99, 0.99)),
        **extra,
    )  # fmt: skip


def _pair() -> tuple[Target, Draft]:
    """The tests' friendly pair (tests/test_decoder.py): layers scaled down, a bigram draft, so
    acceptance walks several levels deep; KV heads and the MLP split evenly over 2 ranks."""
    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, tie_word_embeddings=False)  # fmt: skip
    t = Target(cfg, seed=0)
    with torch.no_grad():
        for layer in t.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
    return t, Draft(cfg, seed=1).bigram_init(t)


def _run(dec: Decoder) -> dict:
    res = dec.generate(PROMPTS, [NEW, 7, NEW], stop_ids=[STOP])
    return {"tokens": res.tokens, "plans": res.plans, "steps": res.steps}


def _cases(group) -> dict:
    out = {}
    target, draft = _pair()
    sharded = shard_target(copy.deepcopy(target), group)
    a = sharded.model.layers[0].self_attn
    out["shard"] = [sharded.make_cache(1, 16).k.shape[3], a.q_proj.weight.shape[0],
                    sharded.model.layers[0].mlp.gate_proj.weight.shape[0]]  # fmt: skip
    for case, (name, extra, kw) in CASES.items():
        single = _run(Decoder(target, draft, _policy(name, extra, 1), **kw))
        dec = Decoder(sharded, draft, _policy(name, extra, WORLD), tp_group=group,
                      check_lockstep=True, **kw)  # fmt: skip
        out[case] = {"single": single, "tp": _run(dec)}
    # continuous batching: three requests through two rows, a refill on every rank alike (rank
    # 1 passes another max_batch: rank 0's rules, as for every generate argument)
    name, extra, kw = CASES["lambda-Cast"]
    single = Decoder(target, draft, _policy(name, extra, 1), **kw).generate(
        PROMPTS, [NEW, 7, NEW], stop_ids=[STOP], max_batch=2
    )
    dec = Decoder(sharded, draft, _policy(name, extra, WORLD), tp_group=group,
                  check_lockstep=True, **kw)  # fmt: skip
    mb = 2 if dist.get_rank(group) == 0 else 3
    tp = dec.generate(PROMPTS, [NEW, 7, NEW], stop_ids=[STOP], max_batch=mb)
    out["continuous"] = {"single": single.tokens, "tp": tp.tokens, "rows": len(tp.emitted[0])}
    # a table measured at TP = 1 is refused at TP = 2
    try:
        Decoder(sharded, draft, _policy("Cast", {}, 1), tp_group=group,
                static_shapes=True, step_graphs=True)  # fmt: skip
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    # rank 1's logits perturbed at its third target forward (prefill, step 0, step 1)
    calls = [0]

    def perturb(module, args, output):
        calls[0] += 1
        logits, h = output
        return (logits.roll(1, -1), h) if calls[0] == 3 else output

    for case in ("EagleStatic", "lambda-Cast"):
        name, extra, kw = CASES[case]
        dec = Decoder(sharded, draft, _policy(name, extra, WORLD), tp_group=group,
                      check_lockstep=True, **kw)  # fmt: skip
        calls[0] = 0
        hook = sharded.register_forward_hook(perturb) if dist.get_rank(group) == 1 else None
        try:
            dec.generate(PROMPTS, NEW)
            out[f"inject-{case}"] = None
        except RuntimeError as e:
            out[f"inject-{case}"] = str(e)
        finally:
            if hook is not None:
                hook.remove()
    return out


def _worker(rank: int, init: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # tiny matmuls; two ranks share the runner's cores
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    try:
        with torch.no_grad():
            result = {"ok": _cases(dist.group.WORLD)}
    except Exception:
        result = {"error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    # Both ranks past their last collective, then out without running C++ destructors: tearing
    # down gloo's process groups at exit sometimes aborts a worker ("terminate called without an
    # active exception", SIGABRT) after its results are written, which failed the whole module.
    if "ok" in result:
        dist.barrier()
    os._exit(0)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    d = tmp_path_factory.mktemp("tp")
    ctx = mp.start_processes(
        _worker, args=(str(d / "init"), str(d)), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"TP workers still running after {DEADLINE_S} s (a hung collective?)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    out = []
    for r in range(WORLD):
        res = json.loads((d / f"rank{r}.json").read_text())
        assert "error" not in res, f"rank {r}:\n{res.get('error')}"
        out.append(res["ok"])
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_tp_greedy_equals_single_process(ranks, case):
    single = ranks[0][case]["single"]
    assert sum(map(len, single["tokens"])) > len(PROMPTS)
    for r in range(WORLD):
        assert ranks[r][case]["tp"]["tokens"] == single["tokens"]
    # lockstep: the same steps and (λ-CAST) the same plans on every rank
    assert ranks[1][case]["tp"]["steps"] == ranks[0][case]["tp"]["steps"]
    assert ranks[1][case]["tp"]["plans"] == ranks[0][case]["tp"]["plans"]
    if case.startswith("lambda"):
        assert ranks[0][case]["tp"]["plans"]


def test_tp_shards_heads_and_mlp(ranks):
    """Each rank holds 1 of 2 KV heads (its cache too), 2 of 4 q heads, 64 of 128 MLP rows."""
    assert ranks[0]["shard"] == ranks[1]["shard"] == [1, 2 * 64, 64]


def test_tp_multi_token_steps(ranks):
    """The tree policies accept several tokens per step at TP = 2 (compaction of the sharded
    cache moved K/V)."""
    tp = ranks[0]["EagleStatic"]["tp"]
    assert tp["steps"] < ranks[0]["autoregressive"]["tp"]["steps"]


@pytest.mark.parametrize("case", ["EagleStatic", "lambda-Cast"])
def test_lockstep_detects_injected_disagreement(ranks, case):
    for r in range(WORLD):
        msg = ranks[r][f"inject-{case}"]
        assert msg is not None, f"rank {r} decoded to the end"
        assert "step 1" in msg and "rank(s) [1]" in msg and "bonus tokens" in msg


def test_tp_refuses_cost_table_of_another_degree(ranks):
    for r in range(WORLD):
        assert "policy.cost_table" in ranks[r]["refused"] and "TP degree 1" in ranks[r]["refused"]


def test_single_process_refuses_tp2_table():
    target, draft = _pair()
    with pytest.raises(ValueError, match="policy.cost_table"):
        Decoder(target, draft, _policy("Cast", {"C1": 0.1}, 2))
    check_cost_table(_costs(1), 1)  # absent meta["tp"] counts as 1


def test_tp_continuous_batching(ranks):
    """Three requests through two rows at TP = 2 (rank 1 asked for three rows: rank 0's
    arguments rule): each rank's tokens equal the single-process decoder's with refills."""
    for r in ranks:
        c = r["continuous"]
        assert c["tp"] == c["single"] and c["rows"] == 2
