"""Compile every Triton kernel of treeops for NVIDIA GPUs on a machine without a GPU.

The launchers run on CPU tensors of realistic shapes with the GPU's tile choices (the
interpreter's small tiles off), against a stand-in Triton driver that names the target
architecture (``--arch``, default 90: the H200) and reports that GPU's SM count. Each launch
compiles (Triton -> PTX -> ptxas cubin, with the ptxas that ships in the Triton wheel) and runs
nothing. For every distinct compiled kernel the script reads the cubin's resources with
``cuobjdump -res-usage`` and checks the architecture's limits:

* registers x threads <= 65536 (one block must fit an SM's register file);
* shared memory (Triton's dynamic + the cubin's static) <= the opt-in maximum per block
  (sm_80: 163 KiB; sm_86, sm_89, sm_120: 99 KiB; sm_90, sm_100: 227 KiB);
* register spills (``ptxas -v``: spill stores and loads, stack frame, bytes per thread):
  reported; not a failure (a speed matter);
* the SASS (``cuobjdump -sass``): its length, its MUFU.EX2 count and how many of those carry
  ``tl.exp``'s subnormal fix-up (``ex2_fixups``): reported, for kernels the SMs limit.

Each case then launches again under ``treeops.testing.NoHostSync``, as a CUDA graph captures
after a warm-up call: the launchers' host code, as it runs on the GPU, must not read a device
value, make a data-dependent shape or copy host data in (the first call may: compact_kv's layer
pointer table for a list of caches is built then, once, as documented).

What it proves: the kernels compile for the GPU as launched there, with their real tile sizes and
specialisations, and fit the SM. What it cannot prove: that they compute the right thing there or
how fast (the GPU tests, compute-sanitizer and the benchmarks do that on the H200).

    python bench/compile_check.py [--arch 90] [--quick] [--out bench/results/compile_sm90.json]

``--quick`` compiles one case per kernel family (the CPU test suite runs it).
``--attention-configs 64,128,256`` compiles every tree-attention sweep candidate instead
(registers, spills and shared memory of each: what ``bench_tree_attention.py --sweep`` times);
exit status 1 there if one breaks a limit or spills. Otherwise exit status 1 if
any launch failed to compile or synced, or a kernel breaks a limit. Must run without
``TRITON_INTERPRET``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from types import SimpleNamespace

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("compile_check.py compiles for the GPU: run it without TRITON_INTERPRET=1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from treeops.testing import NoHostSync  # noqa: E402

MAX_REGS_PER_SM = 65536
# arch: (a GPU of it, its SM count, opt-in shared memory per block in bytes; CUDA's tables)
ARCHS = {
    80: ("A100", 108, 166912),
    86: ("A10", 72, 101376),
    89: ("L40S", 142, 101376),
    90: ("H200", 132, 232448),
    100: ("B200", 148, 232448),
    120: ("RTX 5090", 170, 101376),
}
ARCH = 90  # set by main


class _Driver:
    """The parts of Triton's driver that compiling (not launching) asks for."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", ARCH, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


_COMPILED: list = []  # (kernel name, CompiledKernel) per launch, in order


