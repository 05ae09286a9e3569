"""The example decoder (treeops.decoder) on tiny random models, CPU, float32.

Greedy: every policy's output equals plain autoregressive greedy decoding token for token, the
baseline being ``reference_forward`` (a full recompute with a causal mask and its own RoPE, no
cache, no treeops). Sampling: the first two emitted tokens' joint distribution equals the
target's, checked per cell against the exact distribution.

The target's layers are scaled down (``_friendly_target``) and the draft is the target's bigram
approximation (``Draft.bigram_init``), so drafts are often but not always right: acceptance walks
several levels deep, is cut, and compaction moves K/V, as with a trained pair.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from treeops import Cast, CostTable, EagleStatic, Plan, PruneCheckpoints, RankTemplate, Tree
from treeops.decoder import (
    POLICIES,
    Autoregressive,
    CastGraft,
    Chain,
    Decoder,
    Draft,
    ModelConfig,
    SamplingParams,
    Target,
    calibrate_checkpoints,
    make_policy,
)
from treeops.decoder.model import chain_tree, reference_forward
from treeops.testing import NoHostSync


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls: one intra-op thread. With two OpenMP threads on a 2-core runner whose other
    core is busy (another job), each tiny linear spin-waits for milliseconds (measured: ~600x
    slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


PROMPTS = [[5, 17, 3, 99, 42, 7, 8], [11, 64], [23, 1, 2, 3]]
NEW = 10


def _friendly_target(cfg: ModelConfig, scale: float, seed: int = 0) -> Target:
    t = Target(cfg, seed=seed)
    with torch.no_grad():
        for layer in t.model.layers:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
    return t


@pytest.fixture(scope="module")
def pair():
    cfg = ModelConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=False,
    )
    target = _friendly_target(cfg, 0.1)
    return target, Draft(cfg, seed=1).bigram_init(target)


@torch.no_grad()
def _greedy_baseline(target: Target, prompt: list[int], n: int, stop=()) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        nxt = int(reference_forward(target, torch.tensor(toks))[-1].argmax())
        toks.append(nxt)
        if nxt in stop:
            break
    return toks[len(prompt) :]


@pytest.fixture(scope="module")
def baseline(pair):
    target, _ = pair
    return [_greedy_baseline(target, p, NEW) for p in PROMPTS]


def _steep_costs() -> CostTable:
    """Target cost linear in tokens from the first one (no flat weight-bound region), so CAST's
    rules actually cut: narrower frontiers and fewer verified nodes than the EAGLE budget."""

    def target(B: int, c: int, n: int) -> float:
        return 100.0 + 5.0 * B * n

    return CostTable.from_functions(
        target, lambda B, c, n: target(B, c, n) / 4, [1, 2, 4, 8], L=64, M=2, n_max=64
    )


def _policy(policy: str, **kw):
    return make_policy(
        policy,
        depth=3,
        topk=3,
        budget=12,
        cost_table=_steep_costs(),
        C1=0.1,
        C2=0.05,
        C3=0.05,
        # prune early and hard so that Graft fills slots every step
        checkpoints=PruneCheckpoints(steps=(0, 1), keeps=(2, 4), thresholds=(0.99, 0.99)),
        **kw,
    )


def _decoder(pair, policy: str, **kw) -> Decoder:
    target, draft = pair
    return Decoder(target, draft, _policy(policy), page_size=16, **kw)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("anchor", ["leaf", "root"])
def test_both_anchors_graft_greedy_equals_autoregressive(pair, baseline, static, anchor):
    """Thresholded CastGraft grafting below the best leaf (``anchor="leaf"``, the default) and
    from the root's successors, eager and on the static path: nodes are grafted and greedy
    output equals autoregressive decoding."""
    target, draft = pair
    pol = _policy("CastGraft", anchor=anchor)
    res = Decoder(target, draft, pol, page_size=16, static_shapes=static).generate(PROMPTS, NEW)
    assert res.tokens == baseline
    assert sum(res.grafted) > 0


def test_calibrated_checkpoints_fit_the_pair(pair, baseline):
    """``calibrate_checkpoints`` keeps the checkpoints' steps and keeps and fits each threshold
    to this pair: a score in [0, 1] or 0 (never prune), a looser loss bound never lowering it;
    decoding with the fitted checkpoints stays lossless. A λ-CAST CastGraft (no checkpoints) or
    another policy is a ValueError."""
    target, draft = pair
    pol = _policy("CastGraft")
    tight = calibrate_checkpoints(target, draft, pol, PROMPTS, NEW, max_loss=0.0)
    loose = calibrate_checkpoints(target, draft, pol, PROMPTS, NEW, max_loss=1.0)
    for ck in (tight, loose):
        assert (ck.steps, ck.keeps) == (pol.checkpoints.steps, pol.checkpoints.keeps)
        assert all(0.0 <= t <= 1.0 + 1e-6 for t in ck.thresholds)
    assert all(a <= b for a, b in zip(tight.thresholds, loose.thresholds))
    assert any(t > 0 for t in loose.thresholds)  # every step may lose: prune at the top score
    fitted = dataclasses.replace(pol, checkpoints=loose)
    res = Decoder(target, draft, fitted, page_size=16).generate(PROMPTS, NEW)
    assert res.tokens == baseline
    with pytest.raises(ValueError, match="Invalid type of policy"):
        calibrate_checkpoints(target, draft, _policy("Cast"), PROMPTS, NEW)
    lam = make_policy("CastGraft", lambda_graft=True, cost_table=_steep_costs())
    with pytest.raises(ValueError, match="thresholded Cast"):
        calibrate_checkpoints(target, draft, lam, PROMPTS, NEW)


def test_checkpoints_for_depth():
    """Checkpoints after steps 0, D // 4 and D // 2, each before the last layer."""
    assert PruneCheckpoints.for_depth(10).steps == (0, 2, 5)
    assert PruneCheckpoints.for_depth(6).steps == (0, 1, 3)
    assert PruneCheckpoints.for_depth(2).steps == (0, 1)
    assert PruneCheckpoints.for_depth(1).steps == (0,)
    assert PruneCheckpoints.for_depth(1).keeps == (8,)
    with pytest.raises(ValueError, match="max_depth"):
        PruneCheckpoints.for_depth(0)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_equals_autoregressive(pair, baseline, policy, batch):
    res = _decoder(pair, policy).generate(PROMPTS[:batch], NEW)
    assert res.tokens == baseline[:batch]
    assert res.steps == len(res.emitted) == len(res.accepted_per_step)
    assert sum(map(sum, res.emitted)) == batch * NEW
    if policy == "autoregressive":
        assert res.mean_accepted == 1.0
    else:
        # the bigram draft is right often enough for multi-token steps
        assert res.mean_accepted > 1.0, res.emitted
    assert res.time_verify > 0 and res.time_tree > 0
    sizes = [n for row in res.verified for n in row]
    if policy in ("Cast", "CastGraft"):
        assert min(sizes) < 12  # CAST cut the tree below the capacity at least once
    if policy == "CastGraft" and batch > 1:
        # (one request stops drafting at the first checkpoint; its retrieved successors then
        # tend to coincide with the draft's depth-1 nodes and merge into them)
        assert sum(res.grafted) > 0


