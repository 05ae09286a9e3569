"""The example decoder (docs/design.md "The example decoder"): a Llama-style target and an
EAGLE-style draft in PyTorch whose attention, KV writes, tree handling, acceptance and
compaction all go through treeops.

Modules: ``policies`` (which tree a step drafts: ``Autoregressive``, ``Chain``,
``treeops.EagleStatic``, ``treeops.Cast``, ``CastGraft``; ``make_policy``), ``model`` (the
models and their paged KV cache), ``step`` (the decoding step every path shares), ``graphs``
(static buffers, token buckets, CUDA-graph capture and replay), ``engine`` (``Decoder``:
prefill and the decoding loop), ``calibrate`` (Graft's pruning thresholds fitted to the pair:
``calibrate_checkpoints``), ``results`` (``SamplingParams``, ``DecodeResult``), ``train``
(a model pair trained on this machine).
"""

from ..build_tree import Cast, EagleStatic
from .calibrate import calibrate_checkpoints
from .engine import Decoder
from .model import Draft, ModelConfig, PagedKV, Target, chain_tree, reference_forward
from .policies import POLICIES, Autoregressive, CastGraft, Chain, make_policy
from .results import DecodeResult, SamplingParams

__all__ = [
    "POLICIES",
    "Autoregressive",
    "Cast",
    "CastGraft",
    "Chain",
    "DecodeResult",
    "Decoder",
    "Draft",
    "EagleStatic",
    "ModelConfig",
    "PagedKV",
    "SamplingParams",
    "Target",
    "calibrate_checkpoints",
    "chain_tree",
    "make_policy",
    "reference_forward",
]