def _install() -> None:
    """Point Triton at ``ARCH``, make every launch compile-only and give the launchers' SM-count
    and shared-memory queries that GPU's figures."""
    name, sms, shared = ARCHS[ARCH]
    driver.set_active(_Driver())
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        _COMPILED.append((self.fn.__name__, kernel))
        return kernel

    JITFunction.run = compile_only
    props = SimpleNamespace(
        multi_processor_count=sms,
        shared_memory_per_block_optin=shared,
        name=f"NVIDIA {name} (sm_{ARCH} target)",
    )
    torch.cuda.get_device_properties = lambda *a, **k: props
    from treeops import _runtime
    from treeops.kernels import accept, build_tree_tiling, graft_update

    # every launcher asks the SM count through treeops._runtime; the vocabulary-split choices
    # also take the GPU-only branch, as the launchers would for CUDA tensors
    _runtime.sm_count = lambda device: sms
    # the Gluon attention forward launches on Hopper only: compile it for sm_90 from CPU tensors
    from treeops.kernels import tree_attention_gluon

    tree_attention_gluon.device_ok = lambda q: ARCH == 90
    _runtime.shared_memory = lambda device: shared
    gpu = torch.device("cuda", 0)
    for mod, fn, at in (
        (accept, "default_splits", 3),  # (B, N, V, device, block_v)
        (build_tree_tiling, "_default_split", 3),  # (rows, V, block_v, device)
        (graft_update, "_splits", 3),  # (n_flat, V, block_v, device)
        (graft_update, "_rank_all", 1),  # (n_flat, device)
        (graft_update, "_rank_warps", 1),  # (n_flat, device)
    ):
        orig = getattr(mod, fn)
        setattr(mod, fn, lambda *a, _f=orig, _i=at, **kw: _f(*a[:_i], gpu, *a[_i + 1 :], **kw))


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _run(args: list[str], data: bytes | str, suffix: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=suffix, mode="wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        p = subprocess.run([*args, f.name], capture_output=True, text=True, check=True)
    return p.stdout + p.stderr


def resources(kernel) -> dict:
    """Registers, stack frame, spills and shared memory of a compiled kernel: ``cuobjdump
    -res-usage`` on its cubin (registers, static shared memory), ``ptxas -v`` on its PTX for the
    same architecture (stack frame, spill stores and loads, bytes per thread)."""
    text = _run([_tool("cuobjdump"), "-res-usage"], kernel.asm["cubin"], ".cubin")
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if m is None:
        raise RuntimeError(f"no resource line in cuobjdump output:\n{text}")
    reg, _, static_shared, _ = map(int, m.groups())
    ptxas = _tool("ptxas-blackwell" if ARCH >= 100 else "ptxas")
    gpu = f"sm_{ARCH}" + ("a" if ARCH >= 90 else "")  # as Triton names it
    text = _run([ptxas, "-v", "--gpu-name", gpu, "-o", os.devnull], kernel.asm["ptx"], ".ptx")
    m = re.search(
        r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text
    )
    if m is None:
        raise RuntimeError(f"no stack/spill line in ptxas -v output:\n{text}")
    stack, spill_st, spill_ld = map(int, m.groups())
    sass = [
        line
        for line in _run([_tool("cuobjdump"), "-sass"], kernel.asm["cubin"], ".cubin").splitlines()
        if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)
    ]
    md = kernel.metadata
    threads = md.num_warps * 32
    row = {
        "num_warps": md.num_warps,
        "num_stages": md.num_stages,
        "regs": reg,
        "threads": threads,
        "stack_bytes": stack,
        "spill_store_bytes": spill_st,
        "spill_load_bytes": spill_ld,
        "shared_bytes": md.shared + static_shared,
        # the instruction mix a kernel's time comes from where the SMs, not HBM, limit it: its
        # SASS length, its MUFU.EX2s, and the subnormal fix-ups ``tl.exp`` adds to an ex2 (a
        # compare with -126 and two predicated multiplies; ``tl.exp2`` has none)
        "sass_instructions": len(sass),
        "ex2": sum("MUFU.EX2" in line for line in sass),
        "ex2_fixups": sum(re.search(r"FSETP\.GEU\.AND .*-126", line) is not None for line in sass),
        # global loads of one 16-bit element: where a kernel streams bf16/fp16 rows, its loads
        # should be 16-byte vectors (LDG.E.128); these mean the compiler could not prove the
        # alignment and contiguity that needs
        "ldg_16bit_scalar": sum(re.search(r"LDG\.E\.[US]16 ", line) is not None for line in sass),
    }
    row["problems"] = [
        p
        for p, bad in (
            (
                f"{reg} regs x {threads} threads > {MAX_REGS_PER_SM}",
                reg * threads > MAX_REGS_PER_SM,
            ),
            (
                f"{row['shared_bytes']} B shared > {ARCHS[ARCH][2]}",
                row["shared_bytes"] > ARCHS[ARCH][2],
            ),
        )
        if bad
    ]
    return row


# ---------------------------------------------------------------------------------------- cases
# Each case builds CPU inputs and calls a launcher the way the public op does on the GPU.
G = torch.Generator().manual_seed(0)


def _tree(B: int, N: int, n: int, V: int):
    import treeops

    par = torch.full((B, N), -1, dtype=torch.int32)
    for i in range(1, n):
        par[:, i] = torch.randint(0, i, (B,), generator=G, dtype=torch.int32)
    tok = torch.randint(0, V, (B, N), generator=G)
    scores = torch.sort(torch.rand(B, N, generator=G), dim=1, descending=True).values
    return treeops.Tree.from_parents(par, torch.full((B,), n, dtype=torch.int32), tok, scores)


