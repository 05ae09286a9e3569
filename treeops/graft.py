"""Graft (docs/design.md op 6): prune a draft tree early, refill its budget from a successor table.

Per decoding step, for a batch of B requests:

1. Draft. At the checkpoints after draft steps (0, 1, 5), ``PruneCheckpoints.check`` marks a
   request to keep only its top (8, 24, 40) draft nodes when its best path score is under the
   checkpoint's threshold (decided on device). Drafting can stop once every request is marked
   (the returned ``stop`` flags); until then it drafts on and ``prune``s per request.
2. Graft. ``graft(tree, table, template, budget)`` retrieves candidates from each request's root
   token through the ``AdjacencyTable`` and a ``RankTemplate``, trie-merges them into the pruned
   tree up to ``budget`` nodes (root included) and rebuilds depth, ``anc`` and the links: one
   fused launch on CUDA. ``AdjacencyTable.retrieve`` + ``graft_merge`` do the same in two steps.
   ``graft_tail(tree, table, count, budget)`` (``treeops.graft_tail``) grows the tree at its
   deep end instead: below each request's best leaf, a chain of the table's first successors.
3. Verify with the target, accept, then ``table.update(tree, target_logits)`` (or the
   ``topk_ids`` acceptance returns) so that the table learns the target's successors.

Each is a custom op ``torch.ops.treeops.*`` (``graft``, ``graft_merge``, ``prune``,
``prune_checkpoint``, ``adjacency_update``, ``adjacency_warm_start``, ``adjacency_retrieve``):
CUDA tensors run the Triton kernels (``treeops.kernels.graft``; ``prune`` and the checkpoint
rule one launch each, ``treeops.kernels.prune``), CPU tensors the references
(``treeops.reference.graft``). Nothing here
syncs with the host unless ``validate=True``. A plain eager call on CUDA replays the launches
recorded at the first call of its signature (``treeops.kernels._replay``; ``validate=True``
calls never do).

Example (CPU):
    >>> import torch, treeops
    >>> table = treeops.AdjacencyTable(vocab_size=16, k=4)
    >>> seq = torch.tensor([[3, 5, 7, 9, 11]])            # a known continuation 3 -> 5 -> 7 ...
    >>> logits = torch.nn.functional.one_hot(torch.tensor([[5, 7, 9, 11, 13]]), 16).float()
    >>> table.warm_start(seq, logits)
    >>> tree = treeops.Tree.from_parents(torch.full((1, 8), -1, dtype=torch.int32),  # N = 8
    ...                                  torch.tensor([1], dtype=torch.int32),    # root only
    ...                                  tokens=torch.tensor([[3, 0, 0, 0, 0, 0, 0, 0]]))
    >>> hybrid = treeops.graft(tree, table, treeops.RankTemplate.chain(4), budget=8, validate=True)
    >>> hybrid.tokens[0, :hybrid.num_nodes[0]].tolist()
    [3, 5, 7, 9, 11]
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ._checks import (
    Memo,
    check_positive_int,
    check_range,
    check_same_device,
    check_tensor,
    cuda_device,
    signature,
)
from ._graft_types import NO_PRUNE, RankTemplate, Retrieved
from ._library import OUT_TREE, TREE, define
from .kernels import graft as _k
from .kernels import graft_update as _ku
from .kernels._replay import MISS, Replays
from .reference import graft as _ref
from .tree import Tree, check_tree

__all__ = [
    "AdjacencyTable",
    "NO_PRUNE",
    "RankTemplate",
    "Retrieved",
    "graft",
    "graft_merge",
]

# ------------------------------------------------------------------------------ custom ops
# A budget, keep or count that is an int or a [B] int32 tensor passes as ``Tensor? x, int x_int``
# (the tensor when given, else the int); a template as its tensors and max_depth; a Tree as its
# tensors (``TREE``, first) and an output Tree as its buffers (``OUT_TREE``, last).


def _template(parents, ranks, depth, max_depth) -> SimpleNamespace:
    """What the reference reads of a ``RankTemplate``, from the op's template tensors."""
    return SimpleNamespace(
        parents=parents, ranks=ranks, depth=depth, size=parents.shape[0], max_depth=max_depth
    )


