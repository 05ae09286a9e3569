"""``treeops demo``: the example decoder on a model pair trained on this machine, every policy.

``run_demo`` trains (or loads from its cache) the tiny target + draft of
``treeops.decoder.train.PairConfig.tiny()`` on the machine's own Python source (about a minute on
two CPU cores, once), decodes held-out prompts greedily with each policy (``autoregressive``,
``chain``, ``EagleStatic``, ``Cast``, ``CastGraft``) through ``treeops.decoder.Decoder``, checks
that every policy's output equals plain autoregressive greedy decoding token for token, and
prints accepted tokens per step, tokens/s, one drawn verification tree and a decoded snippet.

``run_synthetic_demo`` (``treeops demo --synthetic``) is the model-free walk through every op: a
toy "language" stands in for the models (the true next token after ``t`` is ``nxt(t)``;
the target's logits favour it strongly but sometimes prefer another token, the draft's favour it
less sharply, with noise), enough for trees, CAST's choices, Graft's retrieval and greedy
acceptance to behave as they do with real models.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from .accept import accept_greedy
from .build_tree import Cast, DraftState, build_tree
from .compact_kv import compact_kv
from .cost_table import CostTable
from .decoder import POLICIES, Decoder, make_policy
from .decoder.train import PairConfig, train_pair
from .graft import AdjacencyTable, RankTemplate, graft
from .kv_append import kv_append, rope
from .prune import PruneCheckpoints, prune
from .tree_attention import tree_attention

V = 96  # vocabulary
H_Q, H_KV, D = 4, 2, 64
PAGE = 16
LAYERS = 2


def nxt(t: torch.Tensor) -> torch.Tensor:
    return (7 * t + 3) % V


def _target_logits(tokens: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """[B, N] tokens -> [B, N, V] logits: the true successor wins except at a few nodes."""
    B, N = tokens.shape
    logits = torch.randn(B, N, V, generator=g)
    truth = nxt(tokens)
    other = (truth + 1 + torch.randint(0, V - 1, (B, N), generator=g)) % V
    wrong = torch.rand(B, N, generator=g) < 0.15
    winner = torch.where(wrong, other, truth)
    logits.scatter_(2, winner[..., None], 8.0)
    return logits


def _draft_logits(tokens: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """[B, W] frontier tokens -> [B, W, V]: the true successor favoured, less sharply."""
    B, W = tokens.shape
    logits = torch.randn(B, W, V, generator=g) * 1.5
    logits.scatter_add_(2, nxt(tokens)[..., None], torch.full((B, W, 1), 5.0))
    return logits


def _cost_table() -> CostTable:
    """A small synthetic cost table shaped like a large GPU's (docs/benchmarks.md): flat while
    the forward is weight-bound (here up to 32 tokens), then growing with tokens; the draft costs
    a quarter."""

    def target(B: int, c: int, n: int) -> float:
        return 100.0 + 0.02 * B * c / 1024 + max(0, B * n - 32) * 1.0

    def draft(B: int, c: int, n: int) -> float:
        return target(B, c, n) / 4

    return CostTable.from_functions(
        target,
        draft,
        batch_sizes=[1, 2, 4, 8, 16],
        L=256,
        M=4,
        n_max=64,
        meta={"gpu": "synthetic", "model": "demo"},
    )


def _check_at_least_1(**args: int) -> None:
    for name, v in args.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"Invalid {name}: expected an int >= 1, got {v!r}")


def _short(xs: list[int], shown: int = 5) -> str:
    return str(xs) if len(xs) <= shown else str(xs[:shown])[:-1] + ", ...]"


def run_synthetic_demo(batch: int = 4, steps: int = 4, seed: int = 0) -> int:
    """Walk ``steps`` decoding steps of a ``batch`` of toy requests through every op (CAST tree,
    Graft, tree attention, acceptance, compaction), printing a row per step and one drawn tree.
    Returns 0; ``batch`` or ``steps`` below 1 is a ``ValueError``."""
    _check_at_least_1(batch=batch, steps=steps)
    g = torch.Generator().manual_seed(seed)
    B = batch
    N = 32
    policy = Cast(
        C1=1.0,
        C2=0.5,
        C3=0.3,
        R=4,
        cost_table=_cost_table(),
        topk=4,
        max_width=4,
        max_depth=6,
        capacity=N,
    )
    template = RankTemplate.default()
    table = AdjacencyTable(V, k=8)
    checkpoints = PruneCheckpoints()

    # A paged KV cache per layer (stacked [L, pages, PAGE, H_kv, D]) with random prompts' K/V.
    prompt_lens = torch.randint(20, 60, (B,), generator=g, dtype=torch.int32)
    max_len = int(prompt_lens.max()) + steps * N + N
    pages_per = -(-max_len // PAGE)
    perm = torch.randperm(B * pages_per, generator=g).to(torch.int32)
    block_table = perm.view(B, pages_per)
    k_cache = torch.randn(LAYERS, B * pages_per, PAGE, H_KV, D, generator=g)
    v_cache = torch.randn(LAYERS, B * pages_per, PAGE, H_KV, D, generator=g)
    seq_lens = prompt_lens.clone()

    # Warm the successor table from the "prompts": token sequences of the toy language.
    prompts = torch.randint(0, V, (B, 1), generator=g)
    for _ in range(15):
        prompts = torch.cat([prompts, nxt(prompts[:, -1:])], dim=1)
    table.warm_start(prompts, _target_logits(prompts, g))
    root = nxt(prompts[:, -1])

    print(
        f"treeops demo: B={B}, vocab={V}, tree capacity N={N}, CAST policy, Graft template "
        f"of {template.size} nodes, {LAYERS} layers of attention (H_q={H_Q}, H_kv={H_KV}, "
        f"D={D}), page size {PAGE}\n"
    )
    header = (
        f"{'step':>4}  {'draft widths':<16}{'verify':>7}{'pruned':>8}{'grafted':>8}"
        f"{'accepted/request':>22}{'seq_lens':>22}{'ms':>8}"
    )
    print(header)
    print("-" * len(header))
    state = None
    emitted = torch.zeros(B, dtype=torch.int64)
    drawn = None
    for step in range(steps):
        t0 = time.perf_counter()
        # 1. Draft a CAST tree.
        if state is None:
            state = DraftState.new(policy, root, seq_lens)
        tree = build_tree(
            policy, lambda st: _draft_logits(st.frontier_tokens, g), root, seq_lens, state=state
        )
        widths = [int(w) for w in state.widths[: state.layer]]
        verify = tree.num_nodes.clone()
        # 2. Graft: prune requests whose best depth-1 score is low, refill from the table.
        keep = checkpoints.start(B)
        checkpoints.check(0, tree.scores[:, 1].contiguous(), keep)
        pruned = prune(tree, keep)
        hybrid = graft(pruned, table, template, budget=verify)
        # 3. Verify: per layer, append the tree's K/V and run tree attention.
        x = torch.randn(B, N, H_Q, D, generator=g)
        for layer in range(LAYERS):
            k_new = torch.randn(B, N, H_KV, D, generator=g)
            v_new = torch.randn(B, N, H_KV, D, generator=g)
            kv_append(
                k_new,
                v_new,
                k_cache[layer],
                v_cache[layer],
                block_table,
                seq_lens,
                hybrid.num_nodes,
                hybrid.depth,
            )
            q = rope(x, hybrid.positions(seq_lens))
            x = tree_attention(q, k_cache[layer], v_cache[layer], block_table, seq_lens, hybrid)
        # 4. Accept greedily against the target's logits, learn successors, compact the cache.
        logits = _target_logits(hybrid.tokens, g)
        acc = accept_greedy(hybrid, logits)
        table.update(hybrid, logits)
        seq_lens = compact_kv(
            k_cache, v_cache, block_table, seq_lens, hybrid, acc.accepted, acc.accept_len
        )
        root = acc.bonus
        emitted += acc.accept_len.to(torch.int64)
        ms = (time.perf_counter() - t0) * 1e3
        n_pruned = int((tree.num_nodes - pruned.num_nodes).sum())
        n_grafted = int((hybrid.num_nodes - pruned.num_nodes).sum())
        if drawn is None and n_grafted > 0:
            drawn = (step, hybrid, int((hybrid.num_nodes - pruned.num_nodes).argmax()))
        print(
            f"{step:>4}  {str(widths):<16}{int(verify.max()):>7}{n_pruned:>8}{n_grafted:>8}"
            f"{_short(acc.accept_len.tolist()):>22}{_short(seq_lens.tolist()):>22}{ms:>8.1f}"
        )
    if drawn is None:
        drawn = (steps - 1, hybrid, 0)
    step, t, b = drawn
    print(f"\nstep {step}, request {b}'s tree (grafted nodes have score 0):")
    print(t.draw(b))
    print(
        f"\ntokens emitted per request (accepted + bonus, over {steps} steps): "
        f"{emitted.tolist()}; mean per step {float(emitted.float().mean()) / steps:.2f}"
    )
    return 0


# ------------------------------------------------------------------------ the trained-pair demo
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "treeops"


class _Bar:
    """A one-line progress bar on stderr (redrawn in place on a terminal, a line per 25%
    otherwise)."""

    def __init__(self, width: int = 30):
        self.width = width
        self.shown: tuple[str, int] | None = None
        self.tty = sys.stderr.isatty()

    def __call__(self, phase: str, frac: float, info: str) -> None:
        pct = int(100 * min(1.0, frac))
        step = 1 if self.tty else 25
        key = (phase, pct // step)
        if key == self.shown:
            return
        self.shown = key
        n = pct * self.width // 100
        line = f"training {phase:<6} [{'#' * n}{'.' * (self.width - n)}] {pct:3d}%  {info}"
        end = "\n" if pct >= 100 or not self.tty else ""
        sys.stderr.write(("\r" if self.tty else "") + line + end)
        sys.stderr.flush()


def _log(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


def run_demo(
    batch: int = 4,
    new_tokens: int = 32,
    preset: str = "tiny",
    cache_dir: str | Path | None = None,
    retrain: bool = False,
    depth: int = 5,
    topk: int = 4,
    budget: int = 24,
) -> int:
    """Train or load the ``preset`` pair (cached under ``cache_dir``, default
    ``~/.cache/treeops/<preset>-pair``), decode ``batch`` held-out prompts with every policy,
    check greedy equality and print the table. Returns 0, or 1 if a policy's output differs.
    Arguments are checked (``ValueError``) before any training."""
    _check_at_least_1(batch=batch, new_tokens=new_tokens, depth=depth, topk=topk, budget=budget)
    presets = {"tiny": PairConfig.tiny, "micro": PairConfig.micro}
    if preset not in presets:
        raise ValueError(f"Invalid preset: expected one of {sorted(presets)}, got {preset!r}")
    cfg = presets[preset]()
    cache = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE / f"{preset}-pair"
    if retrain:
        (cache / "pair_config.json").unlink(missing_ok=True)
    print(
        f"treeops demo: a {cfg.num_hidden_layers}-layer target and a one-layer EAGLE-style draft, "
        f"trained on this machine's Python source (cache: {cache})",
        flush=True,
    )
    t0 = time.perf_counter()
    pair = train_pair(cfg, "cpu", cache, log=_log, progress=_Bar())
    r = pair.report
    print(
        f"pair ready in {time.perf_counter() - t0:.1f} s: target {r['target_params']:,} "
        f"parameters (vocab {r['vocab_size']}), trained {r['target']['seconds']:.0f} s on "
        f"{r['target']['tokens']:,} tokens; held-out loss {r['heldout_loss']:.2f} nats/token, "
        f"top-1 {r['heldout_top1']:.0%}; draft top-1 agreement with the target "
        f"{r['draft_agreement']:.0%}"
    )
    tok, target, draft = pair.tokenizer, pair.target, pair.draft
    prompts = pair.prompts[:batch]
    if not prompts:
        print("no held-out prompt long enough", file=sys.stderr)
        return 1
    vocab = [tok.decode([i]) for i in range(target.cfg.vocab_size)]
    eos = target.cfg.eos_token_id
    stop = [eos] if eos is not None else None
    print(
        f"\ndecoding {len(prompts)} held-out prompts of {len(prompts[0])} tokens, "
        f"{new_tokens} new tokens each, greedy, batch {len(prompts)}; trees: depth {depth}, "
        f"top-k {topk}, {budget} nodes\n(on a CPU treeops runs its PyTorch references: tokens/s "
        f"here show their overheads, not a GPU's speed-ups)\n"
    )
    header = (
        f"{'policy':<15}{'steps':>6}{'accepted/step':>15}{'tokens/s':>10}{'speedup':>9}"
        f"  same as greedy"
    )
    print(header)
    print("-" * len(header))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second OpenMP thread only spin-waits
    drawn: list[str] = []
    ref: list[list[int]] | None = None
    ar_rate = 0.0
    ok = True
    try:
        for name in POLICIES:
            dec = Decoder(target, draft, make_policy(name, depth=depth, topk=topk, budget=budget))
            trees: list[str] = []

            def record(module, args, trees=trees):
                trees.append(args[3].draw(0, vocab))

            hook = target.register_forward_pre_hook(record) if name == "CastGraft" else None
            t = time.perf_counter()
            res = dec.generate(prompts, new_tokens, stop_ids=stop)
            dt = time.perf_counter() - t
            if hook is not None:
                hook.remove()
                step_trees = trees[len(trees) - res.steps :]  # the last `steps` calls verify
                best = max(range(res.steps), key=lambda s: res.emitted[s][0])
                drawn = [step_trees[best], f"{res.emitted[best][0]}", f"{best}"]
            rate = sum(len(x) for x in res.tokens) / dt
            if ref is None:
                ref, ar_rate = res.tokens, rate
            same = res.tokens == ref
            ok &= same
            print(
                f"{name:<15}{res.steps:>6}{res.mean_accepted:>15.2f}{rate:>10.1f}"
                f"{rate / ar_rate:>8.2f}x  {'yes' if same else 'NO'}"
            )
            if not same:
                for b, (x, y) in enumerate(zip(res.tokens, ref)):
                    if x != y:
                        i = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
                        print(f"    request {b} differs from greedy at token {i}: {x} vs {y}")
    finally:
        torch.set_num_threads(threads)
    if drawn:
        tree, n, step = drawn
        print(f"\nCastGraft, step {step}, request 0's verification tree ({n} tokens emitted):")
        print(tree)
    assert ref is not None
    lines = tok.decode(prompts[0]).splitlines()
    print("\nrequest 0, the end of its held-out prompt and the greedy continuation (>>>):")
    print("\n".join(lines[-3:]) + ">>>" + tok.decode(ref[0]))
    if not ok:
        print("\nFAILED: a policy's greedy output differs from autoregressive greedy decoding")
        return 1
    print("\nevery policy's output equals autoregressive greedy decoding, token for token")
    return 0
