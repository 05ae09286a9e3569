"""What an eager op's host path spends besides its launch, piece by piece, on a CUDA machine.

Each piece is called in a loop of ``--calls`` (one device sync at the end), best of five rounds,
µs per call: small CUDA allocations (one, a ``Tree``'s eight, the same eight as views of one
buffer), stream lookups, an event record and a copy to pinned memory (a build op's ``publish``),
a device guard. docs/benchmarks.md ("Host overhead of an eager call") reads them.

    python bench/host_pieces.py --out host_pieces.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def pieces(dev: torch.device) -> dict:
    """One closure per piece (B = 2 requests, N = 8 nodes: the tiny shapes of bench_host.py)."""
    import treeops
    from treeops import _runtime
    from treeops.tree import anc_words

    B, N = 2, 8
    AW = anc_words(N)
    i32 = torch.int32
    pinned = torch.empty(16, dtype=i32, pin_memory=True)
    src = torch.zeros(16, dtype=i32, device=dev)
    ev = torch.cuda.Event()
    index = dev.index or 0

    def empty(shape, dtype=i32):
        stride = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            stride[d] = stride[d + 1] * shape[d + 1]
        return torch.empty_strided(shape, stride, dtype=dtype, device=dev)

    def tree_fields():
        return (
            empty((B, N), torch.int64), empty((B, N)), empty((B,)), empty((B, N)),
            empty((B, N, AW)), empty((B, N)), empty((B, N)), empty((B, N), torch.float32),
        )  # fmt: skip

    parts = (2 * B * N, B * N, 4, B * N, B * N * AW, B * N, B * N, B * N)  # int32 words
    sizes = [(s + 3) // 4 * 4 for s in parts]  # 16-byte aligned, as Triton specialises

    def one_buffer():
        p = torch.split_with_sizes(torch.empty(sum(sizes), dtype=i32, device=dev), sizes)
        return (p[0][: 2 * B * N].view(torch.int64).view(B, N), p[1][: B * N].view(B, N),
                p[2][:B], p[3][: B * N].view(B, N), p[4][: B * N * AW].view(B, N, AW),
                p[5][: B * N].view(B, N), p[6][: B * N].view(B, N),
                p[7][: B * N].view(torch.float32).view(B, N))  # fmt: skip

    def guard():
        with torch.cuda.device(index):
            pass

    return {
        "empty_strided, one small tensor": lambda: empty((B, N)),
        "eight (a Tree's fields)": tree_fields,
        "Tree.uninitialized": lambda: treeops.Tree.uninitialized(B, N, dev),
        "one buffer split into the eight": one_buffer,
        "three (acceptance's outputs)": lambda: (empty((B, N)), empty((B,)), empty((B,))),
        "torch.cuda.current_stream()": torch.cuda.current_stream,
        "torch._C._cuda_getCurrentRawStream": lambda: torch._C._cuda_getCurrentRawStream(index),
        "treeops._runtime.current_stream": lambda: _runtime.current_stream(index),
        "Event.record() (stream looked up)": lambda: ev.record(),
        "Event.record(kept stream)": lambda: ev.record(_runtime.current_stream(index)),
        "copy 64 B to pinned, non-blocking": lambda: pinned.copy_(src, non_blocking=True),
        "with torch.cuda.device(index)": guard,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON file for the results")
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("host_pieces.py times CUDA host paths: it needs a CUDA device")
    dev = torch.device("cuda")
    res = {}
    for name, fn in pieces(dev).items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t0) / args.calls * 1e6)
        res[name] = round(best, 2)
        print(f"{name:40s} {best:7.2f} us", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