def _update_launch(table, owner, ws_val, ws_id, tokens, num, logits, topk_ids, last_wins):
    B, N = tokens.shape
    ws = {}
    if ws_val is not None:
        key = _ku.update_workspace_key(B * N, table.shape[0], table.shape[1], table.device)
        ws[key] = (ws_val, ws_id)
    with cuda_device(table):
        _ku.adjacency_update(table, owner, ws, tokens, num, logits, topk_ids, last_wins=last_wins)


def _adjacency_update_cuda(table, owner, ws_val, ws_id, *rest):
    tree, (logits, topk_ids) = Tree(*rest[:8]), rest[8:]
    _update_launch(
        table, owner, ws_val, ws_id, tree.tokens, tree.num_nodes, logits, topk_ids, False
    )


def _adjacency_update_cpu(table, owner, ws_val, ws_id, *rest):
    tree, (logits, topk_ids) = Tree(*rest[:8]), rest[8:]
    _ref.adjacency_update(table, tree, logits, topk_ids)


_adjacency_update_op = define(
    "adjacency_update(Tensor(a!) table, Tensor(b!)? owner, Tensor(c!)? ws_val, "
    f"Tensor(d!)? ws_id, {TREE}, Tensor? target_logits, Tensor? topk_ids) -> ()",
    cpu=_adjacency_update_cpu,
    cuda=_adjacency_update_cuda,
)


def _warm_start_cuda(table, owner, ws_val, ws_id, tokens, logits, lengths, topk_ids):
    _update_launch(table, owner, ws_val, ws_id, tokens, lengths, logits, topk_ids, True)


def _warm_start_cpu(table, owner, ws_val, ws_id, tokens, logits, lengths, topk_ids):
    _ref.adjacency_warm_start(table, tokens, logits, lengths, topk_ids)


_warm_start_op = define(
    "adjacency_warm_start(Tensor(a!) table, Tensor(b!)? owner, Tensor(c!)? ws_val, "
    "Tensor(d!)? ws_id, Tensor prompt_tokens, Tensor? prefill_logits, Tensor lengths, "
    "Tensor? topk_ids) -> ()",
    cpu=_warm_start_cpu,
    cuda=_warm_start_cuda,
)


def _retrieve_cuda(table, root_tokens, t_parents, t_ranks, t_depth, max_depth, count, count_int):
    with cuda_device(table):
        return _k.retrieve(
            table, root_tokens, t_parents, t_ranks, t_depth, max_depth,
            count if count is not None else count_int,
        )  # fmt: skip


def _retrieve_cpu(table, root_tokens, t_parents, t_ranks, t_depth, max_depth, count, count_int):
    r = _ref.adjacency_retrieve(
        table, root_tokens, _template(t_parents, t_ranks, t_depth, max_depth),
        count if count is not None else count_int,
    )  # fmt: skip
    return r.tokens, r.parents, r.depth, r.num_nodes


def _retrieve_fake(table, root_tokens, t_parents, *rest):
    B, T = root_tokens.shape[0], t_parents.shape[0]
    i32 = torch.int32
    return (
        root_tokens.new_empty(B, T, dtype=torch.int64),
        root_tokens.new_empty(B, T, dtype=i32),
        root_tokens.new_empty(B, T, dtype=i32),
        root_tokens.new_empty(B, dtype=i32),
    )


_retrieve_op = define(
    "adjacency_retrieve(Tensor table, Tensor root_tokens, Tensor t_parents, Tensor t_ranks, "
    "Tensor t_depth, int max_depth, Tensor? count, int count_int) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
    cpu=_retrieve_cpu,
    cuda=_retrieve_cuda,
    fake=_retrieve_fake,
)


def _copy_into(res: Tree, out: tuple[torch.Tensor, ...]) -> None:
    for dst, src in zip(out, res.tensors(), strict=True):
        dst.copy_(src)


def _graft_merge_cuda(*args):
    tree, rest, out = Tree(*args[:8]), args[8:-8], args[-8:]
    r_tok, r_par, r_dep, r_num, max_depth, budget, budget_int = rest
    with cuda_device(r_tok):
        _k.graft_fused(
            tree, budget if budget is not None else budget_int, r_tokens=r_tok, r_parents=r_par,
            r_depth=r_dep, r_num=r_num, max_depth=max_depth, out=out,
        )  # fmt: skip


