"""Acceptance of a verified draft tree: greedy and lossless sampling (docs/design.md op 7).

CUDA tensors run Triton launches (``treeops.kernels.accept``: one for greedy, two or three for
sampling) that read the target's logits once per node (top-k/top-p sampling rows reread the few
groups of tokens around their threshold), with the argmax / softmax statistics fused; CPU
tensors run the PyTorch reference (``treeops.reference.accept``), which is the specification.

Output, an ``Acceptance`` (a NamedTuple, so it unpacks):

* ``accepted`` [B, N] int32: accepted node indices, root first (``accepted[b, d]`` is the
  node at depth d); padding -1.
* ``accept_len`` [B] int32: accepted nodes, root counted = number of emitted tokens; 0 for an
  inactive row.
* ``bonus`` [B] int64: the last emitted token (the next step's root); -1 for an inactive row.
* ``logprobs`` [B, N] float32 or None: ``logprobs[b, q]`` is the log-probability of the
  (q+1)-th emitted token under the distribution the op decided with at node
  ``accepted[b, q]`` (greedy: ``log_softmax(logits)``); padding 0.
* ``topk`` [B, N, k] int32 or None: ids of the k largest raw logits of every verified node
  (i < num_nodes), largest first, ties by lower id; -1 rows for nodes >= num_nodes.

Emitted tokens are ``tokens[accepted[b, 1:accept_len]]`` followed by ``bonus``: exactly
``accept_len`` of them. The capacity of ``accepted`` is N (max depth + 1 <= N). ``topk`` is the
form ``AdjacencyTable.update`` consumes (row of token ``tokens[b, i]`` <- ``topk[b, i]``).

Stop ids and budgets (both optional) truncate what is emitted: with ``max_new_tokens[b] = M``
(values below 1 count as 1) at most M tokens are emitted; if an emitted token is a stop id,
emission ends right after the first one. The result is reported in the same form: the accepted
path is cut so that the last kept token becomes ``bonus`` (when the cut falls inside the tree,
``bonus`` is the token of the first dropped tree node). ``compact_kv`` then keeps exactly the
K/V of ``accepted[:accept_len]``.
"""

from __future__ import annotations

import torch

from ._accept_inputs import Acceptance, check_accept_inputs
from ._checks import cuda_device
from ._library import TREE, define
from .kernels import accept as _kacc
from .kernels._replay import MISS, Replays
from .reference import accept as _ref
from .tree import Tree

__all__ = ["Acceptance", "accept_greedy", "accept_sample"]

_SAMPLING = "Tensor temperature, Tensor? top_k, Tensor? top_p, Tensor uniforms, "
_OUTPUTS = (
    "Tensor? stop_ids, Tensor? max_new_tokens, int topk_ids, Tensor(a!) accepted, "
    "Tensor(b!) accept_len, Tensor(c!) bonus, Tensor(d!)? logprobs, Tensor(e!)? topk) -> ()"
)


def _split(args: tuple, sampling: bool) -> tuple:
    """(tree, logits, sampling args or Nones, stop_ids, max_new_tokens, topk_ids, out) from an
    op's flat arguments."""
    tree, logits, rest = Tree(*args[:8]), args[8], args[9:]
    samp, rest = (rest[:4], rest[4:]) if sampling else ((None,) * 4, rest)
    stop_ids, max_new, topk_ids, *outs = rest
    return tree, logits, samp, stop_ids, max_new, topk_ids, Acceptance(*outs)


def _launcher(sampling: bool):
    def cuda(*args) -> None:
        tree, logits, (temp, top_k, top_p, uni), stop_ids, max_new, topk_ids, out = _split(
            args, sampling
        )
        with cuda_device(logits):
            _kacc.accept_launch(
                tree, logits, temperature=temp, top_k=top_k, top_p=top_p, uniforms=uni,
                stop_ids=stop_ids, max_new_tokens=max_new, return_logprobs=out.logprobs is not None,
                topk_ids=topk_ids, out=out,
            )  # fmt: skip

    def cpu(*args) -> None:
        tree, logits, samp, stop_ids, max_new, topk_ids, out = _split(args, sampling)
        kw = dict(
            stop_ids=stop_ids, max_new_tokens=max_new, return_logprobs=out.logprobs is not None,
            topk_ids=topk_ids, out=out,
        )  # fmt: skip
        if sampling:
            _ref.accept_sample(tree, logits, *samp, **kw)
        else:
            _ref.accept_greedy(tree, logits, **kw)

    return cuda, cpu


