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
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(batch=args.batch, steps=args.steps, seed=args.seed)
    return 2


if __name__ == "__main__":
    sys.exit(main())