def _graft_merge_cpu(*args):
    tree, rest, out = Tree(*args[:8]), args[8:-8], args[-8:]
    r_tok, r_par, r_dep, r_num, max_depth, budget, budget_int = rest
    retrieved = Retrieved(r_tok, r_par, r_dep, r_num, max_depth)
    res = _ref.graft_merge(tree, retrieved, budget if budget is not None else budget_int)
    _copy_into(res, out)


_graft_merge_op = define(
    f"graft_merge({TREE}, Tensor r_tokens, Tensor r_parents, Tensor r_depth, "
    f"Tensor r_num_nodes, int max_depth, Tensor? budget, int budget_int, {OUT_TREE}) -> ()",
    cpu=_graft_merge_cpu,
    cuda=_graft_merge_cuda,
)


def _graft_cuda(*args):
    tree, rest, out = Tree(*args[:8]), args[8:-8], args[-8:]
    table, par, rank, dep, max_depth, level_width, budget, budget_int, count, count_int = rest
    with cuda_device(table):
        _k.graft_fused(
            tree, budget if budget is not None else budget_int, table=table, t_parents=par,
            t_ranks=rank, t_depth=dep, max_depth=max_depth, level_width=level_width,
            count=count if count is not None else count_int, out=out,
        )  # fmt: skip


def _graft_cpu(*args):
    tree, rest, out = Tree(*args[:8]), args[8:-8], args[-8:]
    table, par, rank, dep, max_depth, _lw, budget, budget_int, count, count_int = rest
    res = _ref.graft(
        tree, table, _template(par, rank, dep, max_depth),
        budget if budget is not None else budget_int, count if count is not None else count_int,
    )  # fmt: skip
    _copy_into(res, out)


_graft_op = define(
    f"graft({TREE}, Tensor table, Tensor t_parents, Tensor t_ranks, Tensor t_depth, "
    "int max_depth, int level_width, Tensor? budget, int budget_int, Tensor? count, "
    f"int count_int, {OUT_TREE}) -> ()",
    cpu=_graft_cpu,
    cuda=_graft_cuda,
)


def _empty_tree(like: Tree) -> Tree:
    """Uninitialised output buffers of ``like``'s shapes (the op writes every element)."""
    return Tree(*[torch.empty_like(t) for t in like.tensors()])


def _split(x: torch.Tensor | int | None, default: int) -> tuple[torch.Tensor | None, int]:
    """``(tensor, int)`` op arguments for an int-or-tensor argument (None: ``default``)."""
    if isinstance(x, torch.Tensor):
        return x, 0
    return None, default if x is None else x


_PASSED = Memo()
"""Signatures (``_key``) of calls whose checks passed with ``validate=False``."""


def _fields(x: object) -> tuple:
    """A ``Tree``'s or ``Retrieved``'s tensors for ``signature``; anything else as itself."""
    if isinstance(x, Tree):
        return x.tensors()  # type: ignore[attr-defined]
    if isinstance(x, Retrieved):
        return (x.tokens, x.parents, x.depth, x.num_nodes)  # type: ignore[attr-defined]
    return (x,)


def _key(op: str, objects: tuple, tensors: tuple, values: tuple) -> tuple:
    """``(key, flat)``: the memo and replay key of a call, and the tensors it is the signature
    of (``flat``, the ``tensors`` a ``Replays`` re-reads the pointers of). The key holds
    ``op``, the fields of ``objects`` (trees, retrieved paths) with their types (which fix how
    many fields each has), ``tensors`` (int-or-tensor arguments included: a non-tensor one
    counts as None in ``flat`` and as a value, so an int launched as a scalar is in the key)
    and plain ``values``; None where some argument is no tensor (the full checks run)."""
    flat: list = []
    classes: list = [op]
    for o in objects:
        flat += _fields(o)
        classes.append(o.__class__)
    for t in tensors:
        if isinstance(t, torch.Tensor) or t is None:
            flat.append(t)
        else:
            flat.append(None)
            classes.append(t)
    return signature(flat, (*classes, *values)), tuple(flat)


