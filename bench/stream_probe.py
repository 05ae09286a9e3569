"""How fast can a plain kernel stream the build's logits? The bound the build's stream
(``kernels/build_tree_vocab.py``: per row chunk an online max and sum of exp) is held to.

Over [B, 10, V] bf16 logits (a layer's): ``torch.amax`` and ``torch.logsumexp`` along V, and a
plain Triton kernel (one program per row chunk, an online max and sum of exp2 per lane, no block
maxima) over tiles of 512-4,096 logits, 1-8 warps, a split filling 8 or 32 programs an SM, and
with Triton's software pipelining of the tile loads (``num_stages`` 3) or without. CUDA-graph
replay medians over rotated copies (``harness.graph_us``), µs, beside the bytes' floor
(``harness.bytes_floor_us``: this GPU's measured rate); writes ``$OUT/stream_probe.json``
(``harness.result_doc``), each row as it completes.

    OUT=dir python3 bench/stream_probe.py
"""

import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as H  # noqa: E402


@triton.jit
def _stat1d(
    p_x,
    p_m,
    p_s,
    V,
    CHUNK: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    """One program per (row, chunk of CHUNK logits): the chunk's max and sum of exp(x - max),
    kept per lane and reduced once at the end, into ``p_m`` / ``p_s`` at the program's index."""
    pid = tl.program_id(0)
    row = pid // SPLIT
    c = pid % SPLIT
    v0 = c * CHUNK
    p_row = p_x + row.to(tl.int64) * V
    o = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], -float("inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for t in tl.range(0, CHUNK, BLOCK, num_stages=STAGES):
        idx = v0 + t + o
        x = tl.load(p_row + idx, mask=(idx < V) & (t + o < CHUNK), other=-float("inf")).to(
            tl.float32
        )
        m_new = tl.maximum(m, x)
        s = s * tl.exp2((m - m_new) * 1.4426950408889634) + tl.exp2(
            (x - m_new) * 1.4426950408889634
        )
        s = tl.where(m_new == -float("inf"), 0.0, s)
        m = m_new
    mm = tl.max(m)
    ss = tl.sum(tl.where(m == -float("inf"), 0.0, s * tl.exp2((m - mm) * 1.4426950408889634)))
    tl.store(p_m + pid, mm)
    tl.store(p_s + pid, ss)


def run_stat1d(x, split, block, warps, stages, m, s):
    rows = x.shape[0] * x.shape[1]
    V = x.shape[2]
    chunk = triton.cdiv(triton.cdiv(V, split), block) * block
    _stat1d[(rows * split,)](
        x, m, s, V, CHUNK=chunk, SPLIT=split, BLOCK=block, STAGES=stages, num_warps=warps
    )


def main():
    why = H.needs_cuda()
    if why:
        sys.exit(f"stream_probe: {why}")
    out = os.environ.get("OUT", "/tmp")
    dev = "cuda"
    MAX_SPLIT = 64
    doc = H.result_doc(what="plain row-stat kernels and torch reductions over [B, 10, V] bf16")
    doc["rows"] = []
    for B, V in [(64, 32000), (8, 32000), (64, 128256), (1, 128256)]:
        W = 10
        nbytes = B * W * V * 2
        copies, reps = H.rotation(nbytes)
        xs = [torch.randn(B, W, V, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        m = torch.empty(B * W * MAX_SPLIT, device=dev)  # a partial per (row, chunk)
        s = torch.empty_like(m)

        def t(fn, xs=xs, reps=reps):
            return H.graph_us([lambda x=x: fn(x) for x in xs], reps)

        row = dict(B=B, V=V, MB=nbytes / 1e6, floor_us=H.bytes_floor_us(nbytes))
        row["torch_amax"] = t(lambda x: torch.amax(x, -1))
        row["torch_logsumexp"] = t(lambda x: torch.logsumexp(x, -1))
        best = (1e9, None)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        rows = B * W
        for block, warps in [(512, 1), (1024, 4), (2048, 4), (4096, 8)]:
            for per_sm in (8, 32):
                split = max(1, min(MAX_SPLIT, (per_sm * sms) // rows))
                split = min(split, triton.cdiv(V, block))
                for stages in (1, 3):
                    key = f"b{block}_w{warps}_split{split}_st{stages}"
                    if key in row:
                        continue
                    try:
                        us = t(
                            lambda x, sp=split, b=block, w=warps, st=stages, m=m, s=s: run_stat1d(
                                x, sp, b, w, st, m, s
                            )
                        )
                    except Exception as e:  # noqa: BLE001 - a failing tiling is reported, not fatal
                        us = None
                        print(key, "failed", type(e).__name__, str(e)[:100])
                    row[key] = us
                    if us and us < best[0]:
                        best = (us, key)
        row["best"] = best
        print(
            json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}),
            flush=True,
        )
        doc["rows"].append(row)
        H.write_json(os.path.join(out, "stream_probe.json"), doc)
        del xs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
