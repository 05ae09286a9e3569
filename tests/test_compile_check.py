"""Every kernel family compiles as the GPU launchers launch it, for the H200 (sm_90) and for the
smaller shared memory of sm_89 (L40S), within the SM's register and shared-memory limits, and
every launcher's host code runs without a host sync (``treeops.testing.NoHostSync``):
``bench/compile_check.py --quick`` in a fresh process without the interpreter (ptxas ships in the
Triton wheel; no GPU is needed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("arch", [90, 89])
def test_kernels_compile_for_gpu(tmp_path, arch):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / f"sm{arch}.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "compile_check.py"),
            "--quick",
            "--arch",
            str(arch),
            "--out",
            str(out),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["arch"] == arch
    assert doc["failures"] == []
    assert doc["host_ops_checked"] > 0
    kernels = {r["kernel"] for r in doc["rows"]}
    # every kernel family of the library was compiled, not just some
    assert {
        "_tree_attn_fwd",
        "_merge_splits",
        "_kv_append",
        "_expand_kernel",
        "_select_kernel",
        "_emit_kernel",
        "_accept_kernel",
        "_compact_kernel",
        "_graft_kernel",
        "_retrieve_kernel",
        "_topk_partial_kernel",
        "_update_write_kernel",
        "_block_max_kernel",
        "_block_top_kernel",
        "_claim_kernel",
        "_prune_kernel",
        "_checkpoint_kernel",
    } <= kernels, kernels
    for r in doc["rows"]:
        assert r["problems"] == [], r
        shared_max = {90: 232448, 89: 101376}[arch]
        assert r["regs"] * r["threads"] <= 65536 and r["shared_bytes"] <= shared_max, r
    # greedy acceptance streams bf16 logits rows: in 16-byte vector loads, not one element each
    # (the compiler must be told the split's blocks are aligned: kernels/accept_stats.py)
    greedy = [r for r in doc["rows"] if r["kernel"] == "_accept_kernel" and "greedy" in r["case"]]
    assert greedy and all(r["ldg_16bit_scalar"] == 0 for r in greedy), greedy
    # so does compaction, a list of layers (addresses from a table) as stacked caches
    compact = [r for r in doc["rows"] if r["kernel"] == "_compact_kernel"]
    assert any("stacked=False" in r["case"] for r in compact), compact
    assert all(r["ldg_16bit_scalar"] == 0 for r in compact), compact
    if arch == 90:  # the H200's attention tiles spill at no head dim (64, 128, 256)
        att = [r for r in doc["rows"] if r["kernel"] in ("_tree_attn_fwd", "_tree_attn_fwd_gluon")]
        assert sum(r["kernel"] == "_tree_attn_fwd_gluon" for r in att) >= 2
        assert {d for r in att for d in (64, 128, 256) if f"D={d} " in r["case"]} == {64, 128, 256}
        for r in att:
            assert r["spill_store_bytes"] == 0 and r["spill_load_bytes"] == 0, r