_UPDATE_REPLAYS = Replays("adjacency_update")
_WARM_START_REPLAYS = Replays("adjacency_warm_start")
_RETRIEVE_REPLAYS = Replays("adjacency_retrieve")
_GRAFT_MERGE_REPLAYS = Replays("graft_merge")
_GRAFT_REPLAYS = Replays("graft")
"""Calls per ``_key`` replayed without the ops' Python layers (``treeops.kernels._replay``).
Every buffer the kernels read or write is among a replay's tensors (an ``AdjacencyTable``'s
table, owner and update workspace, a template's device tensors), or a result or
``_launch.scratch`` buffer the op makes: two tables, or templates, of equal shapes share a key,
so their pointers must be re-read per call."""


def _tuning() -> tuple:
    """The update's launch configuration (``kernels.graft_update.UPDATE_TUNING``: block, warps,
    top-k method, merge, hence the splits of V): part of the update's keys, so that a recorded
    update is not replayed under another configuration (``bench/bench_graft.py``'s sweep changes
    it)."""
    return tuple(_ku.UPDATE_TUNING.items())


def _check_budget(budget: torch.Tensor | int, B: int, dev: torch.device, N: int) -> None:
    if isinstance(budget, torch.Tensor):
        check_tensor("budget", budget, shape=(B,), dtype=torch.int32, unit_last=True)
        if budget.device != dev:
            raise ValueError(f"Invalid device of budget: expected {dev}, got {budget.device}")
    elif not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(
            f"Invalid value of budget: expected an int >= 1 or a [B] int32 tensor, got {budget!r}"
        )


def _check_budget_values(budget: torch.Tensor, tree: Tree) -> None:
    """Host-side (``validate=True``): the budget counts the root, so an active request needs
    at least 1 (a budget of 0 would silently turn it into an inactive row)."""
    check_range("budget", budget, 0)
    bad = (budget < 1) & (tree.num_nodes > 0)
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"Invalid value in budget: expected >= 1 for an active request (the root counts), "
            f"got {int(budget[b])} at request {b}"
        )


def _check_count(count: torch.Tensor | int | None, B: int, dev: torch.device) -> None:
    if count is None:
        return
    if isinstance(count, torch.Tensor):
        check_tensor("count", count, shape=(B,), dtype=torch.int32, unit_last=True)
        if count.device != dev:
            raise ValueError(f"Invalid device of count: expected {dev}, got {count.device}")
    elif not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(
            f"Invalid value of count: expected an int >= 0, a [B] int32 tensor or "
            f"None, got {count!r}"
        )


