"""The ``treeops`` console command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="treeops", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a self-contained CPU run of every op on synthetic data")
    demo.add_argument("--batch", type=int, default=4, help="requests in the batch")
    demo.add_argument("--steps", type=int, default=4, help="decoding steps")
    demo.add_argument("--seed", type=int, default=0)
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
        from .demo import run_demo

        return run_demo(batch=args.batch, steps=args.steps, seed=args.seed)
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
