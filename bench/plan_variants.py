"""Which Triton kernels compile a new variant when λ-CAST's plan (width w, depth D, verify n)
changes, and why. Runs on a CPU: nothing compiles or runs.

One whole decoding step of the example decoder's λ-CAST mode (``WholeStepBody`` with a plan's
``PlanBuffers``) is replayed as the sequence of launches it makes, at the pair's shapes, bf16,
through the public ops' CUDA launchers on CPU tensors (``bench_host.launchers_on_cpu``: the direct
path, ``treeops._library.DIRECT = 2``) and the decoder's fused kernels (``decoder/fused.py``):

* draft forwards of 1 row, then w rows per further layer (``tree_index``, ``embed_cat``,
  ``add_rmsnorm``, ``kv_append`` with q, ``tree_attention`` over the plan's own working tree of
  capacity 1 + max(D - 1, 1) w, ``swiglu``), inputs and outputs as the decoder's views at the
  plan's width (``graphs.rows_view``);
* ``build_tree_expand`` per layer and ``build_tree_emit`` for ``EagleStatic(depth=D, topk=K,
  budget=n, width=w)`` (the planner's ``policy_for``);
* the verification forward at n nodes, ``accept_greedy``, ``compact_kv``;
* the catch-up forward over a chain of ``bucket(D + 1)`` nodes, ``cast_step_stats``.

Triton is pointed at ``compile_check.py``'s stand-in driver (sm_90, the H200's 132 SMs) and each
``JITFunction._do_compile`` is replaced by a recorder: a launch whose specialisation key Triton has
not cached yet is one compiled variant (the key is Triton's own: every constexpr, each integer's
``== 1`` / ``% 16 == 0`` specialisation, each pointer's dtype and alignment, the options). Each
plan runs against empty caches; a plan change's new variants are the keys of the new plan that the
old plan did not have, attributed to the parameters whose specialisation differs from the old
plan's nearest variant of the same kernel.

    python bench/plan_variants.py [--pair tiny|h200] [--batch 4] [--verbose]

Must run without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("plan_variants.py needs Triton's GPU specialisation: run it without TRITON_INTERPRET")
os.environ.setdefault("TREEOPS_DISPATCH", "0")

import torch  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import treeops  # noqa: E402
from treeops.cast_stats import SCORE_BINS, stats_size  # noqa: E402
from treeops.decoder import fused  # noqa: E402
from treeops.decoder.graphs import bucket_for, rows_view  # noqa: E402
from treeops.kernels.cast_plan import step_stats_launch  # noqa: E402

# (hidden, q heads, kv heads, head dim, vocab, intermediate, target layers): train.PairConfig
PAIRS = {"tiny": (64, 1, 1, 64, 512, 192, 4), "h200": (640, 10, 2, 64, 8192, 1728, 24)}
K, W_MAX, D_MAX, N_MAX = 10, 10, 10, 96  # bench_e2e's Cast: topk 10, width 10, depth 10, 96
PAGE, CTX, MAX_LEN = 16, 200, 1024
BASE = (2, 6, 16)
CHANGES = [(2, 7, 16), (2, 5, 16), (4, 6, 16), (10, 6, 16), (2, 6, 32), (2, 6, 48), (2, 6, 8)]
PLANNER_SET = [(2, 4, 8), (2, 6, 16), (4, 6, 32), (4, 8, 48), (8, 8, 64), (10, 10, 96)]

Key = tuple[str, str]  # (kernel, Triton's cache key)
_ALL: dict[Key, dict[str, str]] = {}  # every variant's parameters, as specialised
_CUR: set[Key] = set()  # the variants of the plan running now


class _Stub:
    """What a recorded compile returns: nothing launches it (compile_check's run is warm-up
    only)."""


def _record(self, key, signature, device, constexprs, options, attrs, warmup):
    desc = {}
    for i, (name, ty) in enumerate(signature.items()):
        if (i,) in constexprs:
            desc[name] = f"={constexprs[(i,)]}"
        else:
            div = any(a[0] == "tt.divisibility" for a in attrs.get((i,), []))
            desc[name] = ty + (" %16" if div else "")
    desc["<options>"] = f"warps={options.num_warps} stages={options.num_stages}"
    _ALL[(self.fn.__name__, key)] = desc
    _CUR.add((self.fn.__name__, key))
    self.device_caches[device][0][key] = kernel = _Stub()
    return kernel


class Step:
    """The buffers of one batch (``_StaticBatch``'s, at the pair's shapes) and one step's
    launches for a plan."""

    def __init__(self, pair: str, B: int):
        self.B = B
        H, Hq, Hkv, Dh, V, I, L = self.H, self.Hq, self.Hkv, self.Dh, self.V, self.I, self.L = (
            PAIRS[pair]
        )
        bf = self.dt = torch.bfloat16
        pages = -(-MAX_LEN // PAGE)
        self.bt = torch.arange(B * pages, dtype=torch.int32).view(B, pages)
        self.tk = torch.zeros(L, B * pages, PAGE, Hkv, Dh, dtype=bf)
        self.tv = torch.zeros_like(self.tk)
        self.dk = torch.zeros(1, B * pages, PAGE, Hkv, Dh, dtype=bf)
        self.dv = torch.zeros_like(self.dk)
        self.seq = torch.full((B,), CTX, dtype=torch.int32)
        self.embed = torch.zeros(V, H, dtype=bf)
        self.norm_w = torch.ones(H, dtype=bf)
        self.d_meta = torch.zeros(3, B, dtype=torch.int32)
        # the stores each plan views at its own row count (``_StaticBatch``)
        self.feat_store = torch.zeros(B * W_MAX * H, dtype=bf)
        self.logits_store = torch.zeros(B * W_MAX * V)
        self.c_tok_store = torch.zeros(B * N_MAX, dtype=torch.int64)
        self.c_feat_store = torch.zeros(B * N_MAX * H, dtype=bf)
        self.c_len = torch.zeros(B, dtype=torch.int32)
        self.stops = torch.tensor([0], dtype=torch.int64)
        self.remaining = torch.full((B,), 100, dtype=torch.int64)
        self.active = torch.ones(B, dtype=torch.bool)
        self.rates = torch.rand(SCORE_BINS)
        self.stats = torch.zeros(stats_size(D_MAX, W_MAX, N_MAX))

    # ------------------------------------------------------------------------------ forwards
    def layer(self, h, kc, vc, seq, tree, q_start=None, q_len=None, fwd=None):
        B, R = h.shape[:2]
        Hq, Hkv, Dh = self.Hq, self.Hkv, self.Dh
        qkv = torch.zeros(B, R, (Hq + 2 * Hkv) * Dh, dtype=self.dt)  # the fused q/k/v GEMM
        q = qkv[..., : Hq * Dh].unflatten(-1, (Hq, Dh))
        k = qkv[..., Hq * Dh : (Hq + Hkv) * Dh].unflatten(-1, (Hkv, Dh))
        v = qkv[..., (Hq + Hkv) * Dh :].unflatten(-1, (Hkv, Dh))
        if q_start is None:
            treeops.kv_append(k, v, kc, vc, self.bt, seq, tree.num_nodes, tree.depth, q=q)
            o = treeops.tree_attention(q, kc, vc, self.bt, seq, tree)
        else:
            base, rel = fwd
            treeops.kv_append(k, v, kc, vc, self.bt, base, q_len, rel, q=q)
            qf = torch.empty(B, tree.capacity, Hq, Dh, dtype=self.dt)
            o = treeops.tree_attention(qf, kc, vc, self.bt, seq, tree, q_start, q_len)
        x = torch.zeros(B, R, self.H, dtype=self.dt)
        x, h = fused.add_rmsnorm(x, torch.zeros_like(x), self.norm_w, 1e-6)
        fused.swiglu(torch.zeros(B, R, 2 * self.I, dtype=self.dt))
        return o

    def target(self, tree: treeops.Tree):
        """Verification: every node of ``tree`` (``_StaticBatch.verify_body``)."""
        _, h = fused.add_rmsnorm(self.embed, None, self.norm_w, 1e-6, tokens=tree.tokens)
        for i in range(self.L):
            self.layer(h, self.tk[i], self.tv[i], self.seq, tree)
            fused.add_rmsnorm(h, torch.zeros_like(h), self.norm_w, 1e-6)

    def draft(self, tokens, feats, tree, q_start=None, q_len=None):
        """``Draft.forward``: a frontier of R rows (with ``q_start``), or a whole chain."""
        R = tokens.shape[1]
        fwd = None
        if q_start is not None:
            _, _, base, rel = fused.tree_index(self.seq, tree.depth, q_start, R)
            fwd = (base, rel)
        fused.embed_cat(tokens, feats, self.embed, self.dt)
        x = torch.zeros(self.B, R, self.H, dtype=self.dt)
        _, h = fused.add_rmsnorm(x, None, self.norm_w, 1e-6)
        self.layer(h, self.dk[0], self.dv[0], self.seq, tree, q_start, q_len, fwd)
        fused.add_rmsnorm(x, torch.zeros_like(x), self.norm_w, 1e-6)

    # ------------------------------------------------------------------------------ one step
    def run(self, w: int, D: int, n: int) -> None:
        """One whole step of plan (w, D, n), as ``WholeStepBody`` launches it."""
        B = self.B
        pol = treeops.EagleStatic(depth=D, topk=K, budget=n, width=w)  # CastPlanner.policy_for
        st = treeops.DraftState.new(pol, torch.zeros(B, dtype=torch.int64), self.seq,
                                    self.active)  # fmt: skip
        vin = treeops.Tree.empty(B, n, "cpu")
        dtree = treeops.Tree.empty(B, 1 + max(D - 1, 1) * w, "cpu")  # PlanBuffers.dtree
        dtree.num_nodes = self.d_meta[0]
        feat = rows_view(self.feat_store, B, w, self.H)  # PlanBuffers.d_feat
        logits = rows_view(self.logits_store, B, w, self.V)  # PlanBuffers.d_logits
        tok = st.frontier_tokens
        for i in range(D):
            R = 1 if i == 0 else w
            self.draft(tok[:, :R], feat[:, :R], dtree, self.d_meta[1], self.d_meta[2])
            st.layer = i
            treeops.build_tree_expand(logits, st, pol)
        st.layer = D
        treeops.build_tree_emit(st, pol, out=vin)
        # verification at n nodes (verify_body's contiguous slices of vin)
        t = vin
        self.target(t)
        lg = torch.zeros(B, n, self.V)
        acc = treeops.accept_greedy(t, lg, stop_ids=self.stops, max_new_tokens=self.remaining)
        treeops.compact_kv(self.tk, self.tv, self.bt, self.seq, t, acc.accepted, acc.accept_len)
        # cast_step_stats's CUDA branch (no backend swap: it calls the launcher itself)
        step_stats_launch(
            st.cand_scores.float().contiguous(), t, acc.accepted, acc.accept_len, self.active,
            self.rates, self.stats, max_depth=D_MAX, max_width=W_MAX, capacity=N_MAX,
            bins=SCORE_BINS,
        )  # fmt: skip
        # catch-up over the accepted path: a chain of bucket(D + 1) nodes, capped at n
        R = min(n, bucket_for(D + 1, N_MAX))
        ch = treeops.Tree.empty(B, R, "cpu")
        ch.num_nodes = self.c_len
        c_tok = rows_view(self.c_tok_store, B, R)  # _StaticBatch.catchup_rows
        c_feat = rows_view(self.c_feat_store, B, R, self.H)
        self.draft(c_tok, c_feat, ch)


def variants(step: Step, plan: tuple[int, int, int]) -> set[Key]:
    """The variants one step of ``plan`` compiles, against empty caches."""
    from treeops.kernels import _launch

    _launch.clear_all()
    for fn in _jit_functions():
        fn.device_caches = collections.defaultdict(fn.create_binder)
    _CUR.clear()
    step.run(*plan)
    return set(_CUR)


def _jit_functions() -> list[JITFunction]:
    import gc
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated module attributes gc walks past
        return [o for o in gc.get_objects() if isinstance(o, JITFunction)]


def _why(new: dict[str, str], olds: list[dict[str, str]]) -> str:
    """The parameters whose specialisation differs from the nearest old variant's."""
    if not olds:
        return "(kernel not launched by the old plan)"
    best = min(olds, key=lambda o: sum(o.get(p) != v for p, v in new.items()))
    diff = [f"{p}: {best.get(p)} -> {v}" for p, v in new.items() if best.get(p) != v]
    return "; ".join(d.replace("=", "") for d in diff)