class AdjacencyTable:
    """Successor table ``table`` [V, k] int32 on ``device``: row t holds the target's top-k
    next tokens after token t, -1 = empty (Token Recycling's adjacency matrix).

    ``update`` learns from every verification, ``warm_start`` from a prompt's prefill,
    ``retrieve`` reads candidate continuations through a ``RankTemplate``. On CUDA the table
    also keeps an owner buffer [V] int32 (all INT32_MAX between calls) that resolves duplicate
    tokens deterministically without a host sync, and reuses a small workspace per shape.
    """

    def __init__(self, vocab_size: int, k: int = 8, device: torch.device | str = "cpu"):
        check_positive_int("vocab_size", vocab_size)
        check_positive_int("k", k)
        self.vocab_size = vocab_size
        self.k = k
        self.table = torch.full((vocab_size, k), -1, dtype=torch.int32, device=device)
        self._owner: torch.Tensor | None = None
        self._workspace: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        if self.table.is_cuda:
            self._owner = torch.full((vocab_size,), 2**31 - 1, dtype=torch.int32, device=device)

    @property
    def device(self) -> torch.device:
        return self.table.device

    def reset(self) -> None:
        """Empty every row."""
        self.table.fill_(-1)

    def _check_rows(
        self,
        what: str,
        rows: torch.Tensor,
        B: int,
        N: int,
        logits: torch.Tensor | None,
        ids: torch.Tensor | None,
        validate: bool,
    ) -> None:
        if (logits is None) == (ids is None):
            raise ValueError(
                f"{what}: expected exactly one of the logits and topk_ids, got "
                f"{'both' if logits is not None else 'neither'}"
            )
        if logits is not None:
            name = "target_logits" if what == "update" else "prefill_logits"
            check_tensor(
                name,
                logits,
                shape=(B, N, self.vocab_size),
                dtype=(torch.float32, torch.bfloat16, torch.float16),
            )
            if logits.stride(2) != 1:
                raise ValueError(
                    f"Invalid stride of {name}: expected the last dimension "
                    f"contiguous (stride 1), got strides {tuple(logits.stride())}"
                )
        if ids is not None:
            # the kernel gets topk_ids' strides of B and N; the last dim must be unit-stride
            # (checked here, before any launch: a failed update must not leave claims behind)
            check_tensor("topk_ids", ids, shape=(B, N, None), dtype=torch.int32, unit_last=True)
            if ids.shape[2] < 1:
                raise ValueError("Invalid shape of topk_ids: expected at least one id per node")
        check_same_device(table=self.table, tokens=rows, logits=logits, topk_ids=ids)
        if validate:
            check_range("tokens", rows, 0, self.vocab_size)
            if ids is not None:
                check_range("topk_ids", ids, -1, self.vocab_size)

    def update(
        self,
        tree: Tree,
        target_logits: torch.Tensor | None = None,
        topk_ids: torch.Tensor | None = None,
        *,
        validate: bool = False,
    ) -> None:
        """Learn from a verification: for every node ``i < num_nodes[b]``, the row of its token
        becomes the top-k tokens of the target's logits at that node.

        Args:
            tree: the verified tree ([B, N]).
            target_logits: [B, N, V] float32/bf16/fp16, the target's logits at each node (last
                dimension contiguous); top-k by value, ties to the lowest id. Or:
            topk_ids: [B, N, k'] int32, the node's top-k ids as acceptance returns them from its
                single pass over the logits (-1 padded); the first k are used, -1 pads to k.
        When one token sits at several nodes, the node of lowest flattened index ``b*N + i``
        wins. Nodes whose token is outside ``[0, V)`` are skipped. No host sync.

        Shapes, dtypes, devices and strides are always checked (``topk_ids``' last dimension
        unit-stride, before any launch); values are the caller's responsibility when
        ``validate=False``: ``num_nodes > N`` or ``topk_ids`` entries outside ``[-1, V)`` are
        undefined behaviour; ``validate=True`` checks them (with a host sync).
        """
        key = None
        if not validate:
            key = _key(
                "update", (tree,), (self.table, self._owner, target_logits, topk_ids),
                (self.__class__, self.vocab_size, _tuning()),
            )[0]  # fmt: skip
        if _PASSED.get(key) is None:
            check_tree(tree, validate=validate)
            self._check_rows(
                "update", tree.tokens, tree.batch_size, tree.capacity, target_logits, topk_ids,
                validate,
            )  # fmt: skip
            _PASSED.put(key, True)
        ws = self._update_workspace(tree.tokens, target_logits)
        # the workspace's shapes follow from the key (the tree's and table's shapes, the device,
        # the tuning); its pointers are re-read: the table's own, cached per shape
        tensors = (self.table, self._owner, *ws, *tree.tensors(), target_logits, topk_ids)
        if _UPDATE_REPLAYS.run(key, tensors) is not MISS:
            return
        _UPDATE_REPLAYS.call(key, tensors, _adjacency_update_op, *tensors)

    def warm_start(
        self,
        prompt_tokens: torch.Tensor,
        prefill_logits: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        topk_ids: torch.Tensor | None = None,
        *,
        validate: bool = False,
    ) -> None:
        """Learn from prompts: for ``t < lengths[b]``, the row of ``prompt_tokens[b, t]``
        becomes the top-k of ``prefill_logits[b, t]`` (the target's prediction after it).

        Args:
            prompt_tokens: [B, L] int64, prompts padded to L.
            prefill_logits: [B, L, V] float32/bf16/fp16 (last dimension contiguous), or
            topk_ids: [B, L, k'] int32.
            lengths: [B] int32 prompt lengths (default L for every request).
        The last occurrence of a token (highest ``b*L + t``) wins: the most recent context.
        ``prompt_tokens`` must be contiguous, ``lengths`` unit-stride. Values are the caller's
        responsibility when ``validate=False``: ``lengths > L`` or ``topk_ids`` entries outside
        ``[-1, V)`` are undefined behaviour; ``validate=True`` checks them (with a host sync).
        """
        key = None
        if not validate:
            key = _key(
                "warm_start", (),
                (prompt_tokens, prefill_logits, lengths, topk_ids, self.table, self._owner),
                (self.__class__, self.vocab_size, _tuning()),
            )[0]  # fmt: skip
        passed = _PASSED.get(key) is not None
        if not passed:
            check_tensor(
                "prompt_tokens", prompt_tokens, shape=("B", "L"), dtype=torch.int64,
                contiguous=True,
            )  # fmt: skip
        B, L = prompt_tokens.shape
        if lengths is None:
            lengths = torch.full((B,), L, dtype=torch.int32, device=prompt_tokens.device)
        if not passed:
            check_tensor("lengths", lengths, shape=(B,), dtype=torch.int32, unit_last=True)
            check_same_device(prompt_tokens=prompt_tokens, lengths=lengths)
            self._check_rows("warm_start", prompt_tokens, B, L, prefill_logits, topk_ids, validate)
            if validate:
                check_range("lengths", lengths, 0, L + 1)
            _PASSED.put(key, True)
        ws = self._update_workspace(prompt_tokens, prefill_logits)
        # default lengths are made above on every call (a fill) and re-read like given ones;
        # their shape, like the workspace's, follows from the key
        tensors = (self.table, self._owner, *ws, prompt_tokens, prefill_logits, lengths, topk_ids)
        if _WARM_START_REPLAYS.run(key, tensors) is not MISS:
            return
        _WARM_START_REPLAYS.call(key, tensors, _warm_start_op, *tensors)

    def retrieve(
        self,
        root_tokens: torch.Tensor,
        template: RankTemplate,
        count: torch.Tensor | int | None = None,
    ) -> Retrieved:
        """Fill ``template`` breadth-first from each root token by gathers from the table.

        Args:
            root_tokens: [B] int64 (e.g. ``tree.tokens[:, 0]``).
            template: a ``RankTemplate`` with ``max_rank < k``.
            count: at most this many retrieved nodes per request, root excluded ([B] int32 or
                int; default the whole template).
        Returns a ``Retrieved`` of capacity T = ``template.size``: empty entries (-1) and their
        subtrees are skipped, and the nodes left are packed in template order after the root.
        """
        key = None
        tensors: tuple = ()
        if isinstance(template, RankTemplate):
            # the template's device tensors are launched: re-read per call (equal templates
            # share a key); its depth bounds the kernel's loop, a launched scalar
            par, rank, dep = template.tensors(self.device)
            key, tensors = _key(
                "retrieve", (), (self.table, root_tokens, par, rank, dep, count),
                (self.__class__, self.k, template.max_rank, template.max_depth),
            )  # fmt: skip
        if _PASSED.get(key) is None:
            check_tensor("root_tokens", root_tokens, shape=("B",), dtype=torch.int64)
            self._check_template(template)
            check_same_device(table=self.table, root_tokens=root_tokens)
            _check_count(count, root_tokens.shape[0], self.device)
            _PASSED.put(key, True)
            par, rank, dep = template.tensors(self.device)
        # the op's four tensors, replayed or not; the Retrieved is built here (its max_depth is
        # no tensor, so a replay cannot rebuild it from its fields)
        res = _RETRIEVE_REPLAYS.run(key, tensors)
        if res is MISS:
            res = _RETRIEVE_REPLAYS.call(
                key, tensors, _retrieve_op, self.table, root_tokens, par, rank, dep,
                template.max_depth, *_split(count, template.size - 1),
            )  # fmt: skip
        return Retrieved(*res, template.max_depth)

    def _update_workspace(
        self, tokens: torch.Tensor, logits: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The CUDA update's workspace for these shapes (cached per shape), or Nones
        (CPU table, ``topk_ids`` given, or no node)."""
        n_flat = tokens.numel()
        if logits is None or not self.table.is_cuda or n_flat == 0:
            return None, None
        key = _ku.update_workspace_key(n_flat, self.vocab_size, self.k, self.device)
        if key not in self._workspace:
            self._workspace[key] = (
                torch.empty(key[0] * key[1], dtype=torch.float32, device=self.device),
                torch.empty(key[0] * key[2], dtype=torch.int32, device=self.device),
            )
        return self._workspace[key]

    def _check_template(self, template: object) -> None:
        if not isinstance(template, RankTemplate):
            raise ValueError(
                f"Invalid type of template: expected treeops.RankTemplate, got "
                f"{type(template).__name__}"
            )
        if template.max_rank >= self.k:
            raise ValueError(
                f"Invalid template: rank {template.max_rank} needs k > "
                f"{template.max_rank}, but the table has k = {self.k}"
            )


def graft_merge(
    tree: Tree,
    retrieved: Retrieved,
    budget: torch.Tensor | int,
    *,
    out: Tree | None = None,
    validate: bool = False,
) -> Tree:
    """Insert retrieved paths into a (pruned) tree as into a trie, up to ``budget`` nodes.

    Args:
        tree: [B, N] the pruned draft tree (nodes ``< num_nodes[b]`` are kept, in rank order).
        retrieved: paths from ``AdjacencyTable.retrieve``; retrieved node 0 stands for the root.
        budget: nodes per request, root included: an int or a [B] int32 tensor (CAST's
            per-request verify count); values above N act as N.
    Returns a new ``Tree`` of capacity N: request b keeps its first ``min(num_nodes, budget)``
    nodes unchanged, then retrieved nodes in retrieval order: one whose token already sits
    among its merged parent's children reuses that node, otherwise it becomes a new node of score
    0 while fewer than ``budget`` nodes are used (else it is dropped with its subtree). Depth,
    ``anc`` and the links are rebuilt; the result passes ``Tree.validate()``. ``out``: a
    ``Tree`` of the same shape (not ``tree`` itself) to write into instead of allocating.

    Shapes, dtypes, devices and strides are always checked (tree and retrieved fields contiguous,
    a [B] ``budget`` unit-stride); values are the caller's responsibility when
    ``validate=False``: a malformed tree or ``retrieved`` (``num_nodes > N`` or ``> T``, parents
    out of range) is undefined behaviour; ``validate=True`` checks them (with a host sync).
    """
    key = None
    tensors: tuple = ()
    if not validate:
        max_depth = retrieved.max_depth if isinstance(retrieved, Retrieved) else None
        key, tensors = _key("graft_merge", (tree, retrieved, out), (budget,), (max_depth,))
    if _PASSED.get(key) is None:
        check_tree(tree, validate=validate)
        if not isinstance(retrieved, Retrieved):
            raise ValueError(
                "Invalid type of retrieved: expected treeops.Retrieved, got "
                f"{type(retrieved).__name__}"
            )
        retrieved.check_fields()
        B, N = tree.batch_size, tree.capacity
        if retrieved.tokens.shape[0] != B:
            raise ValueError(
                f"Invalid shape of retrieved.tokens: expected [{B}, T], got "
                f"{list(retrieved.tokens.shape)}"
            )
        check_same_device(tree=tree.parents, retrieved=retrieved.tokens)
        _check_budget(budget, B, tree.device, N)
        if validate:
            retrieved.validate()
            if isinstance(budget, torch.Tensor):
                _check_budget_values(budget, tree)
        _check_out(out, tree)
        _PASSED.put(key, True)
    elif out is not None:
        _check_out_memory(out, tree)
    res = _GRAFT_MERGE_REPLAYS.run(key, tensors)
    if res is not MISS:
        return res if out is None else out
    result, out = _result_tree(out, tree)
    _GRAFT_MERGE_REPLAYS.call(
        key, tensors, _graft_merge_op, *tree.tensors(), retrieved.tokens, retrieved.parents,
        retrieved.depth, retrieved.num_nodes, retrieved.max_depth, *_split(budget, 0),
        *out.tensors(), result=result,
    )  # fmt: skip
    return out


def _result_tree(out: Tree | None, tree: Tree) -> tuple[Tree | None, Tree]:
    """``(result, out)`` of an op that writes a tree: without ``out``, fresh buffers that a
    replay makes fresh too and returns; with it, ``out`` itself, which a replay writes and the
    public function returns (the same object: a replay's result is None)."""
    if out is None:
        out = _empty_tree(tree)
        return out, out
    return None, out


def graft(
    tree: Tree,
    table: AdjacencyTable,
    template: RankTemplate,
    budget: torch.Tensor | int,
    count: torch.Tensor | int | None = None,
    *,
    out: Tree | None = None,
    validate: bool = False,
) -> Tree:
    """Retrieve from each request's root token and merge, in one launch on CUDA:
    ``graft_merge(tree, table.retrieve(tree.tokens[:, 0], template, count), budget)``.

    Shapes and ``out`` as in ``graft_merge``; the template has at most 256 nodes. No host sync.
    Values are unchecked when ``validate=False`` (a malformed tree, e.g. ``num_nodes > N``, is
    undefined behaviour); ``validate=True`` checks them (with a host sync).
    """
    key = None
    tensors: tuple = ()
    if not validate and isinstance(table, AdjacencyTable) and isinstance(template, RankTemplate):
        # the template's device tensors are launched (re-read per call: equal templates share
        # a key), its depth and widest level as scalars
        par, rank, dep = template.tensors(table.device)
        key, tensors = _key(
            "graft", (tree, out), (table.table, par, rank, dep, budget, count),
            (table.k, template.max_rank, template.max_depth, template.max_width),
        )  # fmt: skip
    if _PASSED.get(key) is None:
        _check_graft_args(tree, table, budget, count, out, validate)
        table._check_template(template)
        _PASSED.put(key, True)
        par, rank, dep = template.tensors(tree.device)
    elif out is not None:
        _check_out_memory(out, tree)
    res = _GRAFT_REPLAYS.run(key, tensors)
    if res is not MISS:
        return res if out is None else out
    result, out = _result_tree(out, tree)
    _GRAFT_REPLAYS.call(
        key, tensors, _graft_op, *tree.tensors(), table.table, par, rank, dep,
        template.max_depth, template.max_width, *_split(budget, 0),
        *_split(count, template.size - 1), *out.tensors(), result=result,
    )  # fmt: skip
    return out


def _check_graft_args(tree: Tree, table: object, budget, count, out, validate: bool) -> None:
    """The arguments ``graft`` and ``graft_tail`` share: ``tree`` a valid ``Tree`` (its values
    too with ``validate``), ``table`` an ``AdjacencyTable`` on its device, ``budget`` and
    ``count`` ints or [B] int32 tensors there (``budget`` values too with ``validate``), ``out``
    None or a tree of ``tree``'s shape."""
    check_tree(tree, validate=validate)
    if not isinstance(table, AdjacencyTable):
        raise ValueError(
            f"Invalid type of table: expected treeops.AdjacencyTable, got {type(table).__name__}"
        )
    check_same_device(tree=tree.parents, table=table.table)
    _check_budget(budget, tree.batch_size, tree.device, tree.capacity)
    _check_count(count, tree.batch_size, tree.device)
    if validate and isinstance(budget, torch.Tensor):
        _check_budget_values(budget, tree)
    _check_out(out, tree)


def _check_out(out: Tree | None, tree: Tree) -> None:
    if out is None:
        return
    out = check_tree(out, name="out")
    if out.parents.shape != tree.parents.shape or out.device != tree.device:
        raise ValueError(
            f"Invalid shape of out: expected a tree of shape "
            f"{list(tree.parents.shape)} on {tree.device}, got "
            f"{list(out.parents.shape)} on {out.device}"
        )
    _check_out_memory(out, tree)


def _check_out_memory(out: Tree, tree: Tree) -> None:
    """No field of ``out`` starts where a field of ``tree`` does (checked on every call:
    addresses are no metadata; one set test in C, no Python loop)."""
    ptr = torch.Tensor.data_ptr
    if not set(map(ptr, out.tensors())).isdisjoint(map(ptr, tree.tensors())):
        raise ValueError("Invalid out: it shares memory with tree (the op does not work in place)")