_greedy_cuda, _greedy_cpu = _launcher(sampling=False)
_sample_cuda, _sample_cpu = _launcher(sampling=True)
_greedy_op = define(
    f"accept_greedy({TREE}, Tensor target_logits, {_OUTPUTS}", cpu=_greedy_cpu, cuda=_greedy_cuda
)
_sample_op = define(
    f"accept_sample({TREE}, Tensor target_logits, {_SAMPLING}{_OUTPUTS}",
    cpu=_sample_cpu,
    cuda=_sample_cuda,
)


_GREEDY_REPLAYS = Replays("accept_greedy")
_SAMPLE_REPLAYS = Replays("accept_sample")
"""Calls per signature replayed without the ops' Python layers (``treeops.kernels._replay``)."""


def _outputs(tree: Tree, return_logprobs: bool, topk_ids: int, out: Acceptance | None):
    if out is not None:
        return out
    B, N = tree.parents.shape
    dev = tree.parents.device
    return Acceptance(
        torch.empty(B, N, dtype=torch.int32, device=dev),
        torch.empty(B, dtype=torch.int32, device=dev),
        torch.empty(B, dtype=torch.int64, device=dev),
        torch.empty(B, N, dtype=torch.float32, device=dev) if return_logprobs else None,
        torch.empty(B, N, topk_ids, dtype=torch.int32, device=dev) if topk_ids else None,
    )


def accept_greedy(
    tree: Tree,
    target_logits: torch.Tensor,
    *,
    stop_ids: torch.Tensor | None = None,
    max_new_tokens: torch.Tensor | None = None,
    return_logprobs: bool = False,
    topk_ids: int = 0,
    out: Acceptance | None = None,
    validate: bool = False,
) -> Acceptance:
    """Greedy acceptance of a verified tree, with the argmax fused.

    From the root, follow the child (index < ``num_nodes``) whose token equals the argmax of the
    target's logits at the current node (ties: lowest id); the bonus is the argmax at the last
    accepted node.

    Args:
        tree: the verified ``Tree`` (capacity N).
        target_logits: [B, N, V] bfloat16/float16/float32, the target's logits at every node
            (any strides; V up to 256K).
        stop_ids: [S] or [B, S] int32/int64 stop (EOS) ids, -1 entries ignored.
        max_new_tokens: [B] int32/int64, per-request token budget for this step (>= 1); unit
            stride, as every [B] input (the tree's fields must be contiguous).
        return_logprobs: also return ``log_softmax(logits)`` of the emitted tokens.
        topk_ids: k > 0 also returns ``topk`` [B, N, k]: each verified node's k largest logits'
            ids (for ``AdjacencyTable.update``), from the same pass over the logits.
        out: an ``Acceptance`` of preallocated tensors to write into.
        validate: check the tree and the value ranges (host syncs).

    Shapes, dtypes, devices and strides are always checked; values are the caller's
    responsibility when ``validate=False``: a malformed tree (``num_nodes > N``, parents or
    sibling links out of range) is undefined behaviour; ``validate=True`` checks it and the
    other values (with a host sync).

    Returns:
        ``Acceptance(accepted [B, N] int32, accept_len [B] int32, bonus [B] int64, logprobs
        [B, N] float32 | None, topk [B, N, k] int32 | None)``; see the module docstring.

    Example:
        >>> import torch, treeops
        >>> t = treeops.Tree.from_parents(torch.tensor([[-1, 0, 0, 1]], dtype=torch.int32),
        ...     torch.tensor([4], dtype=torch.int32), torch.tensor([[7, 3, 5, 2]]))
        >>> logits = torch.zeros(1, 4, 8); logits[0, 0, 3] = 1; logits[0, 1, 2] = 1
        >>> logits[0, 3, 6] = 1
        >>> r = treeops.accept_greedy(t, logits, validate=True)
        >>> r.accepted.tolist(), r.accept_len.tolist(), r.bonus.tolist()
        ([[0, 1, 3, -1]], [3], [6])
    """
    key, tensors = check_accept_inputs(
        tree,
        target_logits,
        stop_ids,
        max_new_tokens,
        topk_ids,
        out,
        return_logprobs,
        validate=validate,
    )
    res = _GREEDY_REPLAYS.run(key, tensors)
    if res is not MISS:
        return res
    out = _outputs(tree, return_logprobs, topk_ids, out)
    args = (*tree.tensors(), target_logits, stop_ids, max_new_tokens, int(topk_ids), *out)
    _GREEDY_REPLAYS.call(key, tensors, _greedy_op, *args, result=out)
    return out