def compare(old: set[Key], new: set[Key]) -> dict[str, tuple[int, list[str]]]:
    by_kernel: dict[str, tuple[int, list[str]]] = {}
    for kname in sorted({k for k, _ in old | new}):
        olds = [_ALL[k] for k in old if k[0] == kname]
        added = [k for k in new - old if k[0] == kname]
        reasons = sorted({_why(_ALL[k], olds) for k in added})
        by_kernel[kname] = (len(added), reasons)
    return by_kernel


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=sorted(PAIRS), default="tiny")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--verbose", action="store_true", help="print every new variant's reason")
    args = ap.parse_args(argv)
    import bench_host
    import compile_check

    compile_check._install()  # sm_90 stand-in driver, H200 SM count, compile-only launches
    with bench_host.launchers_on_cpu():
        JITFunction._do_compile = _record
        step = Step(args.pair, args.batch)
        base = variants(step, BASE)
        per = {p: variants(step, p) for p in CHANGES}
        planner = [variants(step, p) for p in PLANNER_SET]
    print(f"pair {args.pair}, B = {args.batch}, K = {K}, Cast maxima W={W_MAX} D={D_MAX} "
          f"N={N_MAX}; plan (w, D, n) base {BASE}: {len(base)} variants")  # fmt: skip
    kernels = sorted({k for k, _ in base} | {k for s in per.values() for k, _ in s})
    head = "".join(f"{str(p):>12}" for p in CHANGES)
    print(f"\nnew variants vs base {BASE}, per kernel (variants in the base plan)\n")
    print(f"{'kernel':<24}{'base':>5}{head}")
    for kname in kernels:
        nb = sum(k == kname for k, _ in base)
        cells = "".join(f"{len({x for x in per[p] - base if x[0] == kname}):>12}" for p in CHANGES)
        print(f"{kname:<24}{nb:>5}{cells}")
    tot = "".join(f"{len(per[p] - base):>12}" for p in CHANGES)
    print(f"{'total':<24}{len(base):>5}{tot}")
    print("\nwhy (parameter: old -> new specialisation; =v a constexpr or a value-1 int)")
    for p in CHANGES:
        print(f"\n{BASE} -> {p}:")
        for kname, (count, reasons) in compare(base, per[p]).items():
            if count:
                shown = reasons if args.verbose else reasons[:3]
                more = f" (+{len(reasons) - len(shown)} more)" if len(reasons) > len(shown) else ""
                print(f"  {kname} +{count}: " + " | ".join(shown) + more)
    union = set().union(*planner)
    per_plan = [len(s) for s in planner]
    print(f"\na planner's visit of {len(PLANNER_SET)} plans {PLANNER_SET}: {per_plan} variants "
          f"per plan, {len(union)} distinct in all ({len(union) - per_plan[0]} beyond the "
          f"first plan's)")  # fmt: skip
    cnt = collections.Counter(k for k, _ in union)
    print("  per kernel: " + ", ".join(f"{k} {c}" for k, c in sorted(cnt.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
