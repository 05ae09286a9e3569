"""The example decoder (DESIGN.md "The example decoder"): a Llama-style target and an
EAGLE-style draft in PyTorch whose attention, KV writes, tree handling, acceptance and
compaction all go through treeops; see ``engine`` for the decoding loop and its choices."""

from .engine import POLICIES, Decoder, DecodeResult, SamplingParams
from .model import Draft, ModelConfig, PagedKV, Target, chain_tree, reference_forward

__all__ = [
    "POLICIES",
    "DecodeResult",
    "Decoder",
    "SamplingParams",
    "Draft",
    "ModelConfig",
    "PagedKV",
    "Target",
    "chain_tree",
    "reference_forward",
]
