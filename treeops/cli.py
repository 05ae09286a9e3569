"""The ``treeops`` console command (``treeops demo``, ``treeops decode``).

Arguments are checked before any work starts: a bad value is one ``usage`` line and one
``error`` line naming the flag, exit status 2 (argparse's ``parser.error``), never a traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path

# the names of treeops.decoder.POLICIES, repeated so that ``treeops --help`` imports no model code
# (tests/test_demo.py checks that the two agree)
POLICY_NAMES = ("autoregressive", "chain", "EagleStatic", "Cast", "CastGraft")

DESCRIPTION = (
    "treeops: Triton kernels for speculative decoding with draft trees (tree attention, KV "
    "append, tree build under EAGLE or CAST, Graft, lossless acceptance, KV compaction), with "
    "an example decoder. On a CPU every op runs its PyTorch reference."
)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown, except for flags and options without a default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {v}")
        return v

    parse.__name__ = f"integer >= {low}"
    return parse


def _temperature(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return v


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treeops", description=DESCRIPTION)
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND",
        help="one of the commands below; 'treeops COMMAND --help' lists its options",
    )  # fmt: skip

    demo_help = (
        "train (once, cached) a tiny target and draft on this machine's Python source, decode "
        "held-out prompts with every policy and check each output equals greedy decoding"
    )
    demo = sub.add_parser(
        "demo", help=demo_help, formatter_class=_Formatter,
        description=demo_help + ". With --synthetic: a model-free walk through every op on "
        "synthetic logits instead (seconds).",
    )  # fmt: skip
    demo.add_argument("--batch", type=_int_at_least(1), default=4, help="requests in the batch")
    demo.add_argument(
        "--new-tokens", type=_int_at_least(1), default=32, help="tokens to generate per request"
    )
    demo.add_argument(
        "--cache-dir",
        help="where the trained pair is kept (default: ~/.cache/treeops/<preset>-pair)",
    )
    demo.add_argument("--retrain", action="store_true", help="ignore the cached pair")
    demo.add_argument(
        "--preset",
        choices=["tiny", "micro"],
        default="tiny",
        help="model pair: tiny (about a minute of training on two cores) or micro (seconds, "
        "for smoke tests)",
    )
    demo.add_argument(
        "--synthetic",
        action="store_true",
        help="the model-free walk through every op on synthetic logits instead",
    )
    demo.add_argument(
        "--steps", type=_int_at_least(1), default=4, help="decoding steps (with --synthetic)"
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed (with --synthetic)")

    decode_help = (
        "the example decoder on a tiny random model pair (or a local Llama with --model), "
        "every policy checked against greedy decoding"
    )
    dec = sub.add_parser(
        "decode", help=decode_help, description=decode_help + ".", formatter_class=_Formatter
    )
    dec.add_argument("--batch", type=_int_at_least(1), default=3, help="requests in the batch")
    dec.add_argument(
        "--new-tokens", type=_int_at_least(1), default=16, help="tokens to generate per request"
    )
    dec.add_argument(
        "--policy",
        action="append",
        choices=POLICY_NAMES,
        help="a policy to run; repeatable (default: every policy)",
    )
    dec.add_argument(
        "--temperature", type=_temperature, default=0.0, help="sampling temperature (0: greedy)"
    )
    dec.add_argument(
        "--model",
        help="a local directory with config.json and safetensors (or .bin) weights of a Hugging "
        "Face Llama (default: a tiny random pair)",
    )
    dec.add_argument("--seed", type=int, default=0, help="random seed (models and prompts)")
    for p in (demo, dec):
        p.set_defaults(subparser=p)  # errors found after parsing show the subcommand's usage
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    sub: argparse.ArgumentParser = args.subparser
    if args.command == "demo":
        if args.synthetic:
            from .demo import run_synthetic_demo

            return run_synthetic_demo(batch=args.batch, steps=args.steps, seed=args.seed)
        if args.cache_dir is not None and Path(args.cache_dir).exists():
            if not Path(args.cache_dir).is_dir():
                sub.error(f"argument --cache-dir: {args.cache_dir!r} is not a directory")
        if importlib.util.find_spec("tokenizers") is None:
            sub.error("the trained-pair demo needs 'tokenizers': pip install treeops[demo] "
                      "(or run the model-free walk: treeops demo --synthetic)")  # fmt: skip
        from .demo import run_demo

        return run_demo(
            batch=args.batch,
            new_tokens=args.new_tokens,
            preset=args.preset,
            cache_dir=args.cache_dir,
            retrain=args.retrain,
        )
    if args.command == "decode":
        from .decoder.cli import load_model, run_decode

        model = None
        if args.model is not None:
            if not (Path(args.model) / "config.json").is_file():
                sub.error(f"argument --model: no config.json in {args.model!r}")
            try:
                model = load_model(args.model)
            except ValueError as e:
                sub.error(f"argument --model: {e}")
        return run_decode(
            batch=args.batch,
            new_tokens=args.new_tokens,
            policies=args.policy,
            seed=args.seed,
            temperature=args.temperature,
            model=model,
        )
    return 2


if __name__ == "__main__":
    sys.exit(main())
