"""Build the peers' just-in-time modules before any benchmark is timed.

FlashInfer compiles each kernel family with nvcc on its first use: its sampling module took about
115 s inside ``bench_accept.py``'s first sampling row on the H200, and each paged or ragged
prefill configuration (head dim, mask mode) about 30 s inside ``bench_tree_attention.py``. Run in
the background of a device call (``bench/run_h200.sh peers_bg``, while the GPU tests run), this
script takes those compiles off the timed stages: it calls the benches' own FlashInfer helpers
once, on tiny inputs, for every configuration they use, so the modules built are the ones they
load (FlashInfer keeps them under ``FLASHINFER_WORKSPACE_BASE``, ``~/.cache`` by default).

    python bench/warm_peers.py [--out DIR] [--only sampling|attention]

One line per module family with its seconds (``--out``: also ``DIR/warm_peers.json``). A family
that fails is reported and the rest still build; the benches then compile or skip it as before.
Nothing is timed here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402

ATTENTION_LAYOUTS = ((32, 8, 128), (64, 8, 128), (16, 4, 256), (32, 8, 64))
"""(H_q, H_kv, D) of every layout ``bench_tree_attention.py`` runs FlashInfer on (its default
and ``LAYOUT_SHAPES``): the head dim picks the module, the rest is checked cheaply."""


def attention_jobs() -> list[tuple[str, Callable[[], None]]]:
    """Paged custom-mask, paged causal and ragged custom-mask prefill, per layout."""
    import bench_tree_attention as bta

    jobs = []
    for hq, hkv, d in ATTENTION_LAYOUTS:

        def paged(hq=hq, hkv=hkv, d=d, causal=False):
            c = bta.Case(1, 32, 8, hq=hq, hkv=hkv, d=d)
            make, _ = bta.flashinfer_paged(c, causal)
            make(c.k_cache, c.v_cache)()

        def ragged(hq=hq, hkv=hkv, d=d):
            c = bta.Case(1, 32, 8, hq=hq, hkv=hkv, d=d)
            k, v = c.kv_contig()
            fn, _ = bta.flashinfer_ragged(c, k, v)
            fn()

        tag = f"H_q {hq}, H_kv {hkv}, D {d}"
        jobs.append((f"prefill paged custom mask ({tag})", paged))
        jobs.append((f"prefill paged causal ({tag})", lambda p=paged: p(causal=True)))
        jobs.append((f"prefill ragged custom mask ({tag})", ragged))
    return jobs


def sampling_jobs() -> list[tuple[str, Callable[[], None]]]:
    """Softmax with temperature, top-k and top-p renormalisation, as ``bench_accept.py`` calls
    them."""
    import bench_accept as ba

    def run():
        import flashinfer.sampling as fi

        B, N, V = 1, 4, 1000
        tree = ba.bench_tree(B, N, V, seed=0)
        lg = ba.bench_logits(tree, V, seed=0, boost=2.0)
        rows = B * N
        T = torch.full((rows,), 0.8, device="cuda")
        k = torch.full((rows,), 50, dtype=torch.int32, device="cuda")
        p = torch.full((rows,), 0.9, device="cuda")
        ba.flashinfer_probs(fi, lg, T, k, p, True, True)

    return [("sampling (softmax, top-k and top-p renorm)", run)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="also write DIR/warm_peers.json")
    ap.add_argument(
        "--only",
        choices=("sampling", "attention"),
        default=None,
        help="build one bench's modules (the call runs only that bench)",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("warm_peers: no GPU, nothing to build")
        return 0
    try:
        import flashinfer  # noqa: F401
    except Exception as e:  # noqa: BLE001 - the benches record the same reason
        print(f"warm_peers: flashinfer not importable ({type(e).__name__}: {e})")
        return 0
    rows = []
    jobs = {"sampling": sampling_jobs, "attention": attention_jobs}
    for name, job in [j for k, make in jobs.items() if args.only in (None, k) for j in make()]:
        t0 = time.perf_counter()
        try:
            job()
            torch.cuda.synchronize()
            row = {"module": name, "seconds": round(time.perf_counter() - t0, 1)}
        except Exception as e:  # noqa: BLE001 - one family's failure does not stop the rest
            row = {"module": name, "error": f"{type(e).__name__}: {e}"[:300]}
        rows.append(row)
        print(f"  {name:<56} " + (f"{row['seconds']:6.1f} s" if "seconds" in row else row["error"]),
              flush=True)  # fmt: skip
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "warm_peers.json"), "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
