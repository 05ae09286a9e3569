"""λ-CAST in the example decoder (tiny random models, CPU float32; the GPU-marked tests on the
H200): the planner's plan per step (and Graft over it, and chains among its plans) keeps greedy
output equal to autoregressive decoding, under whole-step bodies, launch-ahead and CUDA graphs.
The pair, prompts and baseline are ``test_decoder``'s."""

from __future__ import annotations

import random
import time

import pytest
import torch
from test_decoder import (  # noqa: F401  (pair, gpu_pair, _one_thread: fixtures)
    NEW,
    PROMPTS,
    _decoder,
    _greedy_baseline,
    _lambda_decoder,
    _one_thread,
    _steep_costs,
    gpu_pair,
    pair,
)

from treeops import Plan, RankTemplate
from treeops.cast_plan import CastPlanner
from treeops.decoder import Decoder, SamplingParams, make_policy
from treeops.decoder.graphs import planner_tokens


def test_lambda_cast_graft_greedy_equals_autoregressive(pair):  # noqa: F811
    """CastGraft over λ-CAST (the whole-step body): the plan's n - g best draft nodes plus g
    retrieved from the successor table are verified; greedy output equals autoregressive
    decoding with stop ids and ragged budgets, grafted nodes are added (and counted for the
    planner), and each plan's graft count is at most half its verify count."""
    target, _ = pair
    dec = _lambda_decoder(pair, graft=True, static_shapes=True)
    assert dec.planner.graft_sizes == [0, 2, 4, 8]
    stop = _greedy_baseline(target, PROMPTS[1], NEW)[3]
    budgets = [NEW, 8, 5]
    res = dec.generate(PROMPTS, budgets, stop_ids=[stop])
    want = [_greedy_baseline(target, p, m, stop=(stop,)) for p, m in zip(PROMPTS, budgets)]
    assert res.tokens == want
    assert sum(res.grafted) > 0 and res.host_waits == res.steps
    for added, plan in zip(res.grafted, res.plans):  # at most g new nodes per request
        assert added <= len(PROMPTS) * plan[4]
    plans = dec.planner._state(3).measured or dec.planner._state(3).residuals
    assert any(p.graft > 0 for p in plans)
    assert all(p.graft <= p.verify // 2 for p in plans)
    assert dec.planner._state(3).grafted > 0  # the step's statistics reached the planner
    with pytest.raises(ValueError, match="step_graphs"):
        _lambda_decoder(pair, graft=True, step_graphs=False)


def _random_plans(monkeypatch, rng: random.Random) -> None:
    """Every step's plan drawn at random: any width, depth, verify bucket and graft count, or
    (three times in ten) a chain."""

    def any_plan(self, B):
        if rng.random() < 0.3:  # a chain (top-1, no graft) between the trees
            return Plan.chain(rng.randint(1, self.D))
        v = rng.choice(self.verify_sizes)
        g = rng.choice([g for g in self.graft_sizes if g <= v // 2])
        return Plan(rng.choice(self.widths), rng.randint(1, self.D), v, g)

    monkeypatch.setattr(CastPlanner, "plan", any_plan)


def _random_requests(rng: random.Random, n: int = 3):
    prompts = [[rng.randrange(128) for _ in range(rng.randint(2, 12))] for _ in range(n)]
    return prompts, [rng.randint(3, 40) for _ in range(n)]


@pytest.mark.parametrize("anchor", ["root", "leaf"])
@pytest.mark.parametrize("seed", range(12))
def test_lambda_cast_graft_any_plan_sequence_is_lossless(pair, monkeypatch, seed, anchor):  # noqa: F811
    """CastGraft over λ-CAST, a random plan every step (any width, depth, verify bucket, graft
    count, or a chain): grafted nodes hang at the template's depth below a shallow draft (root
    anchor) or as a chain below the draft's best leaf (leaf anchor), so the catch-up must cover
    paths past depth + 1; greedy output equals autoregressive decoding."""
    target, _ = pair
    rng = random.Random(seed)
    _random_plans(monkeypatch, rng)
    dec = _lambda_decoder(pair, graft=True, anchor=anchor, static_shapes=True)
    prompts, budgets = _random_requests(rng)
    res = dec.generate(prompts, budgets)
    assert res.tokens == [_greedy_baseline(target, p, m) for p, m in zip(prompts, budgets)]
    assert len({(*p[:3], *p[4:6]) for p in res.plans}) > 5 and sum(res.grafted) > 0
    # the catch-up each step ran (recorded) covers every path it accepted
    assert all(rc >= max(em) for rc, em in zip(res.catchup_buckets, res.emitted, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("anchor", ["root", "leaf"])
@pytest.mark.parametrize("seed", [7])
def test_lambda_cast_graft_any_plan_sequence_on_gpu(gpu_pair, monkeypatch, seed, anchor):  # noqa: F811
    """The same on the GPU with one CUDA graph per plan (chains among them: top-1 expands and
    the step statistics over one candidate per layer), launched ahead: greedy equals the tiny
    fp32 pair's autoregressive output."""
    torch.backends.cuda.matmul.allow_tf32 = False
    target, _ = gpu_pair
    rng = random.Random(seed)
    _random_plans(monkeypatch, rng)
    dec = _lambda_decoder(gpu_pair, graft=True, anchor=anchor, static_shapes=True,
                          cuda_graphs=True)  # fmt: skip
    prompts, budgets = _random_requests(rng, 4)
    ar = Decoder(target, None, "autoregressive").generate(prompts, budgets)
    res = dec.generate(prompts, budgets)
    assert res.tokens == ar.tokens and res.graphs_captured > 5
    assert any(p[5] == 1 for p in res.plans) and any(p[5] == 0 for p in res.plans)


def _fixed_graft_plan(monkeypatch) -> None:
    """Every step runs one plan that grafts (the widest, deepest tree at the largest verify
    count, half of it grafted): steps depend on the table alone, not on the planner's state."""

    def fixed(self, B):
        v = max(self.verify_sizes)
        return Plan(max(self.widths), self.D, v, max(g for g in self.graft_sizes if g <= v // 2))

    monkeypatch.setattr(CastPlanner, "plan", fixed)


def _graft_trace(res) -> tuple:
    return res.tokens, res.emitted, res.verified, res.grafted


def test_graft_table_lives_with_the_decoder(pair, monkeypatch):  # noqa: F811
    """The successor table is the decoder's (a captured step graph holds its address) and each
    batch starts from it emptied in place: a batch after a junk-filled table decodes exactly as
    a fresh decoder does."""
    _fixed_graft_plan(monkeypatch)
    dec = _lambda_decoder(pair, graft=True, static_shapes=True)
    want = _graft_trace(dec.generate(PROMPTS, NEW))
    table, ptr = dec.table, dec.table.table.data_ptr()
    assert sum(want[3]) > 0
    table.table.fill_(5)  # junk successors: a table carried over would graft them
    got = _graft_trace(dec.generate(PROMPTS, NEW))
    assert dec.table is table and table.table.data_ptr() == ptr
    assert got == want


def test_graft_plans_fill_the_likeliest_template_nodes(pair, monkeypatch):  # noqa: F811
    """A plan grafting g nodes retrieves through the g + 1 most probable nodes of the policy's
    template (the default's rank-0 chain first), not the first g of its breadth-first fill."""
    import treeops.decoder.engine as engine_mod

    sizes = []
    real = engine_mod.graft

    def spy(tree, table, template, *args, **kwargs):
        sizes.append(template.size)
        return real(tree, table, template, *args, **kwargs)

    monkeypatch.setattr(engine_mod, "graft", spy)
    _fixed_graft_plan(monkeypatch)
    dec = _lambda_decoder(pair, graft=True, static_shapes=True)
    dec.generate(PROMPTS, NEW)
    g = dec.planner.plan(3).graft
    assert g > 0 and sizes and set(sizes) == {g + 1}
    t = dec.graft_template(g)
    assert t is dec.graft_template(g)  # one object per g (the step graphs hold its copy)
    assert t.ranks.tolist() == dec.graft.template.most_probable(g + 1).ranks.tolist()


@pytest.mark.parametrize("anchor", ["leaf", "root"])
def test_root_only_template_grafts_nothing_under_graft_plans(pair, monkeypatch, anchor):  # noqa: F811
    """Prune-only Graft over λ-CAST (a root-only template): every step runs a plan with graft
    slots (as whole-step bodies), the slots stay empty at either anchor, and the output is
    still exact."""
    _fixed_graft_plan(monkeypatch)
    target, draft = pair
    pol = make_policy("CastGraft", depth=3, topk=3, budget=12, cast_depth=5, cast_budget=16,
                      cost_table=_steep_costs(), lambda_graft=True, anchor=anchor,
                      template=RankTemplate([-1], [-1]))  # fmt: skip
    dec = Decoder(target, draft, pol, static_shapes=True, step_graphs=True)
    res = dec.generate(PROMPTS, NEW)
    assert res.tokens == [_greedy_baseline(target, p, NEW) for p in PROMPTS]
    assert all(p[4] > 0 for p in res.plans)  # every step's plan had graft slots
    assert sum(res.grafted) == 0


@pytest.mark.gpu
def test_graft_table_under_step_graphs_on_gpu(gpu_pair, monkeypatch):  # noqa: F811
    """With whole-step CUDA graphs (captured in the first batch, replayed in the later ones) a
    batch decodes exactly as the same batch did first, after another batch in between: the
    graphs read and update the table the prefill warmed."""
    torch.backends.cuda.matmul.allow_tf32 = False
    _fixed_graft_plan(monkeypatch)
    dec = _lambda_decoder(gpu_pair, graft=True, static_shapes=True, cuda_graphs=True)
    rng = random.Random(3)
    first, budgets = _random_requests(rng, 4)
    other, _ = _random_requests(rng, 4)
    want = _graft_trace(dec.generate(first, budgets))
    dec.generate(other, budgets)
    again = dec.generate(first, budgets)
    assert _graft_trace(again) == want and again.graphs_captured == 0 and sum(want[3]) > 0


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("static", [False, True], ids=["eager", "step-body"])
def test_lambda_cast_greedy_equals_autoregressive(pair, batch, static):  # noqa: F811
    """λ-CAST (Cast without thresholds): each step runs the planner's plan (eagerly, or as the
    whole-step body), greedy output equals autoregressive decoding with stop ids and ragged
    budgets, every step records its plan and λ̂, and the planner's state persists across calls."""
    target, draft = pair
    pol = make_policy("Cast", depth=3, topk=3, budget=12, cast_depth=5, cast_budget=16,
                      cost_table=_steep_costs())  # fmt: skip
    dec = Decoder(target, draft, pol, static_shapes=static, step_graphs=static)
    stop = _greedy_baseline(target, PROMPTS[1], NEW)[3]
    budgets = [NEW, 8, 5][:batch]
    res = dec.generate(PROMPTS[:batch], budgets, stop_ids=[stop])
    want = [_greedy_baseline(target, p, m, stop=(stop,)) for p, m in zip(PROMPTS, budgets)]
    assert res.tokens == want
    assert len(res.plans) == res.steps and res.mean_accepted > 1.0 and res.time_plan > 0
    for (w, d, n, lam, g, k, *_), row in zip(res.plans, res.verified):
        assert 1 <= w <= 3 and 1 <= d <= 5 and 1 <= n <= 16 and lam > 0 and g == 0
        assert k == 0 or (k == 1 and (w, n) == (1, d + 1))  # a tree, or a probed chain
        assert max(row) <= n
    if static:
        assert res.host_waits == res.steps  # one wait per step
        assert res.verify_buckets == [int(p[2]) for p in res.plans]
    steps = dec.planner.describe(batch)["steps"]
    again = dec.generate(PROMPTS[:batch], budgets, stop_ids=[stop])
    assert again.tokens == want and dec.planner.describe(batch)["steps"] > steps


@pytest.mark.gpu
def test_a_capture_is_no_step_time_on_gpu(gpu_pair, monkeypatch):  # noqa: F811
    """Random plans, graphs launched ahead, each capture made slower by 0.2 s on the host (the
    device idles meanwhile, as it does while a real capture compiles): no step the planner
    learns from is timed with a capture in it, so every measured step is far under 0.2 s."""
    from treeops.decoder.graphs import GraphRunner

    _random_plans(monkeypatch, random.Random(3))
    replay_step = GraphRunner.replay_step

    def slow_capture(self, sb, key, make_body, res):
        if key not in sb.graphs:
            time.sleep(0.2)
        return replay_step(self, sb, key, make_body, res)

    monkeypatch.setattr(GraphRunner, "replay_step", slow_capture)
    timed = []
    observe = CastPlanner.observe

    def spy(self, B, stats, plan, tokens, step_s, ctx):
        timed.append(step_s)
        return observe(self, B, stats, plan, tokens, step_s, ctx)

    monkeypatch.setattr(CastPlanner, "observe", spy)
    dec = _lambda_decoder(gpu_pair, graft=True, static_shapes=True, cuda_graphs=True)
    prompts, budgets = _random_requests(random.Random(3), 4)
    res = dec.generate(prompts, budgets)
    assert res.graphs_captured > 5 and len(timed) > res.graphs_captured
    assert max(timed) < 0.1, sorted(timed)[-5:]


def test_planner_tokens_count_steps_no_budget_cut():
    """A plan is measured by the steps no budget cut short: the mean accept length over the
    requests with more than the step's most emitted tokens left (0 when none had)."""
    rows = [[5, 0], [2, 0], [0, 0], [7, 0]]
    assert planner_tokens(rows, [20, 3, 0, 9], emit=8) == 6.0
    assert planner_tokens(rows, [8, 8, 8, 8], emit=8) == 0.0
    assert planner_tokens(rows, None, emit=8) == pytest.approx(14 / 3)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "step-body"])
def test_planner_measures_no_step_a_budget_cut(pair, static):  # noqa: F811
    """Budgets shorter than any plan's steps: the steps run, the calibration learns, but no
    plan gets a measured η (each step's tokens were its budget's, not its plan's)."""
    pol = make_policy("Cast", depth=3, topk=3, budget=12, cast_depth=5, cast_budget=16,
                      cost_table=_steep_costs())  # fmt: skip
    dec = Decoder(pair[0], pair[1], pol, static_shapes=static, step_graphs=static)
    dec.generate(PROMPTS, [2, 2, 1])
    st = dec.planner._state(3)
    assert st.steps > 0 and not st.measured
    dec.generate(PROMPTS, [40, 40, 40])
    assert st.measured


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 4])
def test_lambda_cast_step_graphs_on_gpu(gpu_pair, batch):  # noqa: F811
    """λ-CAST with CUDA graphs (one whole-step graph per plan): greedy equals the tiny fp32
    pair's autoregressive output, one host wait per step, sampling runs."""
    torch.backends.cuda.matmul.allow_tf32 = False
    target, draft = gpu_pair
    prompts = (PROMPTS * 2)[:batch]
    pol = make_policy("Cast", depth=3, topk=3, budget=12, cast_depth=5, cast_budget=16,
                      cost_table=_steep_costs())  # fmt: skip
    ar = Decoder(target, None, "autoregressive").generate(prompts, NEW)
    dec = Decoder(target, draft, pol, cuda_graphs=True, step_graphs=True)
    res = dec.generate(prompts, NEW)
    assert res.tokens == ar.tokens and res.host_waits == res.steps
    assert res.graphs_captured >= 1 and len(res.plans) == res.steps
    g = torch.Generator().manual_seed(1)
    out = dec.generate(prompts, 6, sampling=SamplingParams(temperature=1.0), generator=g)
    assert all(len(t) == 6 for t in out.tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["chain", "lambda-Cast", "lambda-CastGraft"])
def test_launch_ahead_equals_one_step_at_a_time_on_gpu(pair, gpu_pair, policy):  # noqa: F811
    """With CUDA graphs, steps launched ahead of their collection (two pinned result slots,
    uploads staged from fresh pinned memory) give the same greedy tokens as one step at a time,
    with stop ids and ragged budgets, and the same sampled tokens from the same generator (the
    uniforms are drawn in step order either way)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = PROMPTS * 2
    budgets = [NEW, 8, 5, 3, NEW, 1]
    stop = _greedy_baseline(pair[0], PROMPTS[1], NEW)[3]
    outs = []
    for ahead in (True, False):
        if policy.startswith("lambda-"):
            dec = _lambda_decoder(gpu_pair, graft=policy.endswith("Graft"), cuda_graphs=True,
                                  launch_ahead=ahead)  # fmt: skip
        else:
            dec = _decoder(gpu_pair, policy, cuda_graphs=True, step_graphs=True,
                           launch_ahead=ahead)  # fmt: skip
        greedy = dec.generate(prompts, budgets, stop_ids=[stop])
        assert greedy.host_waits == greedy.steps
        g = torch.Generator().manual_seed(5)
        sampled = dec.generate(prompts, 6, sampling=SamplingParams(temperature=0.9), generator=g)
        outs.append((greedy.tokens, sampled.tokens))
    assert outs[0][0] == outs[1][0]
    if policy == "chain":  # (λ-CAST's plans follow statistics one step older when ahead)
        assert outs[0][1] == outs[1][1]


def _chain_decoders(pair, depth: int = 4) -> dict:  # noqa: F811
    """The chain policy's decoder and λ-CAST's confined to ``Plan.chain(depth)``, both with
    whole-step bodies: the same tree drafted two ways."""
    lam = _lambda_decoder(pair, static_shapes=True)
    lam.planner.restrict(len(PROMPTS), [Plan.chain(depth)])
    chain = Decoder(pair[0], pair[1], make_policy("chain", depth=depth), static_shapes=True,
                    step_graphs=True)  # fmt: skip
    return {"chain": chain, "lambda": lam}


def test_a_plans_draft_attends_over_its_own_tree(pair, monkeypatch):  # noqa: F811
    """λ-CAST confined to a chain drafts with the chain policy's attention shapes: each plan has
    its own working tree (a depth-4 chain: 4 query rows per draft forward), not the widest
    tree's, and the same tokens come out."""
    import treeops.decoder.model as model

    shapes: list = []
    attend = model.tree_attention

    def spy(q, *args, **kw):
        if len(args) > 5 and args[5] is not None:  # a draft forward (frontier rows)
            shapes.append(tuple(q.shape))
        return attend(q, *args, **kw)

    monkeypatch.setattr(model, "tree_attention", spy)
    seen = {}
    for name, dec in _chain_decoders(pair).items():
        shapes.clear()
        res = dec.generate(PROMPTS, NEW)
        seen[name] = (set(shapes), res.tokens)
    assert seen["lambda"] == seen["chain"]
    assert {s[1] for s in seen["chain"][0]} == {4}


def test_a_chain_plans_step_copies_as_the_chain_policys(pair):  # noqa: F811
    """λ-CAST confined to a chain copies what the chain policy's step copies, each copy as
    contiguous (a memcpy on the GPU, not a strided elementwise kernel): its frontier and
    catch-up buffers are views at the plan's row counts, not column slices of buffers sized
    for the widest tree (on the H200 those slices cost 20 strided copies per step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.kinds: dict = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten.copy_:
                dst, src = args[0], args[1]
                k = (dst.is_contiguous(), src.is_contiguous(), tuple(dst.shape[1:]))
                self.kinds[k] = self.kinds.get(k, 0) + 1
            return func(*args, **(kwargs or {}))

    seen = {}
    for name, dec in _chain_decoders(pair).items():
        dec.generate(PROMPTS, 4)  # buffers allocated
        mode = Copies()
        with mode:
            res = dec.generate(PROMPTS, NEW)
        seen[name] = ({k: v / res.steps for k, v in mode.kinds.items()}, res.tokens)
    chain, lam = seen["chain"][0], seen["lambda"][0]
    assert seen["lambda"][1] == seen["chain"][1]
    strided = {k: v for k, v in lam.items() if not (k[0] and k[1])}
    assert strided == {k: v for k, v in chain.items() if not (k[0] and k[1])}, (lam, chain)
    # the frontier's logits [B, 1, V] and features [B, 1, H]: one contiguous copy per layer
    V, H = pair[0].cfg.vocab_size, pair[0].cfg.hidden_size
    assert lam.get((True, True, (1, V)), 0) == chain.get((True, True, (1, V)), 0) > 0
    assert lam.get((True, True, (1, H)), 0) == chain.get((True, True, (1, H)), 0) > 0


def test_lambda_cast_plan_at_the_policys_maxima(pair):  # noqa: F811
    """A plan of the λ-CAST policy's own maxima (W, D, N) drafts that plan's fixed-shape tree:
    its buffers are not confused with the policy's own (same shape, no thresholds)."""
    target, draft = pair
    pol = make_policy("Cast", depth=3, topk=3, budget=12, cast_depth=5, cast_budget=16,
                      cost_table=_steep_costs())  # fmt: skip
    dec = Decoder(target, draft, pol, static_shapes=True, step_graphs=True,
                  planner_options={"interval": 10_000})  # fmt: skip
    top = Plan(width=pol.max_width, depth=pol.max_depth, verify=pol.capacity)
    dec.planner.initial = top
    res = dec.generate(PROMPTS[:2], NEW)
    assert res.tokens == [_greedy_baseline(target, p, NEW) for p in PROMPTS[:2]]
    assert {tuple(p[:3]) for p in res.plans} == {(top.width, top.depth, top.verify)}
