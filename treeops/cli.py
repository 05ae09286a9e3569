"""The ``treeops`` console command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="treeops", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train (once, cached) a tiny target + draft on this machine's Python source, decode "
        "held-out prompts with every policy and check each equals greedy decoding",
    )
    demo.add_argument("--batch", type=int, default=4, help="requests in the batch")
    demo.add_argument("--new-tokens", type=int, default=32, help="tokens to generate per request")
    demo.add_argument(
        "--cache-dir",
        help="where the trained pair is kept (default ~/.cache/treeops/<preset>-pair)",
    )
    demo.add_argument("--retrain", action="store_true", help="ignore the cached pair")
    demo.add_argument(
        "--preset",
        choices=["tiny", "micro"],
        default="tiny",
        help="micro: a seconds-long training run, for smoke tests",
    )
    demo.add_argument(
        "--synthetic",
        action="store_true",
        help="the model-free walk through every op on synthetic logits instead",
    )
    demo.add_argument("--steps", type=int, default=4, help="decoding steps (--synthetic)")
    demo.add_argument("--seed", type=int, default=0, help="(--synthetic)")
    dec = sub.add_parser(
        "decode", help="the example decoder on a tiny random model pair, every policy vs greedy"
    )
    dec.add_argument("--batch", type=int, default=3)
    dec.add_argument("--new-tokens", type=int, default=16)
    dec.add_argument("--policy", action="append", help="repeatable; default: all policies")
    dec.add_argument("--temperature", type=float, default=0.0)
    dec.add_argument("--model", help="local dir with config.json + safetensors (HF Llama)")
    dec.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.synthetic:
            from .demo import run_synthetic_demo

            return run_synthetic_demo(batch=args.batch, steps=args.steps, seed=args.seed)
        from .demo import run_demo

        return run_demo(
            batch=args.batch,
            new_tokens=args.new_tokens,
            preset=args.preset,
            cache_dir=args.cache_dir,
            retrain=args.retrain,
        )
    if args.command == "decode":
        from .decoder.cli import run_decode

        return run_decode(
            batch=args.batch,
            new_tokens=args.new_tokens,
            policies=args.policy,
            seed=args.seed,
            temperature=args.temperature,
            model=args.model,
        )
    return 2


if __name__ == "__main__":
    sys.exit(main())