def accept_sample(
    tree: Tree,
    target_logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    uniforms: torch.Tensor,
    *,
    stop_ids: torch.Tensor | None = None,
    max_new_tokens: torch.Tensor | None = None,
    return_logprobs: bool = False,
    topk_ids: int = 0,
    out: Acceptance | None = None,
    validate: bool = False,
) -> Acceptance:
    """Lossless sampling acceptance of a verified tree (docs/design.md op 7's interval rule).

    Target distribution at node i: ``softmax(logits_i / T)``, then top-k (ties: lower id), then
    top-p (smallest prefix by probability descending, id ascending, whose mass >= top_p),
    renormalised; computed inside the kernel, no [B, N, V] probability tensor. At the current
    node, [0, 1) is laid out as the children's probabilities in sibling order (a repeated token
    counted once), then every other token in id order; ``uniforms[b, i]`` picks a piece: a
    child's piece accepts it and the walk continues, another token's piece is the bonus. If
    rounding leaves u past the end, the last piece of positive length is taken. The emitted
    tokens have exactly the target's distribution. ``T = 0`` rows are greedy.

    Args:
        tree, target_logits, stop_ids, max_new_tokens, topk_ids, out, validate: as in
            ``accept_greedy``.
        temperature: [B] float32, >= 0 (0 = greedy).
        top_k: [B] int32/int64; <= 0 or >= V disables top-k. None: off for every request.
        top_p: [B] float32 in (0, 1]; 1 disables top-p. None: off for every request. With
            both None the CUDA launch has no kept-set pass (two launches: pass 1, then the
            walk), where tensors, even all-off ones, take three.
        uniforms: [B, N] float32 in [0, 1), one per node (reproducible, graph safe; unit stride
            along N). The [B] inputs need unit stride.
        return_logprobs: also return ``log p_i`` of the emitted tokens (``T = 0`` rows:
            ``log_softmax(logits)``).

    Values are unchecked when ``validate=False``, as in ``accept_greedy`` (a malformed tree is
    undefined behaviour); ``validate=True`` checks them (with a host sync).

    Returns:
        an ``Acceptance``, as in ``accept_greedy``.

    Example:
        >>> import torch, treeops
        >>> t = treeops.Tree.from_parents(torch.tensor([[-1, 0]], dtype=torch.int32),
        ...     torch.tensor([2], dtype=torch.int32), torch.tensor([[7, 3]]))
        >>> logits = torch.zeros(1, 2, 4)
        >>> r = treeops.accept_sample(t, logits, torch.ones(1), torch.zeros(1, dtype=torch.int32),
        ...     torch.ones(1), torch.tensor([[0.1, 0.6]]), validate=True)
        >>> r.accepted.tolist(), r.accept_len.tolist(), r.bonus.tolist()
        ([[0, 1]], [2], [2])
    """
    key, tensors = check_accept_inputs(
        tree,
        target_logits,
        stop_ids,
        max_new_tokens,
        topk_ids,
        out,
        return_logprobs,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        uniforms=uniforms,
        validate=validate,
    )
    res = _SAMPLE_REPLAYS.run(key, tensors)
    if res is not MISS:
        return res
    out = _outputs(tree, return_logprobs, topk_ids, out)
    args = (
        *tree.tensors(), target_logits, temperature, top_k, top_p, uniforms, stop_ids,
        max_new_tokens, int(topk_ids), *out,
    )  # fmt: skip
    _SAMPLE_REPLAYS.call(key, tensors, _sample_op, *args, result=out)
    return out