def test_pure_bigram_target_accepts_full_chains():
    """Target = its bigram part exactly (layers add 0): the chain draft is always right, so
    every step emits depth + 1 tokens (deep acceptance and compaction every step)."""
    cfg = ModelConfig(vocab_size=64, tie_word_embeddings=False)
    target = _friendly_target(cfg, 0.0, seed=3)
    draft = Draft(cfg).bigram_init(target)
    prompts = [[1, 2, 3], [4]]
    base = [_greedy_baseline(target, p, 12) for p in prompts]
    res = Decoder(target, draft, Chain(3)).generate(prompts, 12)
    assert res.tokens == base
    assert res.emitted == [[4, 4]] * 3


@pytest.mark.parametrize("policy", POLICIES)
def test_stop_ids_and_budgets(pair, baseline, policy):
    budgets = [3, 8, 1]
    # a stop id that request 1 emits at its 4th token: output ends right after it
    stop = baseline[1][3]
    res = _decoder(pair, policy).generate(PROMPTS, budgets, stop_ids=[stop])
    target, _ = pair
    want = [_greedy_baseline(target, p, m, stop=(stop,)) for p, m in zip(PROMPTS, budgets)]
    assert res.tokens == want
    assert len(res.tokens[1]) <= 4 and res.tokens[1][-1] == stop
    assert all(len(t) <= m for t, m in zip(res.tokens, budgets))


@pytest.mark.parametrize("page_size", [1, 4])
def test_small_pages(pair, baseline, page_size):
    """Pages of 1 and 4 slots: trees, compaction and the draft's scratch cross page borders."""
    target, draft = pair
    dec = Decoder(target, draft, EagleStatic(depth=3, topk=3, budget=8), page_size=page_size)
    assert dec.generate(PROMPTS, NEW).tokens == baseline


def test_zero_budget_and_one_token_prompt(pair):
    target, _ = pair
    res = _decoder(pair, "CastGraft").generate([[9], [1, 2]], [4, 0])
    assert res.tokens == [_greedy_baseline(target, [9], 4), []]


def _filtered(logits: torch.Tensor, T: float, top_k: int, top_p: float) -> torch.Tensor:
    """docs/design.md op 7's target distribution, written out (float64)."""
    p = torch.softmax(logits.double() / T, -1)
    V = p.shape[0]
    order = sorted(range(V), key=lambda i: (-float(p[i]), i))
    keep = order[:top_k] if 0 < top_k < V else order
    q = torch.zeros_like(p)
    q[keep] = p[keep]
    q = q / q.sum()
    if top_p < 1:
        mass, kept = 0.0, []
        for i in sorted(keep, key=lambda i: (-float(q[i]), i)):
            kept.append(i)
            mass += float(q[i])
            if mass >= top_p:
                break
        r = torch.zeros_like(q)
        r[kept] = q[kept]
        q = r / r.sum()
    return q


