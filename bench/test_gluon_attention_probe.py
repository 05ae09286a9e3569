"""The Gluon attention probe on a CPU: every configuration compiles for sm_90 within the SM's
limits without ptxas serialising its wgmmas, and the GPU harness's bookkeeping (reference,
errors, rows, the per-config merge) runs end to end with torch stand-ins for both kernels."""

import json
import os
import subprocess
import sys

import bench_tree_attention as BT
import gluon_attention_probe as P
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def test_every_config_compiles_for_sm90_with_its_wgmmas_pipelined(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "gluon_attention_probe.py"), "--compile", "--out",
         str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "gluon_attention_probe.json").read_text())["rows"]
    assert [r["config"] for r in rows] == list(P.CONFIGS)
    for r in rows:
        assert not r["problems"] and r["spill_store_bytes"] == 0, r
        assert not r["wgmma_serialized"], r["config"]
    # the property the probe exists to time: some configuration issues a large share of its
    # exp2s while a PV wgmma is pending
    assert max(r["ex2_overlapped_total"][0] / r["ex2_overlapped_total"][1] for r in rows) > 0.4


def _stand_in(q, k_cache, v_cache, block_table, kv_len, scale, out, config):
    """The probe's contract in torch: every query over the first kv_len keys."""
    B, n, hq, d = q.shape
    hkv = k_cache.shape[2]
    for b in range(B):
        pages = block_table[b].long()
        k = k_cache[pages].reshape(-1, hkv, d)[:kv_len].float().repeat_interleave(hq // hkv, 1)
        v = v_cache[pages].reshape(-1, hkv, d)[:kv_len].float().repeat_interleave(hq // hkv, 1)
        s = torch.einsum("nhd,lhd->hnl", q[b].float(), k) * scale
        out[b] = torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), v).to(out.dtype)
    return out


def test_gpu_rows_bookkeeping_with_stand_ins(monkeypatch):
    monkeypatch.setattr(P, "prefix_attention", _stand_in)
    monkeypatch.setattr(BT, "kernel_fn", lambda c: ((lambda: None), None))
    rows = P.gpu_rows(["m128_n64_la1", "m64_n64_la2"], shapes=[(2, 120, 8)], dev="cpu")
    assert len(rows) == 1
    r = rows[0]
    assert (r["B"], r["ctx"], r["n"]) == (2, 120, 8) and r["treeops_us"] > 0
    for name in ("m128_n64_la1", "m64_n64_la2"):
        assert r[name]["ok"] and r[name]["err"] < 1e-2, r[name]


def test_a_wrong_output_is_not_ok(monkeypatch):
    def off_by_one(*args):
        out = _stand_in(*args)
        out[0, 0, 0, 0] += 1.0
        return out

    monkeypatch.setattr(P, "prefix_attention", off_by_one)
    monkeypatch.setattr(BT, "kernel_fn", lambda c: ((lambda: None), None))
    r = P.gpu_rows(["m128_n64_la1"], shapes=[(1, 56, 8)], dev="cpu")[0]
    assert not r["m128_n64_la1"]["ok"]