def attention(B, N, hq, hkv, d, ctx, page, dtype=torch.bfloat16, lse=True, qrange=False,
              override=None):  # fmt: skip
    def case():
        from treeops.kernels import tree_attention as ta

        pages = -(-(ctx + N) // page)
        q = torch.randn(B, N, hq, d, dtype=dtype, generator=G)
        kc = torch.zeros(B * pages, page, hkv, d, dtype=dtype)
        bt = torch.arange(B * pages, dtype=torch.int32).view(B, pages)
        seq = torch.full((B,), ctx, dtype=torch.int32)
        tree = _tree(B, N, N, 1000)
        qs = torch.zeros(B, dtype=torch.int32) if qrange else None
        ql = torch.full((B,), N, dtype=torch.int32) if qrange else None
        out = torch.empty_like(q)
        lse_t = torch.empty(B, N, hq) if lse else None
        vc = kc.clone()
        # the public op's CUDA branch (on CPU tensors it would run the reference)
        return lambda: ta.tree_attention_fwd(
            q, kc, vc, bt, seq, tree.num_nodes, tree.anc, qs, ql, d**-0.5, out, lse_t,
            override=override,
        )  # fmt: skip

    return f"tree_attention B={B} N={N} {hq}/{hkv} D={d} ctx={ctx} page={page} {dtype} " + (
        f"lse={lse} qrange={qrange}" + (f" {override}" if override else "")
    ), case


def kv_append(B, N, hkv, d, page, depth=True, dtype=torch.bfloat16, hq=0):
    """``hq`` > 0: with queries (the HAS_Q variant), q/k/v as views of one fused QKV output."""

    def case():
        from treeops.kernels.kv_append import kv_append_fwd

        pages = -(-(4096 + N) // page)
        kc = torch.zeros(B * pages, page, hkv, d, dtype=dtype)
        bt = torch.arange(B * pages, dtype=torch.int32).view(B, pages)
        seq = torch.full((B,), 4096, dtype=torch.int32)
        nt = torch.full((B,), N, dtype=torch.int32)
        dep = torch.zeros(B, N, dtype=torch.int32) if depth else None
        vc = kc.clone()
        if hq:
            qkv = torch.randn(B, N, (hq + 2 * hkv) * d, dtype=dtype, generator=G)
            q = qkv[..., : hq * d].unflatten(-1, (hq, d))
            k = qkv[..., hq * d : (hq + hkv) * d].unflatten(-1, (hkv, d))
            v = qkv[..., (hq + hkv) * d :].unflatten(-1, (hkv, d))
            return lambda: kv_append_fwd(k, v, kc, vc, bt, seq, nt, dep, 10000.0, q)
        k = torch.randn(B, N, hkv, d, dtype=dtype, generator=G)
        v = k.clone()
        return lambda: kv_append_fwd(k, v, kc, vc, bt, seq, nt, dep, 10000.0)

    name = f"kv_append B={B} N={N} hkv={hkv} D={d} page={page} depth={depth} {dtype}"
    return name + (f" hq={hq}" if hq else ""), case


def rope(B, N, hq, d, dtype=torch.bfloat16):
    def case():
        from treeops.kernels.kv_append import rope_fwd

        # q as a view of a fused QKV output (row stride (hq + 2 * 8) * d), as the decoder passes it
        x = torch.randn(B, N, (hq + 16) * d, dtype=dtype, generator=G)[..., : hq * d]
        x = x.view(B, N, hq, d)
        pos = torch.full((B, N), 4096, dtype=torch.int64)
        y = torch.empty(B, N, hq, d, dtype=dtype)
        return lambda: rope_fwd(x, pos, 10000.0, y)

    return f"rope B={B} N={N} hq={hq} D={d} {dtype}", case


def build(kind, B, V, N, dtype=torch.bfloat16, **tuning):
    def case():
        import treeops
        from treeops.build_tree import _launch_emit, _launch_expand
        from treeops.kernels.draft_reset import reset

        sys.path.insert(0, os.path.dirname(__file__))
        import bench_build_tree as btc

        table = btc.synthetic_table()
        pol = btc.make_policy(kind, N, table)
        roots, seq = torch.randint(0, V, (B,), generator=G), torch.full((B,), 4000)
        st = treeops.DraftState.new(pol, roots, seq)
        logits = [torch.randn(B, 1 if i == 0 else btc.W, V, generator=G).to(dtype) for i in
                  range(btc.DEPTH)]  # fmt: skip

        def launch():
            reset(st, roots, seq, None)  # DraftState.reset's CUDA branch
            for i in range(btc.DEPTH):
                st.layer = i
                _launch_expand(logits[i], st, pol, **tuning)  # the public op's CUDA branch
            st.layer = btc.DEPTH
            _launch_emit(st, pol)

        return launch

    extra = "".join(f" {k}={v}" for k, v in tuning.items())
    return f"build {kind} B={B} V={V} N={N} {dtype}{extra}", case


def with_pdl(named_case, mode: int = 1):
    """A case with every launch that supports it taking programmatic dependent launch
    (kernels/_pdl.py), as ``TREEOPS_PDL=1`` (``mode`` 1, the next kernel released late) or
    ``early`` (2) makes it on an sm_90 GPU: the griddepcontrol variants compiled."""
    name, case = named_case

    def pdl_case():
        from treeops.kernels import _pdl
        from treeops.kernels import accept as ka
        from treeops.kernels import build_tree as kb
        from treeops.kernels import graft_update as kg
        from treeops.kernels import tree_attention as ta

        launch = case()
        # the launchers that ask use_pdl by name, and those that ask through _pdl.pdl_options
        users = (ka, kb, kg, ta, _pdl)

        def run():
            saved = [m.use_pdl for m in users]
            for m in users:
                m.use_pdl = lambda device, default=0: mode
            ka._PLANS.clear()  # plans keep their launch options
            ta._PLANS.clear()
            try:
                return launch()
            finally:
                for m, f in zip(users, saved):
                    m.use_pdl = f
                ka._PLANS.clear()
                ta._PLANS.clear()

        return run

    return name + (" pdl" if mode == 1 else " pdl early"), pdl_case


def pdl_cases() -> list:
    """Every launcher's kernels as ``TREEOPS_PDL=1`` launches them (one case of each); none
    below sm_90, which has no griddepcontrol (``kernels._pdl.use_pdl`` never takes PDL there)."""
    if ARCH < 90:
        return []
    return [with_pdl(build("eagle", 8, 32000, 64)), with_pdl(build("eagle", 8, 32000, 64), 2),
            with_pdl(graft("update_128", 8, 128256)),
            with_pdl(accept("sample", 1, 128256, k=50, p=0.9)),
            with_pdl(accept("sample_plain", 1, 32000)), with_pdl(accept("greedy", 8, 32000)),
            with_pdl(attention(1, 64, 32, 8, 128, 32768, 16)),
            with_pdl(kv_append(4, 64, 8, 128, 16, hq=32)), with_pdl(rope(4, 64, 32, 128)),
            with_pdl(compact(8, 4, 8, 128, 16)), with_pdl(compact(8, 4, 8, 128, 16, stacked=False)),
            with_pdl(graft("retrieve_merge", 8, 32000)), with_pdl(graft("retrieve", 8, 32000)),
            with_pdl(graft("tail", 8, 32000)),
            with_pdl(prune(8, 64)), with_pdl(cast(8, 100, 10)),
            with_pdl(cast_stats(8, 4, 20))]  # fmt: skip


def accept(op, B, V, N=64, k=0, p=1.0, logprobs=False, topk_ids=0, phase=0, ahead=1, **tune):
    def case():
        from treeops.kernels.accept import accept_launch

        tree = _tree(B, N, N, V)
        lg = torch.randn(B, N, V, generator=G).to(torch.bfloat16)
        kw: dict = {}
        if op in ("sample", "sample_plain", "sample_topp"):
            kw = dict(
                temperature=torch.full((B,), 0.8),
                top_k=torch.full((B,), k, dtype=torch.int32),
                top_p=torch.full((B,), p),
                uniforms=torch.rand(B, N, generator=G),
            )
            if op == "sample_plain":  # no top-k / top-p tensors: no kept-set pass
                kw.update(top_k=None, top_p=None)
            if op == "sample_topp":  # top-p alone: top-k off for every request
                kw.update(top_k=None)
        stops = torch.tensor([0], dtype=torch.int64)
        budget = torch.full((B,), 100, dtype=torch.int32)
        return lambda: accept_launch(
            tree,
            lg,
            stop_ids=stops,
            max_new_tokens=budget,
            return_logprobs=logprobs,
            topk_ids=topk_ids,
            phase=phase,
            ahead=ahead,
            **kw,
            **tune,
        )

    return (
        f"accept {op} B={B} V={V} N={N} top_k={k} top_p={p} logprobs={logprobs} "
        f"topk_ids={topk_ids} phase={phase}"
        + (f" ahead={ahead}" if ahead != 1 else "")
        + "".join(f" {a}={b}" for a, b in tune.items())
    ), case


def compact(B, layers, hkv, d, page, stacked=True):
    def case():
        from treeops.kernels.compact_kv import compact_kv_launch

        pages = -(-(4096 + 64) // page)
        shape = (B * pages, page, hkv, d)
        if stacked:
            kc = torch.zeros(layers, *shape, dtype=torch.bfloat16)
            vc = kc.clone()
        else:
            kc = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(layers)]
            vc = [x.clone() for x in kc]
        bt = torch.arange(B * pages, dtype=torch.int32).view(B, pages)
        acc = torch.tensor([0, 2, 5, 9, 14], dtype=torch.int32).repeat(B, 1)
        seq = torch.full((B,), 4096, dtype=torch.int32)
        alen = torch.full((B,), 5, dtype=torch.int32)
        return lambda: compact_kv_launch(kc, vc, bt, seq, acc, alen)

    return f"compact_kv B={B} L={layers} hkv={hkv} D={d} page={page} stacked={stacked}", case


def graft(op, B, V, N=60, k=8):
    def case():
        import treeops
        from treeops.kernels import graft as kg
        from treeops.kernels import graft_update as kgu

        table = torch.randint(-1, V, (V, k), generator=G, dtype=torch.int32)
        tpl = treeops.RankTemplate.default()
        par, rank, dep = tpl.tensors(torch.device("cpu"))
        if op == "retrieve_merge":
            tree = _tree(B, N, 24, V)
            return lambda: kg.graft_fused(
                tree,
                N,
                table=table,
                t_parents=par,
                t_ranks=rank,
                t_depth=dep,
                max_depth=tpl.max_depth,
                level_width=tpl.max_width,
            )
        elif op == "retrieve":
            roots = torch.randint(0, V, (B,), generator=G)
            return lambda: kg.retrieve(table, roots, par, rank, dep, tpl.max_depth, None)
        elif op == "tail":
            from treeops.kernels import graft_tail as kt

            tree = _tree(B, N, 24, V)
            return lambda: kt.graft_tail(tree, table, 8, N, 8)
        # update from logits, and from acceptance's top-k ids
        owner = torch.full((V,), kgu.INT32_MAX, dtype=torch.int32)
        tree = _tree(B, N, N, V)
        lg = torch.randn(B, N, V, generator=G).to(torch.bfloat16)
        ids = torch.randint(0, V, (B, N, k), generator=G, dtype=torch.int32)
        ws: dict = {}

        block_max = int(op.split("_")[1]) if op.startswith("update_") else 0

        def launch():
            # "update_M": the block-maxima method with M logits a block
            saved = kgu.UPDATE_TUNING.get("block_max", 0)
            kgu.UPDATE_TUNING["block_max"] = block_max
            try:
                kgu.adjacency_update(table, owner, ws, tree.tokens, tree.num_nodes, lg, None, False)
                kgu.adjacency_update(table, owner, ws, tree.tokens, tree.num_nodes, None, ids, True)
            finally:
                kgu.UPDATE_TUNING["block_max"] = saved

        return launch

    return f"graft {op} B={B} V={V} budget={N}", case


def prune(B, N, keep_tensor=True):
    def case():
        from treeops.kernels import prune as kp

        tree = _tree(B, N, N, 1000)
        out = tuple(torch.empty_like(t) for t in tree.tensors())
        keep = torch.randint(0, N, (B,), generator=G, dtype=torch.int32)
        best, stop = torch.rand(B, generator=G), torch.empty(B, dtype=torch.bool)

        def launch():
            kp.prune(tree.tensors(), keep if keep_tensor else None, 24, out)
            kp.checkpoint(keep, best, 24, 0.3, stop)

        return launch

    return f"prune B={B} N={N} keep_tensor={keep_tensor}", case


def cast(B, M, K, dtype=torch.float32):
    def case():
        from treeops import cast as ops

        scores = torch.rand(B, M, generator=G).to(dtype)
        scores[:, M // 2 :] = -1.0  # no candidate
        costs = torch.cumsum(torch.rand(K, generator=G) + 0.5, 0)
        active = torch.rand(B, generator=G) < 0.8
        u_hist = torch.rand(8, generator=G)
        width = ops._utility_cuda(ops._k.cast_width_launch, None, root=False)
        rerank = ops._utility_cuda(ops._k.cast_rerank_launch, None, root=True)
        table = torch.stack([costs * (1 + i) for i in range(4)])  # per context bucket
        seq = torch.full((B,), 300, dtype=torch.int32)
        w = torch.tensor(1, dtype=torch.int32)

        def launch():  # the ops' CUDA backends, with cost vectors and per-context tables
            width(scores, costs, 0.3, active)
            rerank(scores, costs, 0.1, None)
            width(scores, table, 0.3, active, seq, 128, table[:, 0])
            rerank(scores, table, 0.1, None, seq, 128, None)
            ops._select_cuda(torch.cumsum(costs, 0), costs, 0.5)
            ops._depth_cuda(u_hist, costs[0], 1.0, 4)
            ops._depth_cuda(u_hist, table, 1.0, 4, seq, 128, table[:, 0], w)

        return launch

    return f"cast_ops B={B} M={M} K={K} {dtype}", case


def cast_stats(B, d, C, D=10, W=10, N=96, graft=False):
    def case():
        from treeops.cast_stats import SCORE_BINS, stats_size
        from treeops.kernels.cast_plan import step_stats_launch

        n = N
        scores = torch.rand(B, d, C, generator=G)
        tree = _tree(B, n, n, 1000)
        acc = torch.zeros(B, n, dtype=torch.int32)
        alen = torch.ones(B, dtype=torch.int32)
        active = torch.ones(B, dtype=torch.bool)
        rates = torch.rand(SCORE_BINS, generator=G)
        out = torch.zeros(stats_size(D, W, N, graft=graft))
        grafted = torch.ones(B, dtype=torch.int32) if graft else None

        def launch():
            step_stats_launch(scores, tree, acc, alen, active, rates, out, max_depth=D,
                              max_width=W, capacity=N, bins=SCORE_BINS,
                              grafted=grafted)  # fmt: skip

        return launch

    return f"cast_step_stats B={B} d={d} C={C} D={D} W={W} N={N} graft={graft}", case


def decoder_fused(B, R, H, I, V, w=10, D=10, dtype=torch.bfloat16):
    """The example decoder's fused kernels (``treeops.decoder.fused``) at one forward's shapes:
    the residual add + RMSNorm (with a delta, without, gathering the embedding), SwiGLU, the
    draft's fc input, the index math (a whole tree and a frontier of ``w`` rows) and the draft's
    frontier inputs over a working tree of ``1 + (D - 1) w`` nodes."""

    def case():
        from treeops.decoder import fused
        from treeops.tree import anc_words

        x = torch.randn(B, R, H, generator=G).to(dtype)
        weight = torch.ones(H, dtype=dtype)
        table = torch.randn(V, H, generator=G).to(dtype)
        tokens = torch.randint(0, V, (B, R), generator=G)
        gu = torch.randn(B, R, 2 * I, generator=G).to(dtype)
        seq = torch.full((B,), 300, dtype=torch.int32)
        nd = 1 + (D - 1) * w
        depth = torch.zeros(B, nd, dtype=torch.int32)
        anc = torch.zeros(B, nd, anc_words(nd), dtype=torch.int32)
        bits = torch.zeros(nd, anc_words(nd), dtype=torch.int32)
        hid = torch.randn(B, nd, H, generator=G).to(dtype)
        feat = torch.empty(B, w, H, dtype=dtype)
        frontier = torch.randint(-1, w * 10, (B, w), generator=G, dtype=torch.int32)
        cand = torch.zeros(D * w * 10 + 1, dtype=torch.int64)
        meta = torch.zeros(3, B, dtype=torch.int32)
        q_start = torch.ones(B, dtype=torch.int32)

        def launch():
            fused.add_rmsnorm(x, x, weight, 1e-6)
            fused.add_rmsnorm(x, None, weight, 1e-6)
            fused.add_rmsnorm(table, None, weight, 1e-6, tokens=tokens)
            fused.swiglu(gu)
            fused.embed_cat(tokens, x, table, dtype)
            fused.tree_index(seq, depth)
            fused.tree_index(seq, depth, q_start, w)
            fused.frontier_inputs(frontier, cand, 1, depth, anc, bits, hid, feat, meta,
                                  meta.clone())  # fmt: skip

        return launch

    return f"decoder_fused B={B} R={R} H={H} I={I} V={V} w={w} {dtype}", case


def _gluon_candidates() -> list[tuple[int, dict]]:
    """(head dim, override) of every tree-attention sweep candidate that takes the Gluon
    forward."""
    from treeops.kernels import tree_attention as ta

    return [(d, ov) for d, c in ta.CANDIDATES.items() for ov in c.values() if ov.get("gluon")]


def cases(quick: bool) -> list[tuple[str, Callable[[], Callable[[], object]]]]:
    bf, fp = torch.bfloat16, torch.float16
    if quick:
        return [
            attention(4, 64, 32, 8, 128, 4096, 16),
            attention(1, 64, 32, 8, 128, 32768, 16),  # split-KV + merge
            attention(2, 64, 32, 8, 64, 2048, 16),  # every head dim's tile
            attention(2, 64, 32, 8, 256, 2048, 16),
            # grids of a full wave: the tiles TUNED routes them to, at every head dim
            attention(8, 64, 32, 8, 128, 4096, 16),
            attention(32, 64, 32, 8, 64, 2048, 16),
            attention(32, 64, 16, 4, 256, 2048, 16),
            # the Gluon forward (kernels/tree_attention_gluon.py): every candidate, split and
            # unsplit (ptxas allocates them differently)
            *[
                attention(B, 64, 32, 8, d, 2048, 16, override=ov)
                for d, ov in _gluon_candidates()
                for B in (2, 32)
            ],
            kv_append(4, 64, 8, 128, 16),
            kv_append(4, 64, 8, 128, 16, hq=32),
            rope(4, 64, 32, 128),
            build("cast", 8, 32000, 64),
            *pdl_cases(),
            accept("greedy", 8, 32000),
            accept("sample", 8, 32000, k=50, p=0.9),
            compact(8, 4, 8, 128, 16),
            compact(8, 4, 8, 128, 16, stacked=False),
            graft("retrieve_merge", 8, 32000),
            graft("retrieve", 8, 32000),
            graft("tail", 8, 32000),
            graft("update", 8, 32000),
            graft("update_128", 8, 32000),
            prune(8, 64),
            cast(8, 100, 10),
            cast_stats(8, 4, 20),
            decoder_fused(8, 10, 640, 1728, 8192),
        ]
    out = []
    # tree attention: docs/benchmarks.md's shapes and its grid's corners, every head dim, GQA
    # ratio, dtype, page size (one page per request too), LSE and query-range variant; split-KV on
    for B, ctx, n in [
        (1, 512, 16),
        (4, 4096, 64),
        (16, 4096, 128),
        (64, 32768, 64),
        (1, 131072, 64),
        (1, 32768, 128),
    ]:
        out.append(attention(B, n, 32, 8, 128, ctx, 16))
    for d in (64, 128, 256):
        for hq, hkv in ((8, 8), (32, 8), (64, 8)):
            out.append(attention(2, 64, hq, hkv, d, 2048, 16))
    for page in (1, 64, 4096 + 64):
        out.append(attention(2, 64, 32, 8, 128, 4096, page))
    out += [
        attention(2, 64, 32, 8, 128, 4096, 16, dtype=fp),
        attention(2, 64, 32, 8, 128, 4096, 16, lse=False),
        attention(2, 10, 32, 8, 128, 4096, 16, qrange=True),
        *(
            attention(1, 64, 32, 8, d, 4096, 16, override={"fused_merge": True})
            for d in (64, 128, 256)
        ),
        # 16-bit partial outputs, merged by _merge_splits or by the tile's last chunk
        *(
            attention(1, 64, 32, 8, 128, 4096, 16, override={"partial_half": True, **fused})
            for fused in ({}, {"fused_merge": True})
        ),
        attention(1, 10, 32, 8, 256, 65536, 16, dtype=fp, qrange=True),
    ]
    for d in (64, 128, 256):
        for dt in (bf, fp):
            out.append(kv_append(4, 64, 8, d, 16, dtype=dt))
    out += [kv_append(4, 10, 8, 128, 16, depth=False), kv_append(1, 1, 8, 128, 1)]
    # with queries (the decoder's call): every head dim, GQA 1 / 4 / 8, both 16-bit dtypes
    for d in (64, 128, 256):
        out.append(kv_append(4, 64, 8, d, 16, hq=32))
    out += [
        kv_append(4, 64, 8, 128, 16, dtype=fp, hq=32),
        kv_append(4, 64, 8, 128, 16, hq=8),
        kv_append(4, 64, 8, 128, 16, hq=64),
        kv_append(4, 10, 8, 128, 16, depth=False, hq=32),
    ]
    for d in (64, 128, 256):
        out += [rope(4, 64, 32, d), rope(1, 1, 10, d, dtype=fp)]
    # tree build: both policies, both vocabularies, small and large batches (tile sizes change
    # with B x W), budgets on both sides of the rerank's 64-node tile switch, fp32 logits
    for kind in ("eagle", "cast"):
        for B, V in ((1, 32000), (64, 128256)):
            out.append(build(kind, B, V, 64))
        out.append(build(kind, 8, 32000, 128))
        out.append(build(kind, 8, 32000, 32, dtype=torch.float32))
    # a max per block of a tile (max_block), its blocks re-read several at a time
    for B, V, mb, tiles in ((1, 32000, 64, 8), (64, 32000, 128, 4), (64, 128256, 32, 8)):
        out.append(build("eagle", B, V, 64, max_block=mb, cand_tiles=tiles))
    # the K best blocks and the ranked candidates by tl.topk (the sweep's alternatives)
    for B, V in ((1, 32000), (64, 32000)):
        out.append(build("eagle", B, V, 64, blocks_topk=True, rank_topk=True))
    # the stream's max and sum per tile, two or three tiles in flight (the sweep's alternatives
    # to a max and sum per vector)
    for B, V, ahead in ((64, 32000, 2), (1, 128256, 2), (64, 32000, 3), (8, 128256, 3)):
        out.append(build("eagle", B, V, 64, stream_lanes=False, stream_ahead=ahead))
    # the candidates' tile reads issued one at a time (the sweep's alternative to one ahead)
    for B, V in ((1, 32000), (64, 32000), (64, 128256)):
        out.append(build("eagle", B, V, 64, cand_ahead=False))
    # two-warp streaming programs (each warp its own vectors: with per-vector statistics only the
    # chunk's last reduction crosses warps), fewer chunks a row so that one wave holds them
    for B, V, bv, split in ((64, 32000, 1024, 4), (64, 32000, 512, 5), (32, 32000, 1024, 8)):
        out.append(build("eagle", B, V, 64, block_v=bv, num_warps=2, split=split))
    out += pdl_cases()
    # acceptance: greedy and sampling over both vocabularies, the top-k/top-p, logprob and
    # top-k-id variants, and the two-launch fallback
    for V in (32000, 128256):
        for B in (1, 64):
            out.append(accept("greedy", B, V))
            out.append(accept("sample", B, V))
    out += [
        accept("sample", 8, 32000, k=50, p=0.9),
        accept("sample", 8, 32000, k=0, p=0.9, logprobs=True),
        accept("greedy", 8, 32000, logprobs=True, topk_ids=8),
        accept("sample", 8, 128256, topk_ids=8),
        accept("greedy", 8, 32000, phase=1),
        accept("sample", 8, 32000, k=50, phase=1),
        # pass 1 with the next block loaded ahead (the sweep's alternative), where it is meant
        # to pay: launches too small to fill the memory pipeline
        *(accept(op, 1, V, ahead=2) for op in ("greedy", "sample") for V in (32000, 128256)),
        accept("sample", 1, 128256, k=50, p=0.9, ahead=2),
        accept("greedy", 8, 32000, topk_ids=8, ahead=2),
        # sampling without top-k / top-p tensors: one launch (pass 1's last program walks) at
        # B * N < 512, pass 1 and the walk from it
        *(accept("sample_plain", B, V) for B in (1, 8) for V in (32000, 128256)),
        accept("sample_plain", 1, 32000, logprobs=True, topk_ids=8),
        accept("sample_topp", 8, 32000, p=0.9),
        # large trees: the walker's [nodes, nodes] tiles (duplicate siblings)
        accept("greedy", 1, 32000, N=256),
        accept("sample", 1, 32000, N=256, k=50, p=0.9),
        # the kept-set pass's reread tile x warps (bench_accept.py --sweep-top)
        *(
            accept("sample", 64, 32000, k=50, p=0.9, reread=r, pass2_warps=w)
            for r in (256, 1024)
            for w in (4, 8)
        ),
        accept("sample", 64, 32000, k=50, p=0.9, pass2_warps=8),
    ]
    for d in (64, 128, 256):
        out.append(compact(8, 32, 8, d, 16))
    out += [compact(8, 32, 8, 128, 16, stacked=False), compact(1, 4, 8, 128, 1)]
    for B, V in ((1, 32000), (64, 128256)):
        for op in ("retrieve_merge", "retrieve", "tail", "update", "update_64", "update_128"):
            out.append(graft(op, B, V))
    out.append(graft("update_128", 1, 128256))  # the update's default at B 1, V 128,256
    out += [prune(1, 8, keep_tensor=False), prune(64, 256), prune(8, 2048)]  # 1-2 tiles
    # CAST's standalone ops: bench_cast's shapes (width: 100 candidates, K = 10; rerank: 800,
    # K = 64), a large batch, a tree capacity of 256 and the largest tile, 16-bit scores
    for B, M, K in ((1, 100, 10), (64, 100, 10), (64, 800, 64), (8, 2048, 256), (2, 4096, 2048)):
        out.append(cast(B, M, K))
    out.append(cast(8, 800, 64, dtype=torch.bfloat16))
    # λ-CAST's step statistics: the planner's largest plan (depth 10 of 10 rows of 10) and a
    # chain-like one
    out += [cast_stats(64, 10, 100), cast_stats(1, 6, 10), cast_stats(64, 10, 100, graft=True)]
    # the example decoder's fused kernels: the trained pair's shapes (d = 640, a 96-node
    # verification), an 8B-class layer, fp32 features
    out += [decoder_fused(64, 96, 640, 1728, 8192), decoder_fused(1, 1, 640, 1728, 8192, w=1),
            decoder_fused(8, 64, 4096, 14336, 128256),
            decoder_fused(4, 10, 640, 1728, 8192, dtype=torch.float32)]  # fmt: skip
    return out


def attention_configs(head_dims: list[int]) -> list[dict]:
    """Every tree-attention sweep candidate (``CANDIDATES`` of the head dim, then the small-tree
    path at N = 8 and 16) compiled for ``ARCH`` at B = 2, N = 64, 32/8 heads, ctx 2048 (small
    tree: B = 1, ctx 512), bf16: registers, spills and shared memory of each (what the GPU sweep
    times)."""
    from treeops.kernels import tree_attention as ta

    rows = []
    for d in head_dims:
        cands = [(n, ov, 2, 64, 2048) for n, ov in ta.CANDIDATES[ta.head_dim_class(d)].items()]
        cands += [("small", {"small_tree": True}, 1, n, 512) for n in (8, 16)]
        for name, ov, B, N, ctx in cands:
            hq, hkv, page = 32, 8, 16
            pages = -(-(ctx + N) // page)
            q = torch.randn(B, N, hq, d, dtype=torch.bfloat16, generator=G)
            kc = torch.zeros(B * pages, page, hkv, d, dtype=torch.bfloat16)
            bt = torch.arange(B * pages, dtype=torch.int32).view(B, pages)
            seq = torch.full((B,), ctx, dtype=torch.int32)
            tree = _tree(B, N, N, 1000)
            out, lse = torch.empty_like(q), torch.empty(B, N, hq)
            cfg = ta.config_for(q, kc, bt, None, ov)
            start = len(_COMPILED)
            ta.tree_attention_fwd(
                q, kc, kc.clone(), bt, seq, tree.num_nodes, tree.anc, None, None, d**-0.5, out,
                lse, override=ov,
            )  # fmt: skip
            fwd = ("_tree_attn_fwd", "_tree_attn_fwd_gluon")
            kernel = next(k for n, k in _COMPILED[start:] if n in fwd)
            rows.append(
                {"D": d, "candidate": name, "B": B, "N": N, "ctx": ctx, "block_m": cfg.block_m,
                 "block_n": cfg.block_n, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                 "prefetch": cfg.prefetch, "pipe": cfg.pipe, "num_splits": cfg.num_splits,
                 **resources(kernel)}
            )  # fmt: skip
            r = rows[-1]
            print(
                f"D={d:<3} {name:<11} N={N:<3} {cfg.block_m:>3}x{cfg.block_n:<3} "
                f"{cfg.num_warps} warps pipe={cfg.pipe} stages={cfg.num_stages} "
                f"prefetch={cfg.prefetch!s:<5} splits={cfg.num_splits:<2} regs {r['regs']:>3} "
                f"spill {r['spill_store_bytes']:>4}/{r['spill_load_bytes']:<4} "
                f"shared {r['shared_bytes']:>6}"
                + (f"  PROBLEM: {'; '.join(r['problems'])}" if r["problems"] else ""),
                flush=True,
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one case per kernel family")
    ap.add_argument("--arch", type=int, default=90, choices=sorted(ARCHS), help="sm_XX target")
    ap.add_argument("--only", help="only the cases whose name contains this text")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument(
        "--attention-configs",
        metavar="D,D",
        help="instead: compile every tree-attention sweep candidate at these head dims",
    )
    args = ap.parse_args(argv)
    global ARCH
    ARCH = args.arch
    _install()
    if args.attention_configs:
        rows = attention_configs([int(d) for d in args.attention_configs.split(",")])
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"arch": ARCH, "commit": _commit(), "rows": rows}, f, indent=1)
        return 1 if any(r["problems"] or r["spill_store_bytes"] for r in rows) else 0
    rows, failures = [], []
    host_ops = 0  # torch ops the launchers ran on the host, each checked for a sync
    seen: dict[str, dict] = {}
    ran = 0
    for name, case in cases(args.quick):
        if args.only and args.only not in name:
            continue
        ran += 1
        start, t0 = len(_COMPILED), time.perf_counter()
        try:
            launch = case()  # inputs, unchecked
            launch()  # the warm-up call before a capture (may build cached tables)
            with NoHostSync() as check:  # the call a graph would capture: no host sync
                launch()
        except Exception as e:  # a compile error or a host sync: record it, go on
            failures.append({"case": name, "error": f"{type(e).__name__}: {e}"})
            traceback.print_exc()
            continue
        for kname, kernel in _COMPILED[start:]:
            key = kernel.hash
            if key in seen:
                continue
            row = {"case": name, "kernel": kname, **resources(kernel)}
            seen[key] = row
            rows.append(row)
        host_ops += check.ops_checked
        print(f"{time.perf_counter() - t0:6.1f} s  {name}", flush=True)
    if ran == 0:
        print("no case matched: nothing was compiled")
        return 1
    bad = [r for r in rows if r["problems"]]
    print(
        f"\n{'kernel':<22} {'warps':>5} {'stg':>3} {'regs':>4} {'stack':>5} {'spill st/ld':>11} "
        f"{'shared':>7}  case"
    )
    for r in rows:
        print(
            f"{r['kernel']:<22} {r['num_warps']:>5} {r['num_stages']:>3} {r['regs']:>4} "
            f"{r['stack_bytes']:>5} {r['spill_store_bytes']:>5}/{r['spill_load_bytes']:<5} "
            f"{r['shared_bytes']:>7}  {r['case']}"
            + (f"  PROBLEM: {'; '.join(r['problems'])}" if r["problems"] else "")
        )
    spills = sum(r["spill_store_bytes"] > 0 for r in rows)
    print(
        f"\n{len(rows)} distinct kernels compiled for sm_{ARCH}; {len(failures)} cases failed "
        f"(compile error or host sync); {len(bad)} over a limit; {spills} spill registers; "
        f"{host_ops} host-side torch ops of the launchers checked for syncs"
    )
    for f in failures:
        print(f"FAILED: {f['case']}: {f['error'][:500]}")
    if args.out:
        doc = {
            "target": f"sm_{ARCH} ({ARCHS[ARCH][0]}: {ARCHS[ARCH][1]} SMs, "
            f"{ARCHS[ARCH][2]} B shared per block), compiled on a CPU-only machine",
            "arch": ARCH,
            "versions": {"triton": triton.__version__, "torch": torch.__version__},
            "commit": _commit(),
            "quick": args.quick,
            "host_ops_checked": host_ops,
            "rows": rows,
            "failures": failures,
        }
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 1 if failures or bad else 0


def _commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    sys.exit(main())