@pytest.mark.parametrize(
    "policy, T, top_k, top_p",
    [("EagleStatic", 1.0, 0, 1.0), ("CastGraft", 0.7, 6, 0.9), ("chain", 0.7, 0, 1.0)],
)
def test_sampling_matches_target_distribution(policy, T, top_k, top_p):
    """The joint law of the first two emitted tokens over V = 8 (64 cells), 3000 requests with
    one prompt, against the exact p(x1) p(x2 | x1) of the baseline forward. Tolerance per cell:
    4.5 binomial standard deviations + 1/n (a false alarm per cell has probability ~7e-6, so
    ~5e-4 over the 64 cells of a test; the seed is fixed, so the test is deterministic anyway),
    while a decoder that skipped temperature/top-k/top-p fails it (the last assertion checks
    that the tolerance tells them apart)."""
    V = 8
    cfg = ModelConfig(vocab_size=V, tie_word_embeddings=False)
    target = _friendly_target(cfg, 0.3, seed=5)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)  # sharper laws, so T / top-k / top-p matter
    draft = Draft(cfg).bigram_init(target)
    prompt = [1, 2, 3, 4]
    n = 3000
    dec = Decoder(target, draft, make_policy(policy, depth=2, topk=2, budget=4))
    g = torch.Generator().manual_seed(1234)
    res = dec.generate([prompt] * n, 2, sampling=SamplingParams(T, top_k, top_p), generator=g)
    assert all(len(t) == 2 for t in res.tokens)
    # many requests accepted a draft node and emitted both tokens in their first step
    assert sum(e == 2 for e in res.emitted[0]) > n // 100
    emp = torch.zeros(V, V, dtype=torch.float64)
    for a, b in res.tokens:
        emp[a, b] += 1
    emp /= n
    exact = _joint(target, prompt, T, top_k, top_p)
    assert abs(float(exact.sum()) - 1) < 1e-9
    tol = 4.5 * torch.sqrt(exact * (1 - exact) / n) + 1.0 / n
    assert bool(((emp - exact).abs() <= tol).all()), (emp - exact).abs().max()
    if (T, top_k, top_p) != (1.0, 0, 1.0):
        # the tolerance is tight enough to reject a decoder that ignored the parameters
        plain = _joint(target, prompt, 1.0, 0, 1.0)
        assert bool(((plain - exact).abs() > tol).any())


@torch.no_grad()
def _joint(target, prompt, T, top_k, top_p) -> torch.Tensor:
    """Exact p(x1, x2) = p(x1) p(x2 | x1) [V, V] from the baseline forward."""
    V = target.cfg.vocab_size
    p1 = _filtered(reference_forward(target, torch.tensor(prompt))[-1], T, top_k, top_p)
    rows = [
        _filtered(reference_forward(target, torch.tensor(prompt + [a]))[-1], T, top_k, top_p)
        for a in range(V)
    ]
    return p1[:, None] * torch.stack(rows)


def test_bad_policy(pair):
    with pytest.raises(ValueError, match="policy"):
        Decoder(pair[0], pair[1], "medusa")
    with pytest.raises(ValueError, match="policy"):
        Decoder(pair[0], pair[1], object())
    with pytest.raises(ValueError, match="policy"):
        make_policy("medusa")
    with pytest.raises(ValueError, match="draft"):
        Decoder(pair[0], None, "chain")
    with pytest.raises(ValueError, match="draft"):
        Decoder(pair[0], None, Chain(2))
    # the policy's knobs live in the policy object, not in Decoder
    with pytest.raises(TypeError, match="depth"):
        Decoder(pair[0], pair[1], "chain", depth=3)
    with pytest.raises(ValueError, match="depth"):
        Chain(0)
    with pytest.raises(ValueError, match="cast"):
        CastGraft(EagleStatic(depth=2, topk=2, budget=4))
    with pytest.raises(ValueError, match="adjacency_k"):
        CastGraft(make_policy("Cast"), adjacency_k=0)
    with pytest.raises(ValueError, match="Invalid value of anchor: expected 'root' or 'leaf'"):
        CastGraft(make_policy("Cast"), anchor="tail")


