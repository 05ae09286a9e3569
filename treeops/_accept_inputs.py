"""What acceptance's public op and its reference share: the ``Acceptance`` result and the input
checks (the reference validates as the public op does, so both refuse the same inputs)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._checks import Memo, check_finite, check_range, check_same_device, check_tensor, signature
from .tree import Tree, check_tree

_LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INT_DTYPES = (torch.int32, torch.int64)


class Acceptance(NamedTuple):
    """Result of ``accept_greedy`` / ``accept_sample`` (see the module docstring)."""

    accepted: torch.Tensor
    accept_len: torch.Tensor
    bonus: torch.Tensor
    logprobs: torch.Tensor | None = None
    topk: torch.Tensor | None = None


_PASSED = Memo()
"""Signatures of inputs that passed ``check_accept_inputs`` with ``validate=False``."""


def check_accept_inputs(
    tree,
    target_logits,
    stop_ids,
    max_new_tokens,
    topk_ids,
    out,
    return_logprobs,
    *,
    temperature=None,
    top_k=None,
    top_p=None,
    uniforms=None,
    validate=False,
) -> tuple:
    """Shapes, dtypes, strides, devices and types of acceptance's inputs (and their values under
    ``validate``); metadata that passed once is remembered (``_PASSED``). Returns the call's
    ``(signature, tensors)``: the tensors in the order the signature reads them (None for an
    absent one), both None under ``validate``."""
    key = tensors = None
    if not validate:
        outs = (out,) if out is None or not isinstance(out, Acceptance) else out
        tensors = (target_logits, stop_ids, max_new_tokens, temperature, top_k, top_p, uniforms,
                   *outs, *(tree.tensors() if isinstance(tree, Tree) else (tree,)))  # fmt: skip
        key = signature(tensors, (topk_ids, return_logprobs))
        if _PASSED.get(key) is not None:
            return key, tensors
    _check_accept_inputs(
        tree, target_logits, stop_ids, max_new_tokens, topk_ids, out, return_logprobs,
        temperature, top_k, top_p, uniforms, validate,
    )  # fmt: skip
    _PASSED.put(key, True)
    return key, tensors


def _check_accept_inputs(
    tree, target_logits, stop_ids, max_new_tokens, topk_ids, out, return_logprobs, temperature,
    top_k, top_p, uniforms, validate,
) -> None:  # fmt: skip
    tree = check_tree(tree, validate=validate)
    sizes = {"B": tree.batch_size, "N": tree.capacity}
    check_tensor(
        "target_logits", target_logits, shape=("B", "N", "V"), dtype=_LOGIT_DTYPES, sizes=sizes
    )
    V = sizes["V"]
    if V < 1:
        raise ValueError("Invalid shape of target_logits: expected V >= 1, got 0")
    if stop_ids is not None:
        if not isinstance(stop_ids, torch.Tensor) or stop_ids.dim() not in (1, 2):
            got = (
                list(stop_ids.shape)
                if isinstance(stop_ids, torch.Tensor)
                else type(stop_ids).__name__
            )
            raise ValueError(f"Invalid shape of stop_ids: expected [S] or [B, S], got {got}")
        check_tensor(
            "stop_ids",
            stop_ids,
            shape=("S",) if stop_ids.dim() == 1 else ("B", "S"),
            dtype=_INT_DTYPES,
            sizes=sizes,
        )
        if stop_ids.shape[-1] > 1 and stop_ids.stride(-1) != 1:
            raise ValueError(
                f"Invalid layout of stop_ids: expected unit stride in the last dimension, got "
                f"strides {stop_ids.stride()}"
            )
    if max_new_tokens is not None:
        check_tensor(
            "max_new_tokens",
            max_new_tokens,
            shape=("B",),
            dtype=_INT_DTYPES,
            sizes=sizes,
            unit_last=True,
        )
    if not isinstance(topk_ids, int) or isinstance(topk_ids, bool) or not 0 <= topk_ids <= V:
        raise ValueError(
            f"Invalid value of topk_ids: expected an int in [0, V={V}], got {topk_ids!r}"
        )
    if not isinstance(return_logprobs, bool):
        raise ValueError(
            f"Invalid type of return_logprobs: expected bool, got {type(return_logprobs).__name__}"
        )
    sampling = uniforms is not None or temperature is not None
    if sampling:
        # [B] vectors are read as ptr + b: unit stride (no stride-0 expand)
        f32 = torch.float32
        check_tensor(
            "temperature", temperature, shape=("B",), dtype=f32, sizes=sizes, unit_last=True
        )
        # None: that truncation is off for every request (a launch without pass 2)
        if top_k is not None:
            check_tensor(
                "top_k", top_k, shape=("B",), dtype=_INT_DTYPES, sizes=sizes, unit_last=True
            )
        if top_p is not None:
            check_tensor("top_p", top_p, shape=("B",), dtype=f32, sizes=sizes, unit_last=True)
        check_tensor("uniforms", uniforms, shape=("B", "N"), dtype=torch.float32, sizes=sizes)
        if uniforms.stride(1) != 1 and uniforms.shape[1] > 1:
            raise ValueError(
                f"Invalid layout of uniforms: expected unit stride along N, got strides "
                f"{uniforms.stride()}"
            )
    check_same_device(
        tree=tree.parents,
        target_logits=target_logits,
        stop_ids=stop_ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        uniforms=uniforms,
    )
    if out is not None:
        if not isinstance(out, Acceptance):
            raise ValueError(
                f"Invalid type of out: expected treeops.Acceptance, got {type(out).__name__}"
            )
        B, N = sizes["B"], sizes["N"]
        check_tensor("out.accepted", out.accepted, shape=(B, N), dtype=torch.int32)
        check_tensor("out.accept_len", out.accept_len, shape=(B,), dtype=torch.int32)
        check_tensor("out.bonus", out.bonus, shape=(B,), dtype=torch.int64)
        if return_logprobs:
            check_tensor("out.logprobs", out.logprobs, shape=(B, N), dtype=torch.float32)
        if topk_ids:
            check_tensor("out.topk", out.topk, shape=(B, N, topk_ids), dtype=torch.int32)
        check_same_device(
            target_logits=target_logits,
            **{f"out.{k}": v for k, v in out._asdict().items() if v is not None},
        )
        for name, t in out._asdict().items():
            if t is not None and not t.is_contiguous():
                raise ValueError(f"Invalid layout of out.{name}: expected a contiguous tensor")
    if validate:
        if bool(torch.isnan(target_logits).any()):
            raise ValueError("Invalid value in target_logits: expected no NaN, got NaN")
        if stop_ids is not None:
            check_range("stop_ids", stop_ids, -1, None)
        if max_new_tokens is not None:
            check_range("max_new_tokens", max_new_tokens[tree.num_nodes > 0], 1, None)
        if sampling:
            check_finite("temperature", temperature, nonnegative=True)
            if top_p is not None:
                check_finite("top_p", top_p)
            if top_p is not None and bool(((top_p <= 0) | (top_p > 1)).any()):
                raise ValueError(
                    f"Invalid value in top_p: expected values in (0, 1], got {top_p.tolist()}"
                )
            if bool(((uniforms < 0) | (uniforms >= 1) | torch.isnan(uniforms)).any()):
                raise ValueError("Invalid value in uniforms: expected values in [0, 1)")