def test_policy_objects():
    """``make_policy`` maps each name onto its object and sizes; ``Decoder`` maps a name with the
    defaults and exposes the tree policy it drafts with."""
    table = _steep_costs()
    ck = PruneCheckpoints(steps=(0,), keeps=(3,), thresholds=(0.5,))
    tpl = RankTemplate.chain(4)
    kw = dict(depth=3, topk=2, budget=9, cost_table=table, C1=0.4, checkpoints=ck, template=tpl,
              adjacency_k=5)  # fmt: skip
    pols = {name: make_policy(name, **kw) for name in POLICIES}
    assert isinstance(pols["autoregressive"], Autoregressive)
    assert pols["chain"] == Chain(3)
    es = pols["EagleStatic"]
    assert isinstance(es, EagleStatic) and (es.depth, es.topk, es.budget) == (3, 2, 9)
    cast = pols["Cast"]
    assert isinstance(cast, Cast) and cast.cost_table is table and cast.C1 == 0.4
    assert (cast.max_depth, cast.topk, cast.max_width, cast.capacity) == (3, 2, 2, 9)
    cg = pols["CastGraft"]
    assert isinstance(cg, CastGraft) and isinstance(cg.cast, Cast) and cg.cast.capacity == 9
    assert cg.checkpoints is ck and cg.template is tpl and cg.adjacency_k == 5
    target = Target(ModelConfig(vocab_size=32))
    draft = Draft(ModelConfig(vocab_size=32))
    for name, pol in pols.items():
        dec = Decoder(target, draft, pol)
        assert dec.name == name and dec.policy is pol
        assert (dec.tree_policy is None) == (name == "autoregressive")
        assert (dec.graft is pol) == (name == "CastGraft")
        assert (dec.draft is None) == (name == "autoregressive")
    chain = Decoder(target, draft, Chain(3)).tree_policy
    assert isinstance(chain, EagleStatic) and (chain.depth, chain.topk, chain.budget) == (3, 1, 4)
    for name in POLICIES:  # a name: make_policy's defaults
        dec = Decoder(target, draft, name)
        assert dec.name == name and type(dec.policy) is type(make_policy(name))
        assert dec.capacity == {"autoregressive": 1, "chain": 5}.get(name, 16)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_bad_requests_name_the_argument(pair, static):
    dec = Decoder(pair[0], pair[1], "chain", static_shapes=static)
    with pytest.raises(ValueError, match="prompts"):
        dec.generate([[1, 2], []], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        dec.generate([[1, 2], [3]], [4])
    with pytest.raises(ValueError, match="sampling"):
        dec.generate([[1, 2], [3]], 4, sampling=[SamplingParams()])
    for kw, name in (
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=2.5), "top_k"),
        (dict(temperature=float("nan")), "temperature"),
    ):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kw)  # fmt: skip


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_save_load_roundtrip(tmp_path, pair, fmt):
    if fmt == "safetensors":
        pytest.importorskip("safetensors")
    target, _ = pair
    target.save_pretrained(tmp_path, safetensors=fmt == "safetensors")
    loaded = Target.from_pretrained(tmp_path)
    assert loaded.cfg == target.cfg
    x = torch.tensor([3, 1, 4, 1, 5])
    with torch.no_grad():
        assert torch.equal(reference_forward(loaded, x), reference_forward(target, x))


def test_hf_config_names():
    """An HF Llama config.json (no head_dim, eos list, extra keys) maps onto ModelConfig."""
    cfg = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "intermediate_size": 512,
            "num_hidden_layers": 3,
            "vocab_size": 1000,
            "rope_theta": 500000.0,
            "eos_token_id": [7, 8],
            "tie_word_embeddings": False,
        }
    )
    assert (cfg.head_dim, cfg.eos_token_id, cfg.rope_theta) == (64, 7, 500000.0)
    names = set(Target(cfg).state_dict())
    assert "model.layers.2.self_attn.k_proj.weight" in names and "lm_head.weight" in names
    assert "model.layers.0.post_attention_layernorm.weight" in names


def test_target_tree_forward_equals_reference(pair):
    """Verification forward over a tree on a paged cache after a ragged prefill: node i's logits
    equal the full recompute of (prompt, path to i), for every node of a branching tree."""
    target, _ = pair
    prompts = [[5, 17, 3, 99, 42], [11, 64, 2]]
    B = len(prompts)
    kv = target.make_cache(B, 64, page_size=4, seed=7)
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
    ptok = torch.zeros(B, 5, dtype=torch.int64)
    for b, p in enumerate(prompts):
        ptok[b, : len(p)] = torch.tensor(p)
    with torch.no_grad():
        target(ptok, kv, torch.zeros(B, dtype=torch.int32), chain_tree(ptok, lens))
        parents = torch.tensor([[-1, 0, 0, 1, 3, 2], [-1, 0, 1, 0, 0, 0]], dtype=torch.int32)
        tokens = torch.tensor([[7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 5, 6]])
        tree = Tree.from_parents(parents, torch.tensor([6, 4], dtype=torch.int32), tokens)
        logits, _ = target(tree.tokens, kv, lens, tree)
        for b in range(B):
            for i in range(int(tree.num_nodes[b])):
                path, j = [], i
                while j >= 0:
                    path.append(int(tokens[b, j]))
                    j = int(parents[b, j])
                ref = reference_forward(target, torch.tensor(prompts[b] + path[::-1]))[-1]
                torch.testing.assert_close(logits[b, i], ref, rtol=1e-4, atol=1e-4)


def test_draft_frontier_rows_equal_full_forward():
    """The draft's frontier-only forward (rows q_start.., kv_append with a shifted base and
    relative depths) gives the same outputs as a forward of every node of the working tree."""
    cfg = ModelConfig(vocab_size=32)
    target = Target(cfg, seed=2)
    draft = Draft(cfg, seed=3)
    B, N, W = 2, 7, 3
    parents = torch.tensor([[-1, 0, 0, 0, 1, 1, 2], [-1, 0, 0, 0, 3, 3, 0]], dtype=torch.int32)
    tokens = torch.randint(0, 32, (B, N))
    feats = torch.randn(B, N, cfg.hidden_size)
    seq = torch.tensor([5, 9], dtype=torch.int32)
    tree = Tree.from_parents(parents, torch.tensor([N, N], dtype=torch.int32), tokens)
    with torch.no_grad():
        kv_full = draft.make_cache(B, 32, page_size=4, seed=1)
        kv_rows = draft.make_cache(B, 32, page_size=4, seed=1)
        for kv in (kv_full, kv_rows):  # the same random prefix in both
            g = torch.Generator().manual_seed(0)
            kv.k.copy_(torch.randn(kv.k.shape, generator=g))
            kv.v.copy_(torch.randn(kv.v.shape, generator=g))
        full, h_full = draft(target, tokens, feats, kv_full, seq, tree)
        for start, rows in ((0, 1), (1, W), (1 + W, W)):
            sub = Tree.from_parents(
                parents, torch.full((B,), start + rows, dtype=torch.int32), tokens
            )
            qs = torch.full((B,), start, dtype=torch.int32)
            ql = torch.full((B,), rows, dtype=torch.int32)
            sl = slice(start, start + rows)
            out, h = draft(target, tokens[:, sl], feats[:, sl], kv_rows, seq, sub, qs, ql)
            torch.testing.assert_close(out, full[:, sl], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(h, h_full[:, sl], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kv_rows.k, kv_full.k)


def test_autoregressive_without_draft(pair, baseline):
    target, _ = pair
    res = Decoder(target, None, "autoregressive").generate(PROMPTS, NEW)
    assert res.tokens == baseline


def test_cli_decode(capsys):
    from treeops.cli import main

    assert main(["decode", "--batch", "2", "--new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "False" not in out and out.count("True") == len(POLICIES)
    assert main(["decode", "--batch", "1", "--new-tokens", "3", "--temperature", "0.8"]) == 0


def test_mixed_sampling_params(pair, baseline):
    """Per-request sampling parameters: the greedy rows still equal greedy decoding."""
    sp = [SamplingParams(), SamplingParams(1.0, 5, 0.9), SamplingParams()]
    res = _decoder(pair, "CastGraft").generate(
        PROMPTS, NEW, sampling=sp, generator=torch.Generator().manual_seed(3)
    )
    assert res.tokens[0] == baseline[0] and res.tokens[2] == baseline[2]
    assert len(res.tokens[1]) == NEW


def test_kv_append_kernel_accepts_negative_relative_depth():
    """The draft's frontier write passes depths relative to a shifted base (negative ones
    included); the Triton kernel (interpreted here) must rotate exactly as the reference."""
    from treeops.kernels import kv_append as KA
    from treeops.reference import kv_append as RK

    g = torch.Generator().manual_seed(0)
    B, R, H, D, page = 2, 3, 2, 64, 4
    k = torch.randn(B, R, H, D, generator=g)
    v = torch.randn(B, R, H, D, generator=g)
    bt = torch.tensor([[3, 1, 0, 2, 7, 5], [4, 6, 8, 9, 10, 11]], dtype=torch.int32)
    base = torch.tensor([9, 4], dtype=torch.int32)
    n = torch.tensor([3, 2], dtype=torch.int32)
    rel = torch.tensor([[-2, -3, -4], [-1, 0, -1]], dtype=torch.int32)
    kc = torch.zeros(12, page, H, D)
    vc = torch.zeros(12, page, H, D)
    kc2, vc2 = kc.clone(), vc.clone()
    RK.kv_append(k, v, kc, vc, bt, base, n, rel, rope_theta=10000.0)
    KA.kv_append_fwd(k, v, kc2, vc2, bt, base, n, rel, 10000.0)
    torch.testing.assert_close(kc2, kc, rtol=1e-5, atol=1e-5)
    assert torch.equal(vc2, vc)


@pytest.mark.parametrize("policy", ["EagleStatic", "CastGraft"])
def test_greedy_batch_of_eight(pair, baseline, policy):
    """B = 8, ragged prompts (1 to 9 tokens) and ragged budgets."""
    target, _ = pair
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 128, (1 + b,), generator=g).tolist() for b in range(8)]
    prompts[3] = PROMPTS[0]
    budgets = [6, 2, 9, NEW, 1, 5, 7, 3]
    want = [_greedy_baseline(target, p, m) for p, m in zip(prompts, budgets)]
    assert want[3] == baseline[0]
    res = _decoder(pair, policy).generate(prompts, budgets)
    assert res.tokens == want


# ------------------------------------------------------------------ CUDA graphs (GPU only)
@pytest.fixture(scope="module")
def gpu_pair(pair):
    import copy

    target, draft = pair
    return copy.deepcopy(target).cuda(), copy.deepcopy(draft).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("policy", POLICIES)
def test_cuda_graphs_equal_eager(gpu_pair, policy, batch):
    """cuda_graphs=True gives token for token the eager decoder's greedy output (tiny fp32
    model), every verify bucket holds its tree (checked on the host each step), and a second
    call only replays."""
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = (PROMPTS * 2)[:batch]
    eager = _decoder(gpu_pair, policy).generate(prompts, NEW)
    dec = _decoder(gpu_pair, policy)
    dec.cuda_graphs = dec.static = dec.check_buckets = True
    res = dec.generate(prompts, NEW)
    assert res.tokens == eager.tokens
    assert res.graphs_captured > 0 and res.undersized == 0
    for b, row in zip(res.verify_buckets, res.verified):
        assert max(row) <= b
    again = dec.generate(prompts, NEW)
    assert again.tokens == res.tokens and again.graphs_captured == 0
    dec.profile = True
    prof = dec.generate(prompts, NEW)
    assert prof.tokens == res.tokens and prof.time_verify > 0 and prof.profiled


@pytest.mark.gpu
def test_cuda_graphs_flag_on_gpu_and_bucket_never_undersizes(gpu_pair):
    """The public flag on CUDA; CAST buckets follow the pinned decisions and never under-size
    over ragged prompts and budgets at B = 8."""
    target, draft = gpu_pair
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 128, (1 + 2 * b,), generator=g).tolist() for b in range(8)]
    budgets = [6, 2, 9, NEW, 1, 5, 7, 3]
    for policy in ("Cast", "CastGraft"):
        eager = _decoder(gpu_pair, policy).generate(prompts, budgets)
        dec = Decoder(target, draft, _policy(policy), cuda_graphs=True, check_buckets=True)
        res = dec.generate(prompts, budgets)
        assert res.tokens == eager.tokens
        assert res.undersized == 0 and res.host_waits > res.steps
        for b, row in zip(res.verify_buckets, res.verified):
            assert max(row) <= b <= 12


# ------------------------------------------------------------ whole-step graphs (step_graphs)
def _step_decoder(pair, policy: str, **kw) -> Decoder:
    target, draft = pair
    pol = make_policy(policy, depth=3, topk=3, budget=12)
    return Decoder(target, draft, pol, page_size=16, **kw)


@pytest.mark.parametrize("ahead", [True, False])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("policy", ["chain", "EagleStatic"])
def test_step_body_equals_eager_greedy(pair, baseline, policy, batch, ahead):
    """The whole-step body (static_shapes=True, step_graphs=True: the graph's code, eager) gives
    token for token the eager decoder's greedy output, with stop ids and ragged budgets, steps
    launched ahead of the last one's collection or one at a time; one host wait per step."""
    target, _ = pair
    stop = baseline[1][3]
    budgets = [3, 8, 1][:batch] if batch > 1 else [7]
    eager = _step_decoder(pair, policy).generate(PROMPTS[:batch], budgets, stop_ids=[stop])
    dec = _step_decoder(pair, policy, static_shapes=True, step_graphs=True, launch_ahead=ahead)
    res = dec.generate(PROMPTS[:batch], budgets, stop_ids=[stop])
    assert res.tokens == eager.tokens
    want = [_greedy_baseline(target, p, m, stop=(stop,)) for p, m in zip(PROMPTS, budgets)]
    assert res.tokens == want
    assert res.emitted == eager.emitted and res.host_waits == res.steps
    assert res.step_graphs and res.stats()["step_graphs"]
    assert all(b == dec.capacity for b in res.verify_buckets)
    # the decoder is reused (static buffers kept): no stop ids, other budgets
    again = dec.generate(PROMPTS[:batch], NEW)
    assert again.tokens == baseline[:batch]


def test_steps_are_launched_ahead_of_collection(pair, monkeypatch):
    """With ``launch_ahead`` the decoder enqueues step t + 1 before it reads step t (two steps
    launched before the first collection) while a request is sure to outlive step t, and
    collects every launched step when no stop id can end the batch early; each collection is
    of the oldest launched step."""
    import treeops.decoder.graphs as G

    order = []
    launch, collect = G.WholeStep.launch, G.WholeStep.collect

    def spy_launch(self):
        out = launch(self)
        order.append(("launch", id(out)))
        return out

    def spy_collect(self, launched):
        order.append(("collect", id(launched)))
        return collect(self, launched)

    monkeypatch.setattr(G.WholeStep, "launch", spy_launch)
    monkeypatch.setattr(G.WholeStep, "collect", spy_collect)
    dec = _step_decoder(pair, "chain", static_shapes=True, step_graphs=True)
    res = dec.generate(PROMPTS[:2], [12, 5])
    kinds = [k for k, _ in order]
    assert kinds[:3] == ["launch", "launch", "collect"]
    launched = [i for k, i in order if k == "launch"]
    collected = [i for k, i in order if k == "collect"]
    assert collected == launched  # every step collected, in launch order
    assert len(collected) == res.steps == res.host_waits


@pytest.mark.parametrize("policy", ["chain", "EagleStatic", "autoregressive"])
def test_step_body_equals_eager_sampling(pair, policy):
    """Sampling: the uniforms drawn on the host from the same generator, copied into the step's
    static buffer, give the eager decoder's tokens."""
    sp = [SamplingParams(temperature=1.0, top_k=20), SamplingParams(0.7, top_p=0.9),
          SamplingParams()]  # fmt: skip
    out = []
    for step in (False, True):
        dec = _step_decoder(pair, policy, static_shapes=step, step_graphs=step)
        g = torch.Generator().manual_seed(5)
        out.append(dec.generate(PROMPTS, [6, 9, 4], sampling=sp, generator=g).tokens)
    assert out[0] == out[1]


def test_accept_mode_passes_truncation_only_where_a_request_truncates():
    from treeops.decoder.results import AcceptMode

    assert AcceptMode.of([SamplingParams(), SamplingParams(0.0, 5, 0.5)]) == AcceptMode(True)
    plain = AcceptMode.of([SamplingParams(), SamplingParams(0.8)])
    assert plain == AcceptMode(False, top_k=False, top_p=False)
    mixed = [SamplingParams(0.8), SamplingParams(0.0, top_k=3), SamplingParams(1.0, top_p=0.9)]
    assert AcceptMode.of(mixed) == AcceptMode(False, top_k=True, top_p=True)
    assert AcceptMode.of([SamplingParams(1.0, top_k=4)]) == AcceptMode(False, True, False)


@pytest.mark.parametrize("step", [False, True])
def test_sampling_without_truncation_equals_all_off_tensors(pair, monkeypatch, step):
    """A run where no request truncates passes no top-k / top-p tensors (one launch fewer): it
    samples the tokens the all-off tensors give from the same uniforms, eager and step path."""
    from treeops.decoder import results as R
    from treeops.decoder import step as S

    sp = [SamplingParams(1.0), SamplingParams(0.7), SamplingParams()]
    out, seen = [], []
    accept_sample = S.accept_sample

    def spy(tree, logits, temperature, top_k, top_p, *a, **kw):
        seen.append((top_k is None, top_p is None))
        return accept_sample(tree, logits, temperature, top_k, top_p, *a, **kw)

    monkeypatch.setattr(S, "accept_sample", spy)
    all_off = classmethod(lambda cls, per_req: cls(False, top_k=True, top_p=True))
    for forced in (False, True):
        if forced:
            monkeypatch.setattr(R.AcceptMode, "of", all_off)
        dec = _step_decoder(pair, "EagleStatic", static_shapes=step, step_graphs=step)
        g = torch.Generator().manual_seed(7)
        out.append(dec.generate(PROMPTS, [6, 9, 4], sampling=sp, generator=g).tokens)
        assert set(seen) == {(not forced, not forced)}
        seen.clear()
    assert out[0] == out[1]


def test_step_graphs_flag_checks(pair):
    target, draft = pair
    cast = make_policy("Cast", depth=3, topk=3, budget=12, C3=0.1)  # thresholds: sizes in-step
    with pytest.raises(ValueError, match="step_graphs"):
        Decoder(target, draft, cast, static_shapes=True, step_graphs=True)
    with pytest.raises(ValueError, match="step_graphs"):  # λ-CAST: the static path plans steps
        _step_decoder(pair, "Cast", static_shapes=True)
    with pytest.raises(ValueError, match="step_graphs"):
        _step_decoder(pair, "CastGraft", static_shapes=True, step_graphs=True)
    with pytest.raises(ValueError, match="step_graphs"):
        _step_decoder(pair, "chain", step_graphs=True)  # neither cuda_graphs nor static_shapes


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("policy", ["chain", "EagleStatic", "autoregressive"])
def test_step_graphs_equal_per_forward_graphs(gpu_pair, policy, batch):
    """On CUDA (tiny fp32 pair) step_graphs=True gives token for token the per-forward graphs'
    output, greedy with a stop id and ragged budgets, and sampled; one graph per key, replayed
    by a second call; one host wait per step."""
    torch.backends.cuda.matmul.allow_tf32 = False
    target, draft = gpu_pair
    prompts = (PROMPTS * 2)[:batch]
    budgets = [7, 3, 10, 1][:batch]
    stop = [42]

    def dec(step):
        d = None if policy == "autoregressive" else draft
        pol = make_policy(policy, depth=3, topk=3, budget=12)
        return Decoder(target, d, pol, cuda_graphs=True, step_graphs=step)

    per_fwd, whole = dec(False), dec(True)
    ref = per_fwd.generate(prompts, budgets, stop_ids=stop)
    res = whole.generate(prompts, budgets, stop_ids=stop)
    assert res.tokens == ref.tokens
    assert res.graphs_captured == 1 and res.undersized == 0
    assert res.host_waits == res.steps and res.step_graphs
    again = whole.generate(prompts, budgets, stop_ids=stop)
    assert again.tokens == res.tokens and again.graphs_captured == 0
    sp = SamplingParams(temperature=1.0, top_k=20)
    s_ref = per_fwd.generate(prompts, NEW, sampling=sp, generator=torch.Generator().manual_seed(3))
    s_res = whole.generate(prompts, NEW, sampling=sp, generator=torch.Generator().manual_seed(3))
    assert s_res.tokens == s_ref.tokens and s_res.graphs_captured == 1  # the sampling graph
    whole.profile = True
    prof = whole.generate(prompts, budgets, stop_ids=stop)
    assert prof.tokens == res.tokens and prof.time_step > 0 and prof.graphs_captured == 0


# ------------------------------------------------------------------------ capture safety, on CPU
@pytest.mark.parametrize(
    ("policy", "step_graphs"),
    [(p, False) for p in POLICIES]
    + [
        (p, True)
        for p in (
            "autoregressive",
            "chain",
            "EagleStatic",
            "lambda-Cast",
            "lambda-CastGraft",
            "lambda-CastTail",
        )
    ],
)
def test_graph_bodies_never_sync(pair, baseline, monkeypatch, policy, step_graphs):
    """What the GPU path captures in CUDA graphs (the per-forward bodies, or the whole step)
    runs here eagerly (``static_shapes=True``) under ``treeops.testing.NoHostSync``, which fails
    on any host sync, data-dependent shape or host data copied in; greedy with stop ids and
    ragged budgets, then sampling, B = 3. The treeops ops run their CPU references here, not the
    GPU launchers (``bench/compile_check.py`` checks those the same way), so they are opaque."""
    import treeops.decoder.engine as E
    import treeops.decoder.graphs as G
    import treeops.decoder.model as M
    import treeops.decoder.step as S
    from treeops.graft import AdjacencyTable

    check = NoHostSync(only_regions=True)
    for mod, names in (
        (S, ["accept_greedy", "accept_sample", "build_tree_emit", "build_tree_expand",
             "compact_kv", "prune"]),
        (E, ["graft", "graft_tail"]),  # (Graft's refill, ``Decoder.refill``)
        (M, ["kv_append", "tree_attention"]),
    ):  # fmt: skip
        for name in names:
            monkeypatch.setattr(mod, name, check.opaque(getattr(mod, name)))
    for meth in ("update", "retrieve", "warm_start"):
        monkeypatch.setattr(AdjacencyTable, meth, check.opaque(getattr(AdjacencyTable, meth)))
    replay, replay_step = G.GraphRunner.replay, G.GraphRunner.replay_step
    monkeypatch.setattr(
        G.GraphRunner,
        "replay",
        lambda self, sb, key, body, res: replay(self, sb, key, check.region(body), res),
    )
    monkeypatch.setattr(
        G.GraphRunner,
        "replay_step",
        lambda self, sb, key, make_body, res: replay_step(
            self, sb, key, lambda: check.region(make_body()), res
        ),
    )

    if policy.startswith("lambda-"):  # λ-CAST: a plan per step, its statistics on device
        dec = _lambda_decoder(pair, graft=policy != "lambda-Cast", static_shapes=True,
                              anchor="leaf" if policy.endswith("Tail") else "root")  # fmt: skip
    else:
        dec = _decoder(pair, policy, static_shapes=True, step_graphs=step_graphs)
    stop = baseline[1][3]
    with check:
        res = dec.generate(PROMPTS, [3, 8, 10], stop_ids=[stop])
        g = torch.Generator().manual_seed(3)
        sp = [SamplingParams(temperature=0.8, top_k=20), SamplingParams(1.0, top_p=0.9),
              SamplingParams()]  # fmt: skip
        dec.generate(PROMPTS, 6, sampling=sp, generator=g)
    assert check.ops_checked > 100  # the bodies ran under the check
    target, _ = pair
    want = [_greedy_baseline(target, p, m, stop=(stop,)) for p, m in zip(PROMPTS, [3, 8, 10])]
    assert res.tokens == want


# ---------------------------------------------------------------------------------- λ-CAST
def _lambda_decoder(pair, graft: bool = False, anchor: str = "root", **kw) -> Decoder:
    """λ-CAST (max depth 5, capacity 16) as whole steps; with ``graft`` CastGraft over it
    (grafting at ``anchor``), starting from a plan that grafts 4 of 8 verified nodes."""
    target, draft = pair
    pol = make_policy("CastGraft" if graft else "Cast", depth=3, topk=3, budget=12,
                      cast_depth=5, cast_budget=16, cost_table=_steep_costs(),
                      lambda_graft=graft, anchor=anchor)  # fmt: skip
    opts = {"initial": Plan(width=2, depth=3, verify=8, graft=4)} if graft else None
    kw.setdefault("step_graphs", True)
    return Decoder(target, draft, pol, planner_options=opts, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "policy",
    ["chain", "EagleStatic", "Cast", "CastGraft", "lambda-Cast", "lambda-CastGraft",
     "lambda-CastTail"],
)  # fmt: skip
def test_fp32_greedy_equals_autoregressive_at_batch_64(gpu_pair, policy):
    """Lossless at B = 64 in fp32 (tiny pair, tf32 off): every policy's greedy output equals
    autoregressive decoding token for token, on its fastest graph mode (whole-step graphs where
    the policy has them, per-forward graphs for thresholded CAST and CastGraft)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    target, draft = gpu_pair
    g = torch.Generator().manual_seed(64)
    V = target.cfg.vocab_size
    prompts = [torch.randint(1, V, (3 + i % 9,), generator=g).tolist() for i in range(64)]
    ar = Decoder(target, None, "autoregressive", cuda_graphs=True).generate(prompts, NEW)
    if policy.startswith("lambda-"):
        dec = _lambda_decoder(gpu_pair, graft=policy != "lambda-Cast", cuda_graphs=True,
                              anchor="leaf" if policy.endswith("Tail") else "root")  # fmt: skip
    else:
        whole = policy in ("chain", "EagleStatic")
        dec = _decoder(gpu_pair, policy, cuda_graphs=True, step_graphs=whole)
    res = dec.generate(prompts, NEW)
    assert res.tokens == ar.tokens
    assert res.mean_accepted > 1.0  # the drafts were used, not only the bonus tokens
